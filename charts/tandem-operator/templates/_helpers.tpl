{{- define "tandem-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem-operator.labels" -}}
app.kubernetes.io/name: {{ include "tandem-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tandem-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem-operator.webhookService" -}}
{{- printf "%s-webhook" (include "tandem-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The rules the operator needs in every namespace it serves pools in: in the ClusterRole when it watches
all namespaces, in a Role per namespace of watchNamespaces otherwise (clusterrole.yaml).
*/}}
{{- define "tandem-operator.poolRules" -}}
# The InferencePools themselves (Kopf patches annotations for its progress; status is ours).
- apiGroups: [serving.tandem.dev]
  resources: [inferencepools]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.tandem.dev]
  resources: [inferencepools/status]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need update on the owner's finalizers subresource
# where the OwnerReferencesPermissionEnforcement admission plugin is on.
- apiGroups: [serving.tandem.dev]
  resources: [inferencepools/finalizers]
  verbs: [update]
# The children (server-side apply = patch; create for the first apply).
- apiGroups: [""]
  resources: [configmaps, services, serviceaccounts]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
# list: the resync pass reads a namespace's children with one LIST per kind.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, create, patch]
# The router's Role grants these; RBAC lets the operator grant only what it holds itself.
- apiGroups: [""]
  resources: [endpoints]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
# Status reads the pods' state (restarts, waiting reasons, termination messages); read only.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, list, create, patch]
# The Gateway API Inference Extension InferencePool; deleted when spec.gateway is removed.
- apiGroups: [inference.networking.x-k8s.io, inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, create, patch, delete]
# Each pool's shared secret (operator/security.py): derived from the operator's key (pool_key.py), so
# the operator only creates the pool's Secret and never reads, lists, watches, updates or deletes
# one outside its own namespace (docs/security.md, "The operator's permissions").
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# The pools' NetworkPolicies.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, create, patch]
# Events about what the operator did.
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{- define "tandem-operator.webhookConfigName" -}}
{{- printf "%s.serving.tandem.dev" (include "tandem-operator.fullname" .) -}}
{{- end -}}
