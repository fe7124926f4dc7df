"""One reconcile pass of an InferencePool: validate, compute the desired children, apply only what
differs (server-side apply, one field manager), then write status from what is observed.

Synchronous; the operator's one reconcile loop (handlers.py) calls `Reconciler.reconcile` in a worker
thread. A per-pool lock keeps two passes of one pool from interleaving.

Failures, and what each does to the pool:
- an invalid spec: Degraded/InvalidSpec, no children;
- a child the API server refuses as invalid (400, 422): Degraded/ChildRejected naming the child and the
  server's message; the pool is then left alone (no API call at all) until its generation changes;
- any other API error (403, 404, 409, 429, 5xx, no answer): `KubeError` is raised and the caller
  retries with growing delays (Degraded/ApplyFailed meanwhile);
- pods that crash-loop or cannot start: Degraded/PodsFailing with the container's termination message.
A Warning event is posted once each time Degraded turns True or changes its reason or message.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from . import desired as D
from . import security
from . import spec as S
from .kube import Kube, KubeError, is_permanent, object_path, path_of
from .pool_key import PoolKey

log = logging.getLogger("tandem.operator")

CHILD_TYPES = (("v1", "configmaps"), ("v1", "serviceaccounts"), ("rbac.authorization.k8s.io/v1", "roles"),
               ("rbac.authorization.k8s.io/v1", "rolebindings"), ("v1", "services"), ("apps/v1", "deployments"))
GIE_VERSIONS = ("inference.networking.k8s.io/v1", "inference.networking.x-k8s.io/v1alpha2")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: Restarts after which a pod that is not ready and has terminated is crash-looping. With the kubelet's
#: back-off (10 s, then doubling) the pool turns Degraded within about half a minute of the first crash.
CRASH_RESTARTS = 2
#: Waiting reasons that mean a container cannot start at all (no restart will help).
CANNOT_START = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                "CreateContainerError", "RunContainerError"}


@dataclass
class Result:
    applied: list[str] = field(default_factory=list)
    unchanged: int = 0
    status_written: bool = False
    problems: list[tuple[str, str]] = field(default_factory=list)
    #: (child, server message) for each child the API server refused as invalid
    rejected: list[tuple[str, str]] = field(default_factory=list)
    #: the pool was left alone: a child was refused for this generation already
    parked: bool = False
    error: Optional[str] = None


def _one_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of a message (a traceback's last line names the error), trimmed."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    out = lines[-1] if lines else ""
    return out if len(out) <= limit else out[:limit - 3] + "..."


def pod_problem(pods: list[dict]) -> Optional[str]:
    """Why a role's pods cannot work, from their container statuses, or None.

    A container that is not ready and either waits for a reason in CANNOT_START, or has restarted
    CRASH_RESTARTS times with a last termination, fails. The message is stable while nothing changes
    (pod name, reason, exit code, the last line of the termination message; never the restart count),
    so the pool's status is not rewritten at each crash."""
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if p["metadata"].get("deletionTimestamp"):
            continue
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            if cs.get("ready"):
                continue
            waiting = (cs.get("state") or {}).get("waiting") or {}
            term = (cs.get("lastState") or {}).get("terminated") or {}
            pod = p["metadata"]["name"]
            if waiting.get("reason") in CANNOT_START:
                return f"pod {pod}: {waiting['reason']}: {_one_line(waiting.get('message', ''))}"
            if term and (cs.get("restartCount") or 0) >= CRASH_RESTARTS:
                why = _one_line(term.get("message", "")) or term.get("reason") or "terminated"
                return f"pod {pod} is crash-looping (exit code {term.get('exitCode')}): {why}"
    return None


def degraded_condition(status: dict) -> Optional[dict]:
    c = {c.get("type"): c for c in status.get("conditions", [])}.get("Degraded")
    return c if c and c.get("status") == "True" else None


def pool_path(ns: str, name: str, sub: Optional[str] = None) -> str:
    return object_path(S.API_VERSION, S.PLURAL, ns, name, sub)


