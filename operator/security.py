"""Who may talk to a pool's pods: its shared secret, how pods get it and the API keys, and its
NetworkPolicies (docs/security.md). Pure functions, like desired.py; reconcile.py makes the Secret.

- The pool secret is derived from the operator's key (pool_key.py, HKDF over the pool's namespace,
  name, uid and rotation annotation), so the operator never reads a pool's Secret: it creates
  ``<pool>-pool-secret-<digest>`` (create only; the name carries the digest, so a new secret is a new
  Secret and the old one is never updated). It holds the secret (``secret``, mounted by the workers)
  and the router's pool-token key alone (``router-token``, mounted by the router, which then cannot
  make a KV proof). The digest sits in every pod template (``serving.tandem.dev/pool-secret-hash``),
  so a rotated key rolls every role.
- ``spec.router.apiKeySecretRef`` is mounted into the router pods only; the router re-reads it, so
  changed keys apply without a rollout.
- NetworkPolicies: workers admit the pool's router and each other (HTTP and KV ports), the tandem
  operator's pods and ``spec.networkPolicy.workersFrom`` (HTTP port); the router admits
  ``spec.networkPolicy.routerFrom`` (anyone when empty). Enforced only where the network plugin does.
"""
from __future__ import annotations

import base64
import hashlib
from typing import Any, Optional

from . import pool_key
from . import spec as S
from tandem.worker.api.auth import router_token_key
from tandem.worker.api.names import KV_PORT, LABEL_POOL, LABEL_ROLE, WORKER_ROLES, selector

SECRET_KEY = "secret"
TOKEN_KEY = "router-token"
POOL_SECRET_DIR = "/var/run/tandem/pool-secret"
POOL_TOKEN_DIR = "/var/run/tandem/pool-token"
API_KEYS_DIR = "/var/run/tandem/api-keys"
ANN_SECRET_HASH = "serving.tandem.dev/pool-secret-hash"
#: the operator's own pods (the chart's selector label): they scrape workers and drain them
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "tandem-operator"}


def pool_secret_name(pool: str, digest: str) -> str:
    """The Secret holding the pool secret of this digest (:func:`secret_hash`)."""
    return f"{pool}-pool-secret-{digest[:10]}"


def pool_secret_value(key: bytes, pool: S.InferencePool) -> bytes:
    """The pool's shared secret under the operator's ``key`` (pool_key.pool_secret)."""
    md = pool.metadata
    return pool_key.pool_secret(key, md.namespace or "default", md.name, md.uid or "",
                                md.annotations.get(pool_key.ANN_ROTATE, ""))


def pool_secret_object(pool: S.InferencePool, meta: dict[str, Any], value: bytes) -> dict[str, Any]:
    """The pool's Secret (``meta``: the child metadata desired.py gives every object) for the secret
    ``value``: the secret (workers) and the router's token key alone (64 hex digits)."""
    digest = secret_hash(value)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {**meta, "name": pool_secret_name(pool.metadata.name, digest),
                         "labels": {**meta.get("labels", {}), ANN_SECRET_HASH: digest}},
            "data": {SECRET_KEY: base64.b64encode(value).decode(),
                     TOKEN_KEY: base64.b64encode(router_token_key(value).text().encode()).decode()}}


def secret_hash(value: bytes) -> str:
    """A short digest of a pool secret (what the pod-template annotation and the Secret's name carry;
    not reversible)."""
    return hashlib.sha256(value).hexdigest()[:16]


