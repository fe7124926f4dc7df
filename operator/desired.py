"""Pure functions from an InferencePool to the objects that should exist. No API calls here.

`desired_objects(pool, caps, current_replicas)` returns plain dicts ready for server-side apply:
the engine ConfigMap, router RBAC, three Services, three Deployments, PDBs, and (where the cluster has
those CRDs) a ServiceMonitor and a Gateway API Inference Extension InferencePool. Each carries a
controller owner reference to the pool, so deletion is left to the garbage collector.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from . import security
from . import spec as S
from tandem.worker.api.config import startup_seconds
from tandem.worker.api.names import CPU_THREADS_ENV, KV_PORT, LABEL_POOL, LABEL_ROLE, selector

ANN_CONFIG_HASH = "serving.tandem.dev/config-hash"
ANN_DESIRED_HASH = "serving.tandem.dev/desired-hash"
CONFIG_DIR = "/etc/tandem"
MODELS_MOUNT = "/mnt/models"
TERMINATION_LOG = "/dev/termination-log"
RUN_AS_USER = 10001

#: Seconds a worker may take to drain in-flight requests before SIGKILL (preStop + SIGTERM).
WORKER_GRACE_SECONDS = 120
ROUTER_GRACE_SECONDS = 30


@dataclass(frozen=True)
class Capabilities:
    """What the cluster serves, found by discovery (the only non-spec input besides replicas)."""
    pdb_api_version: str = "policy/v1"
    service_monitor: bool = False                 # monitoring.coreos.com/v1 servicemonitors
    gie_api_version: Optional[str] = None          # inference.networking.x-k8s.io/v1alpha2 or ...k8s.io/v1
    pod_deletion_cost: bool = False                # 1.21+
    network_policies: bool = True                  # networking.k8s.io/v1 networkpolicies
    #: where the operator runs (its pod's POD_NAMESPACE): the pools' NetworkPolicies admit its pods from
    #: that namespace only. None (tests, out of cluster): its pods from any namespace.
    operator_namespace: Optional[str] = None
    #: where the API server is (the chart's networkPolicy.apiServerCIDRs, TANDEM_API_SERVER_CIDRS): the
    #: router's egress to it (discovery). Empty: any address.
    api_server_cidrs: tuple[str, ...] = ()


def labels(pool: str, role: Optional[str] = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": pool,
           "app.kubernetes.io/managed-by": "tandem-operator", LABEL_POOL: pool}
    if role:
        out["app.kubernetes.io/component"] = role
        out[LABEL_ROLE] = role
    return out


def owner_reference(pool: S.InferencePool) -> dict[str, Any]:
    return {"apiVersion": S.API_VERSION, "kind": S.KIND, "name": pool.metadata.name,
            "uid": pool.metadata.uid or "", "controller": True, "blockOwnerDeletion": True}


def _meta(pool: S.InferencePool, name: str, role: Optional[str] = None) -> dict[str, Any]:
    return {"name": name, "namespace": pool.metadata.namespace or "default",
            "labels": labels(pool.metadata.name, role), "ownerReferences": [owner_reference(pool)]}


def config_map_name(pool: str) -> str:
    return f"{pool}-config"


def router_sa_name(pool: str) -> str:
    return f"{pool}-router"


def kubernetes_worker_config(pool: S.InferencePool, role: str) -> S.WorkerConfig:
    """The role's config as mounted in its pod: a PVC source becomes a path under MODELS_MOUNT."""
    cfg = S.worker_config(pool, role)
    src = cfg.model.source
    if src.pvc is not None:
        path = f"{MODELS_MOUNT}/{src.pvc.path}".rstrip("/") if src.pvc.path else MODELS_MOUNT
        cfg.model.source = S.ModelSource(path=path)
    return cfg


def role_hash(pool: S.InferencePool, role: str) -> str:
    """The hash of what a role's process reads from its config file; it sits in the pod template, so a
    change rolls exactly the roles it affects."""
    cfg = kubernetes_worker_config(pool, role)
    return S.config_hash(S.role_config_relevant(cfg, role))


def desired_replicas(role: S.RoleSpec, current: Optional[int]) -> int:
    """Fixed replicas when autoscaling is off. When on, the autoscaler owns the count: keep the
    current one clamped to [min, max], or start at minReplicas."""
    a = role.autoscaling
    if a is None or not a.enabled:
        return S.initial_replicas(role)
    if current is None:
        return a.minReplicas
    hi = a.maxReplicas if a.maxReplicas is not None else current
    return max(a.minReplicas, min(hi, current))