class Reconciler:
    def __init__(self, kube: Kube, events: bool = True):
        self.kube = kube
        self.events = events
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.stats = {"passes": 0, "applies": 0, "errors": 0}
        self._desired_cache: dict[tuple, list[dict[str, Any]]] = {}
        self.pool_key = PoolKey(kube)

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    # ---- discovery ------------------------------------------------------------------------------
    def capabilities(self) -> D.Capabilities:
        k = self.kube
        gie = next((v for v in GIE_VERSIONS if k.has(v, "inferencepools", ttl=10)), None)
        return D.Capabilities(pdb_api_version=k.pdb_api_version(),
                              service_monitor=k.has("monitoring.coreos.com/v1", "servicemonitors", ttl=10),
                              gie_api_version=gie, pod_deletion_cost=False,
                              network_policies=k.has("networking.k8s.io/v1", "networkpolicies", ttl=10),
                              operator_namespace=os.environ.get("POD_NAMESPACE") or None,
                              api_server_cidrs=tuple(c for c in os.environ.get("TANDEM_API_SERVER_CIDRS", "")
                                                     .replace(",", " ").split() if c))

    # ---- events ---------------------------------------------------------------------------------
    def event(self, body: dict, reason: str, message: str, type_: str = "Normal") -> None:
        if not self.events:
            return
        md = body["metadata"]
        ns = md.get("namespace") or "default"
        t = now()
        ev = {"apiVersion": "v1", "kind": "Event",
              "metadata": {"name": f"{md['name']}.{uuid.uuid4().hex[:12]}", "namespace": ns},
              "involvedObject": {"apiVersion": S.API_VERSION, "kind": S.KIND, "name": md["name"], "namespace": ns,
                                 "uid": md.get("uid"), "resourceVersion": md.get("resourceVersion")},
              "reason": reason, "message": message[:1000], "type": type_,
              "firstTimestamp": t, "lastTimestamp": t, "count": 1,
              "source": {"component": "tandem-operator"}, "reportingComponent": "tandem-operator"}
        try:
            self.kube.request("POST", object_path("v1", "events", ns), body=ev)
        except KubeError as e:  # events are best effort
            log.warning("event %s for %s/%s: %s", reason, ns, md["name"], e)

    # ---- a snapshot of a namespace's children (for the resync loop) -----------------------------
    def snapshot(self, namespace: str, caps: D.Capabilities) -> dict[str, dict]:
        """Every object the operator manages in a namespace, by path, from one LIST per kind: a resync
        pass over many pools then compares in memory instead of one GET per child."""
        # pods are not children, but status reads their state
        types = list(CHILD_TYPES) + [(caps.pdb_api_version, "poddisruptionbudgets"), ("v1", "pods")]
        if caps.network_policies:
            types.append(("networking.k8s.io/v1", "networkpolicies"))
        if caps.service_monitor:
            types.append(("monitoring.coreos.com/v1", "servicemonitors"))
        if caps.gie_api_version:
            types.append((caps.gie_api_version, "inferencepools"))
        out: dict[str, dict] = {}
        for gv, plural in types:
            doc = self.kube.request("GET", object_path(gv, plural, namespace),
                                    query={"labelSelector": "app.kubernetes.io/managed-by=tandem-operator"})
            for it in (doc or {}).get("items", []):
                out[object_path(gv, plural, namespace, it["metadata"]["name"])] = it
        return out

    # ---- the pass -------------------------------------------------------------------------------
    def reconcile(self, body: dict, caps: Optional[D.Capabilities] = None,
                  snapshot: Optional[dict[str, dict]] = None) -> Result:
        """One pass. With a snapshot (from `snapshot`, same caps) the children are read from it;
        a child missing from it counts as missing."""
        md = body["metadata"]
        ns, name = md.get("namespace") or "default", md["name"]
        with self._lock(f"{ns}/{name}"):
            self.stats["passes"] += 1
            if self.parked(body):
                return Result(parked=True)
            return self._reconcile(body, caps, snapshot)

    @staticmethod
    def parked(body: dict) -> bool:
        """Whether a child of this generation was refused as invalid: the same objects would be refused
        again, so nothing is sent (and nothing written) until the spec, and so the generation, changes."""
        c = degraded_condition(body.get("status") or {})
        gen = body["metadata"].get("generation")
        return bool(c and c.get("reason") == "ChildRejected" and gen is not None
                    and c.get("observedGeneration") == gen)

    def _reconcile(self, body: dict, caps: Optional[D.Capabilities] = None,
                   snapshot: Optional[dict[str, dict]] = None) -> Result:
        res = Result()
        md = body["metadata"]
        ns, name = md.get("namespace") or "default", md["name"]
        old_status = dict(body.get("status") or {})
        generation = md.get("generation")
        try:
            pool = S.load_manifest({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body})
        except S.SpecError as e:
            res.problems = e.problems
            msg = "; ".join(f"{p}: {m}" for p, m in e.problems)
            st = self._status(old_status, generation, None, degraded=("InvalidSpec", msg))
            res.status_written = self._write_status(ns, name, old_status, st, body)
            return res
        if pool.metadata.namespace is None:
            pool.metadata.namespace = ns
        get = self.kube.get if snapshot is None else snapshot.get
        try:
            caps = caps or self.capabilities()
            current: dict[str, int] = {}
            existing: dict[str, Optional[dict]] = {}
            for role in ("prefill", "decode"):
                d = get(object_path("apps/v1", "deployments", ns, S.service_name(name, role)))
                existing[role] = d
                if d is not None:
                    current[role] = d.get("spec", {}).get("replicas", 1)
            secret_hash = self._pool_secret(pool, res)
            key = (md.get("uid"), md.get("generation"), md.get("resourceVersion") if md.get("generation") is None
                   else None, caps, tuple(sorted(current.items())), secret_hash)
            want = self._desired_cache.get(key)
            if want is None:  # the desired objects are a pure function of this key: compute once
                want = D.desired_objects(pool, caps, current, secret_hash)
                if len(self._desired_cache) > 4096:
                    self._desired_cache.clear()
                self._desired_cache[key] = want
            deployments: dict[str, dict] = {}
            for obj in want:
                path = path_of(obj)
                have = get(path)
                if obj["kind"] == "Deployment":
                    obj = D.with_observed_replicas(obj, pool, have)
                if D.needs_apply(obj, have):
                    try:
                        have = self.kube.apply(path, obj)
                    except KubeError as e:
                        if not is_permanent(e):
                            raise
                        # the rest may still be valid: apply them, report this one
                        res.rejected.append((f"{obj['kind']}/{obj['metadata']['name']}", e.message))
                        continue
                    res.applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
                    self.stats["applies"] += 1
                    if obj["kind"] == "InferencePool":
                        self._drop_other_gie(obj["apiVersion"], ns, name, md.get("uid"), res)
                else:
                    res.unchanged += 1
                if obj["kind"] == "Deployment":
                    deployments[obj["metadata"]["labels"][D.LABEL_ROLE]] = have
            if caps.gie_api_version and not any(o["kind"] == "InferencePool" for o in want):
                # spec.gateway was removed: remove the GIE InferencePool this pool owns
                gpath = object_path(caps.gie_api_version, "inferencepools", ns, name)
                g = get(gpath)
                if g is not None and any(r.get("uid") == md.get("uid")
                                         for r in g["metadata"].get("ownerReferences", [])):
                    self.kube.delete(gpath)
                    res.applied.append(f"-InferencePool/{name}")
        except KubeError as e:
            self.stats["errors"] += 1
            res.error = str(e)
            st = self._status(old_status, generation, None, degraded=("ApplyFailed", str(e)[:500]))
            try:
                self._write_status(ns, name, old_status, st, body)
            except KubeError:
                pass
            raise
        if res.applied:
            # From the state, not from what woke the pass: whoever runs it, a change gets one verb.
            seen = old_status.get("observedGeneration")
            verb = "Created" if seen is None else "Updated" if seen != generation else "Repaired"
            self.event(body, verb, f"applied {len(res.applied)} object(s): {', '.join(res.applied)}")
        degraded = None
        if res.rejected:
            child, msg = res.rejected[0]
            more = f" (and {len(res.rejected) - 1} more)" if len(res.rejected) > 1 else ""
            degraded = ("ChildRejected", f"{child} was rejected by the API server{more}: {_one_line(msg, 500)}")
        else:
            try:
                pods = self._pods(ns, name, snapshot)
            except KubeError as e:  # status is best effort here; the next pass reads them again
                log.warning("pods of %s/%s: %s", ns, name, e)
                pods = None
            if pods is not None:
                failing = [f"{role}: {why}" for role in S.ROLES
                           if (why := pod_problem([p for p in pods
                                                   if p["metadata"].get("labels", {}).get(D.LABEL_ROLE) == role]))]
                if failing:
                    degraded = ("PodsFailing", "; ".join(failing))
        st = self._status(old_status, generation, deployments, degraded=degraded)
        res.status_written = self._write_status(ns, name, old_status, st, body)
        return res

    def _pool_secret(self, pool: S.InferencePool, res: Result) -> str:
        """The digest of the pool's shared secret, derived from the operator's key (pool_key.py), its
        Secret created when missing (a new pool, a rotated key, or someone deleted it). Never read
        back: the operator may create Secrets but not get them (docs/security.md). The Secret's name
        carries the digest, so an existing one of that name holds this value (it cannot be made
        without the secret) and a rotation makes a new name rather than changing one."""
        ns = pool.metadata.namespace or "default"
        value = security.pool_secret_value(self.pool_key.key(), pool)
        digest = security.secret_hash(value)
        name = security.pool_secret_name(pool.metadata.name, digest)
        obj = security.pool_secret_object(pool, D._meta(pool, name), value)
        try:   # one POST per pass, as the GET it replaces: a deleted Secret is made again
            self.kube.request("POST", object_path("v1", "secrets", ns), body=obj)
            res.applied.append(f"Secret/{name}")
            self.stats["applies"] += 1
        except KubeError as e:
            if e.status != 409:   # 409: it exists (made by an earlier pass or another replica)
                raise
        return digest

    def _drop_other_gie(self, keep: str, ns: str, name: str, uid: Optional[str], res: Result) -> None:
        """Delete this pool's GIE InferencePool in the other served version: when the GA v1 CRD
        appears next to x-k8s v1alpha2, the pool moves to v1 and leaves no twin behind. Run only when
        the wanted one is applied, so a steady pass costs no extra reads."""
        for gv in GIE_VERSIONS:
            if gv == keep or not self.kube.has(gv, "inferencepools", ttl=10):
                continue
            path = object_path(gv, "inferencepools", ns, name)
            g = self.kube.get(path)
            if g is not None and any(r.get("uid") == uid for r in g["metadata"].get("ownerReferences", [])):
                self.kube.delete(path)
                res.applied.append(f"-InferencePool/{name} ({gv})")

    def _pods(self, ns: str, name: str, snapshot: Optional[dict[str, dict]]) -> list[dict]:
        if snapshot is not None:
            return [o for p, o in snapshot.items() if p.startswith(f"/api/v1/namespaces/{ns}/pods/")
                    and o["metadata"].get("labels", {}).get(D.LABEL_POOL) == name]
        doc = self.kube.request("GET", object_path("v1", "pods", ns),
                                query={"labelSelector": f"{D.LABEL_POOL}={name}"})
        return (doc or {}).get("items", [])

    # ---- status ---------------------------------------------------------------------------------
    @staticmethod
    def role_status(dep: Optional[dict]) -> dict[str, Any]:
        if dep is None:
            return {"desiredReplicas": 0, "replicas": 0, "readyReplicas": 0, "summary": "0/0"}
        spec, st = dep.get("spec", {}), dep.get("status", {}) or {}
        want = spec.get("replicas", 1)
        ready = st.get("readyReplicas", 0) or 0
        tmpl_ann = (spec.get("template", {}).get("metadata", {}) or {}).get("annotations", {}) or {}
        return {"desiredReplicas": want, "replicas": st.get("replicas", 0) or 0, "readyReplicas": ready,
                "summary": f"{ready}/{want}", "configHash": tmpl_ann.get(D.ANN_CONFIG_HASH, "")}

    @staticmethod
    def rolled_out(dep: Optional[dict]) -> bool:
        if dep is None:
            return False
        spec, st = dep.get("spec", {}), dep.get("status", {}) or {}
        want = spec.get("replicas", 1)
        return (st.get("observedGeneration", 0) >= dep["metadata"].get("generation", 0)
                and (st.get("updatedReplicas", 0) or 0) == want and (st.get("replicas", 0) or 0) == want
                and (st.get("readyReplicas", 0) or 0) >= want)

    def _status(self, old: dict, generation: Optional[int], deps: Optional[dict[str, dict]],
                degraded: Optional[tuple[str, str]] = None) -> dict[str, Any]:
        st: dict[str, Any] = {"observedGeneration": generation}
        conds: dict[str, tuple[str, str, str]] = {}
        if deps is not None:
            for role in S.ROLES:
                st[role] = self.role_status(deps.get(role))
            ok = all(self.rolled_out(deps.get(r)) for r in S.ROLES)
            waiting = [r for r in S.ROLES if not self.rolled_out(deps.get(r))]
            conds["Ready"] = ("True", "AllRolesReady", "every role has its ready replicas") if ok else \
                ("False", "RolesNotReady", "waiting for: " + ", ".join(waiting))
            conds["Progressing"] = ("False", "RolledOut", "all roles are rolled out") if ok else \
                ("True", "RollingOut", "rolling out: " + ", ".join(waiting))
        else:
            for role in S.ROLES:
                if role in old:
                    st[role] = old[role]
            assert degraded is not None
            prev_ready = {c.get("type"): c for c in old.get("conditions", [])}.get("Ready")
            if prev_ready and degraded[0] == "ApplyFailed":  # the children are as they were
                conds["Ready"] = (prev_ready["status"], prev_ready.get("reason", ""), prev_ready.get("message", ""))
            else:
                conds["Ready"] = ("False", degraded[0], degraded[1])
            conds["Progressing"] = ("False", degraded[0], "not reconciled")
        conds["Degraded"] = ("True", *degraded) if degraded else ("False", "Reconciled", "spec is valid and applied")
        # One line for `kubectl get tpool` (the STATUS column): why it is broken, else where it stands.
        st["message"] = (f"{degraded[0]}: {degraded[1]}" if degraded else
                         "ready" if conds["Ready"][0] == "True" else conds["Ready"][2])
        prev = {c.get("type"): c for c in old.get("conditions", [])}
        out = []
        for t in ("Ready", "Progressing", "Degraded"):
            s, r, m = conds[t]
            p = prev.get(t)
            ltt = p.get("lastTransitionTime") if p and p.get("status") == s else now()
            out.append({"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": ltt,
                        "observedGeneration": generation})
        if "ScalingLimited" in prev:  # owned by the autoscaler: keep it
            out.append(prev["ScalingLimited"])
        st["conditions"] = out
        # "observed" and "lastScalingDecisions" are the autoscaler's: left out of this merge patch, so
        # a pass never writes back the copy it read at its start over a newer decision
        return st

    def _write_status(self, ns: str, name: str, old: dict, new: dict, body: dict) -> bool:
        """Patch status when it changed; post one Warning event when Degraded turns True or changes."""
        keys = set(new)
        if {k: old.get(k) for k in keys} == new:
            return False
        try:
            self.kube.merge_patch(pool_path(ns, name, "status"), {"status": new})
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        was, now_ = degraded_condition(old), degraded_condition(new)
        if now_ and (not was or (was.get("reason"), was.get("message")) != (now_["reason"], now_["message"])):
            self.event(body, now_["reason"], now_["message"], "Warning")
        return True


def list_pools(kube: Kube, namespaces: Optional[list[str]] = None) -> list[dict]:
    if not namespaces:
        doc = kube.request("GET", object_path(S.API_VERSION, S.PLURAL, None))
        return doc.get("items", [])
    out = []
    for ns in namespaces:
        doc = kube.request("GET", object_path(S.API_VERSION, S.PLURAL, ns))
        out += doc.get("items", [])
    return out