def add_credentials(dep: dict[str, Any], pool: S.InferencePool, role: str, pool_secret_hash: Optional[str]) -> None:
    """Mount the pool's credential (workers: the secret; the router: its token key alone) and the API
    keys (router) into a Deployment's pod template, and put the secret's digest in its annotations.
    ``pool_secret_hash`` None: no secret yet (the reconciler makes it before the Deployments, so this
    is only the pure functions' default)."""
    tmpl = dep["spec"]["template"]
    pod, c = tmpl["spec"], tmpl["spec"]["containers"][0]
    if pool_secret_hash is not None:
        # only the item the role needs is projected into the pod
        item, mount, env = ((TOKEN_KEY, POOL_TOKEN_DIR, "TANDEM_POOL_TOKEN_KEY_FILE") if role == "router"
                            else (SECRET_KEY, POOL_SECRET_DIR, "TANDEM_POOL_SECRET_FILE"))
        pod["volumes"].append({"name": "pool-secret", "secret": {
            "secretName": pool_secret_name(pool.metadata.name, pool_secret_hash), "defaultMode": 0o440,
            "items": [{"key": item, "path": item}]}})
        c["volumeMounts"].append({"name": "pool-secret", "mountPath": mount, "readOnly": True})
        c["env"].append({"name": env, "value": f"{mount}/{item}"})
        tmpl["metadata"]["annotations"][ANN_SECRET_HASH] = pool_secret_hash
    ref = pool.spec.router.apiKeySecretRef
    if role == "router" and ref is not None:
        pod["volumes"].append({"name": "api-keys", "secret": {"secretName": ref.name, "defaultMode": 0o440}})
        c["volumeMounts"].append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        c["env"].append({"name": "TANDEM_API_KEY_FILE", "value": API_KEYS_DIR})


def _peer(p: S.PolicyPeer) -> dict[str, Any]:
    if p.ipBlock is not None:
        return {"ipBlock": {"cidr": p.ipBlock}}
    out: dict[str, Any] = {}
    if p.podSelector is not None:
        out["podSelector"] = {"matchLabels": dict(p.podSelector)}
    if p.namespaceSelector is not None:
        out["namespaceSelector"] = {"matchLabels": dict(p.namespaceSelector)}
    return out


#: the label the API server puts on every namespace (Kubernetes 1.21+): a namespace by name
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


#: the ports the API server listens on (443 behind the kubernetes Service, 6443 on most control planes:
#: a policy sees the address after the Service's translation)
API_SERVER_PORTS = (443, 6443)


def network_policies(pool: S.InferencePool, meta, operator_namespace: Optional[str] = None,
                     api_server_cidrs: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The pool's NetworkPolicies (``meta(name, role)``: desired.py's child metadata), ingress and
    egress. Empty when ``spec.networkPolicy.enabled`` is false. The operator's pods are admitted from
    ``operator_namespace`` only (by its name label: a pod label alone anyone may set), or from any
    namespace when it is None. Egress: DNS (port 53, any address: cluster DNS may be a node-local
    cache), the pool's workers, ``spec.networkPolicy.egressTo``, and for the router the API server
    (its discovery) at ``api_server_cidrs`` (any address when empty)."""
    np = pool.spec.networkPolicy
    if not np.enabled:
        return []
    name = pool.metadata.name
    workers = {"matchLabels": {LABEL_POOL: name},
               "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(WORKER_ROLES)}]}
    router = {"podSelector": {"matchLabels": selector(name, "router")}}
    http = {"protocol": "TCP", "port": S.WORKER_PORT}
    kv = {"protocol": "TCP", "port": KV_PORT}
    operator = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}}
                if operator_namespace else {}, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}
    worker_rules = [
        {"from": [router, {"podSelector": workers}], "ports": [http, kv]},
        {"from": [operator, *(_peer(p) for p in np.workersFrom)], "ports": [http]},
    ]
    router_rule: dict[str, Any] = {"ports": [http]}
    if np.routerFrom:
        router_rule["from"] = [_peer(p) for p in np.routerFrom]
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    extra = [{"to": [_peer(p) for p in np.egressTo]}] if np.egressTo else []
    # decode -> prefill: /health (the KV port's number) and the KV port itself
    worker_egress = [dns, {"to": [{"podSelector": workers}], "ports": [http, kv]}, *extra]
    router_egress = [dns, {"to": [{"podSelector": workers}], "ports": [http]},
                     {"to": [{"ipBlock": {"cidr": c}} for c in (api_server_cidrs or ("0.0.0.0/0",))],
                      "ports": [{"protocol": "TCP", "port": p} for p in API_SERVER_PORTS]}, *extra]
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(f"{name}-workers", None),
         "spec": {"podSelector": workers, "policyTypes": ["Ingress", "Egress"], "ingress": worker_rules,
                  "egress": worker_egress}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(f"{name}-router", "router"),
         "spec": {"podSelector": {"matchLabels": selector(name, "router")}, "policyTypes": ["Ingress", "Egress"],
                  "ingress": [router_rule], "egress": router_egress}},
    ]