def with_observed_replicas(want: dict[str, Any], pool: S.InferencePool, have: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``want`` (a role's Deployment) with the count taken from ``have``, the object it is compared with,
    when that role is autoscaled and the Deployment exists.

    The count must come from the same read as the comparison: taken from an earlier read, a scale by
    the autoscaler in between made the pass see a changed count and apply the old one back (a second
    writer of replicas, on the standby operator replica too). Returns ``want`` itself when nothing
    changes."""
    role = (want.get("metadata", {}).get("labels") or {}).get(LABEL_ROLE)
    if have is None or role not in ("prefill", "decode"):
        return want
    count = desired_replicas(getattr(pool.spec, role), (have.get("spec") or {}).get("replicas", 1))
    if count == want["spec"].get("replicas"):
        return want
    return {**want, "spec": {**want["spec"], "replicas": count}}


def _resources(r: S.ResourceRequirements) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if r.limits:
        out["limits"] = dict(r.limits)
    if r.requests:
        out["requests"] = dict(r.requests)
    # Extended resources (GPUs) must have requests == limits; Kubernetes defaults requests from limits.
    return out


def config_map(pool: S.InferencePool) -> dict[str, Any]:
    name = pool.metadata.name
    data = {f"{role}.yaml": kubernetes_worker_config(pool, role).to_yaml() for role in S.ROLES}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(pool, config_map_name(name)), "data": data}


def router_rbac(pool: S.InferencePool) -> list[dict[str, Any]]:
    name = pool.metadata.name
    sa = router_sa_name(name)
    ns = pool.metadata.namespace or "default"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(pool, sa, "router")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(pool, sa, "router"),
         # EndpointSlices where served; Endpoints as the fallback (worker/router/discovery_k8s.py)
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]},
                   {"apiGroups": [""], "resources": ["endpoints"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(pool, sa, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]},
    ]


def service(pool: S.InferencePool, role: str) -> dict[str, Any]:
    name = pool.metadata.name
    spec: dict[str, Any] = {"selector": selector(name, role),
                            "ports": [{"name": "http", "port": S.WORKER_PORT, "targetPort": "http",
                                       "protocol": "TCP"}]}
    if role != "router":
        spec["clusterIP"] = "None"  # headless: the router reads the ready endpoints
    else:
        spec["type"] = "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(pool, S.service_name(name, role), role),
            "spec": spec}


def startup_probe(sp, role: str) -> dict[str, Any]:
    """The startup probe: ``/health`` answers 503 while a worker loads (its phase in the body), so a
    worker gets ``startup_seconds`` (300 s + 60 s per GiB of ``spec.model.size``) before the kubelet
    restarts it; the router, which loads only a tokenizer, gets 600 s."""
    period = 10
    seconds = startup_seconds(sp.model) if role != "router" else 600
    return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
            "failureThreshold": -(-seconds // period), "timeoutSeconds": 2}


def deployment(pool: S.InferencePool, role: str, replicas: int) -> dict[str, Any]:
    name = pool.metadata.name
    sp = pool.spec
    worker = role != "router"
    grace = WORKER_GRACE_SECONDS if worker else ROUTER_GRACE_SECONDS
    res = sp.router.resources if role == "router" else getattr(sp, role).resources
    cmd = ["tandem", "serve", "--role", role, "--config", f"{CONFIG_DIR}/{role}.yaml",
           "--host", "0.0.0.0", "--port", str(S.WORKER_PORT)]
    ports = [{"name": "http", "containerPort": S.WORKER_PORT, "protocol": "TCP"}]
    if role == "prefill":
        cmd += ["--kv-port", str(KV_PORT)]
        ports.append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    # Every role reads the model: workers the weights, the router its tokenizer (#13: the router of a
    # PVC pool could never start).
    if sp.model.source.pvc is not None:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": sp.model.source.pvc.claimName,
                                                                    "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    container: dict[str, Any] = {
        "name": "tandem",
        "image": sp.engine.image,
        "imagePullPolicy": "IfNotPresent",
        "command": cmd,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HOME", "value": "/tmp"},
            # where `tandem serve` writes its fatal error; the kubelet reports it in lastState.terminated
            {"name": "TANDEM_TERMINATION_LOG", "value": TERMINATION_LOG},
        ] + ([{"name": CPU_THREADS_ENV, "valueFrom": {"resourceFieldRef": {   # torch threads = the CPU request
            "containerName": "tandem", "resource": "requests.cpu", "divisor": "1"}}}]
             if worker and (res.requests or {}).get("cpu") is not None else []),
        "terminationMessagePath": TERMINATION_LOG,
        # an error before the worker could write its message (an import, say) still shows: the log's tail
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": ports,
        "resources": _resources(res),
        "startupProbe": startup_probe(sp, role),
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6, "timeoutSeconds": 5},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 1, "successThreshold": 1, "timeoutSeconds": 2},
        "lifecycle": {"preStop": {"exec": {"command": [
            "python", "-m", "tandem.operator.drain", "--port", str(S.WORKER_PORT),
            "--timeout", str(grace - 10)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
    }
    if role == "router":
        pod_spec["serviceAccountName"] = router_sa_name(name)
    else:
        pod_spec["automountServiceAccountToken"] = False
    tmpl_meta = {"labels": labels(name, role), "annotations": {ANN_CONFIG_HASH: role_hash(pool, role)}}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(pool, S.service_name(name, role), role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(name, role)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": max(900, startup_seconds(sp.model) + 300) if worker else 900,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": tmpl_meta, "spec": pod_spec},
        },
    }


def pdb(pool: S.InferencePool, role: str, api_version: str) -> dict[str, Any]:
    name = pool.metadata.name
    return {"apiVersion": api_version, "kind": "PodDisruptionBudget",
            "metadata": _meta(pool, S.service_name(name, role), role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name, role)}}}


def service_monitor(pool: S.InferencePool) -> dict[str, Any]:
    name = pool.metadata.name
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _meta(pool, name),
            "spec": {"selector": {"matchLabels": {LABEL_POOL: name}},
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}


def gie_inference_pool(pool: S.InferencePool, api_version: str) -> dict[str, Any]:
    """A Gateway API Inference Extension InferencePool selecting the router pods on the router's port."""
    name = pool.metadata.name
    epp = pool.spec.gateway.endpointPickerRef  # type: ignore[union-attr]
    sel = selector(name, "router")
    if api_version.startswith("inference.networking.x-k8s.io/"):
        spec = {"selector": sel, "targetPortNumber": S.WORKER_PORT,
                "extensionRef": {"name": epp.name, "portNumber": epp.port, "failureMode": "FailClose"}}
    else:  # inference.networking.k8s.io/v1
        spec = {"selector": {"matchLabels": sel}, "targetPorts": [{"number": S.WORKER_PORT}],
                "endpointPickerRef": {"name": epp.name, "port": {"number": epp.port}, "failureMode": "FailClose"}}
    return {"apiVersion": api_version, "kind": "InferencePool", "metadata": _meta(pool, name), "spec": spec}


def desired_objects(pool: S.InferencePool, caps: Capabilities = Capabilities(),
                    current_replicas: Optional[dict[str, int]] = None,
                    pool_secret_hash: Optional[str] = None) -> list[dict[str, Any]]:
    """Every child the pool should have, in apply order, but the pool Secret (random: the reconciler
    makes it, and passes its digest as ``pool_secret_hash``; see security.py)."""
    cur = current_replicas or {}
    objs: list[dict[str, Any]] = [config_map(pool), *router_rbac(pool)]
    objs += [service(pool, r) for r in S.ROLES]
    reps = {"prefill": desired_replicas(pool.spec.prefill, cur.get("prefill")),
            "decode": desired_replicas(pool.spec.decode, cur.get("decode")),
            "router": pool.spec.router.replicas}
    for r in S.ROLES:
        dep = deployment(pool, r, reps[r])
        security.add_credentials(dep, pool, r, pool_secret_hash)
        objs.append(dep)
    if caps.network_policies:
        objs += security.network_policies(pool, lambda name, role: _meta(pool, name, role),
                                          caps.operator_namespace, caps.api_server_cidrs)
    objs += [pdb(pool, r, caps.pdb_api_version) for r in S.ROLES]
    if caps.service_monitor:
        objs.append(service_monitor(pool))
    if caps.gie_api_version and pool.spec.gateway is not None and pool.spec.gateway.endpointPickerRef is not None:
        objs.append(gie_inference_pool(pool, caps.gie_api_version))
    for o in objs:
        o["metadata"].setdefault("annotations", {})[ANN_DESIRED_HASH] = desired_hash(o)
    return objs


def desired_hash(obj: dict[str, Any]) -> str:
    md = dict(obj["metadata"])
    md["annotations"] = {k: v for k, v in (md.get("annotations") or {}).items() if k != ANN_DESIRED_HASH}
    o = {**obj, "metadata": md}
    if obj.get("kind") == "Deployment":
        # Not the count: the autoscaler changes it, and a new hash would make every pass after a scale
        # re-apply the Deployment with the count it read (a race with the next scale, and a write by
        # every operator replica). needs_apply still compares the count itself.
        o["spec"] = {k: v for k, v in obj["spec"].items() if k != "replicas"}
    return hashlib.sha256(json.dumps(o, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _is_zero(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == "" or v == [] or v == {}


def is_subset(want: Any, have: Any) -> bool:
    """Whether everything in `want` is present and equal in `have` (the server adds defaults)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return False
        # A zero value the server omits (omitempty: false, 0, "", [], {}) matches an absent key.
        return all((is_subset(v, have[k]) if k in have else _is_zero(v)) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return False
        return all(is_subset(w, h) for w, h in zip(want, have))
    if isinstance(want, (int, float)) and isinstance(have, (int, float)) and not isinstance(want, bool):
        return want == have
    return want == have


def needs_apply(want: dict[str, Any], have: Optional[dict[str, Any]]) -> bool:
    """Compare before applying: apply when the object is missing, was made from another desired state
    (hash annotation), or had one of our fields changed by someone else."""
    if have is None:
        return True
    ann = (have.get("metadata") or {}).get("annotations") or {}
    if ann.get(ANN_DESIRED_HASH) != want["metadata"]["annotations"][ANN_DESIRED_HASH]:
        return True
    w = {k: v for k, v in want.items() if k not in ("apiVersion", "kind", "status")}
    return not is_subset(w, have)


def dump(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)
