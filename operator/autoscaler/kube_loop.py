"""The autoscaler in charge of Kubernetes pools: the operator's own loop, outside Kopf's handlers. The
scaling logic (enablement, advisory, which replica goes, the tick) is :mod:`.loop`'s, shared with the
local fleet's :mod:`.fleet_loop`; this file walks the pools and is their backend (:class:`KubeActuator`).

Each tick (``TANDEM_AUTOSCALER_INTERVAL_SECONDS``), on the replica holding the Lease only
(:mod:`.lease`), for every pool with an autoscaled role:

1. observe: the pool's pods (ready, starting, draining) and the router pods' and workers' /metrics at
   their pod IPs (:class:`PodsSource`; or Prometheus, :class:`PrometheusSource`, when the spec says so);
2. decide: the pool's :class:`~tandem.operator.autoscaler.policy.Autoscaler` (one per pool and spec
   generation: it keeps its stabilization history across ticks);
3. act (mode ``active``): scale up by setting the Deployment's ``spec.replicas``; scale down one pod at
   a time, and only while every other pod of the role is ready (see below): drain the least-loaded ready pod (``POST /drain``), wait until it reports drained and its
   readiness probe has turned it not-ready, then lower ``spec.replicas`` by one. The ReplicaSet
   controller of v1.20 ranks pods to delete by: unscheduled, then pending, then **not ready** before
   ready (``controller.ActivePods``), so the drained pod is the one removed. v1.20 gives no stronger
   guarantee (``controller.kubernetes.io/pod-deletion-cost`` is 1.21+ and alpha there); if another pod
   turns not-ready in that instant, the ReplicaSet may pick either, and the drained one stays not-ready
   until the next scale-down picks it (it is reported as draining, not as capacity);
4. record: the decision (inputs, signal, reason) into ``status.lastScalingDecisions`` (the last
   ``HISTORY``, written when the decision or its signal changes), ``status.observed``, the
   ScalingLimited condition, one Event per action, and the ``tandem:autoscaler_*`` metrics.

Advisory mode does steps 1, 2 and 4 only (Events: none; nothing but status is written).

Who owns ``spec.replicas``: with autoscaling on, the spec has no ``replicas`` and the reconciler keeps
whatever count the Deployment has, clamped to [minReplicas, maxReplicas]. A manual ``kubectl scale``
therefore holds until the autoscaler's next decision that changes the count (the policy starts from
the replicas it observes); a ``replicas`` in Git is refused by the admission webhook while autoscaling
is enabled (docs/autoscaler-actuation.md).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Optional

from .. import desired as D
from .. import spec as S
from ..kube import Kube, KubeError, object_path
from ..pool_key import PoolKey
from ..security import pool_secret_value
from tandem.worker.api.auth import pool_headers
from tandem.worker.api.names import WORKER_ROLES as ROLES
from .actuate import (decision_record, enabled_roles, percentiles, push_absorb_bursts, start_drain, summary,
                      wait_drained)
from .loop import pods_source, run_every, tick
from .pods_source import PodsSource, Targets, Worker

log = logging.getLogger("tandem.autoscaler")

HISTORY = 10


def autoscaled(pool: S.InferencePool) -> bool:
    return any(enabled_roles(pool.spec).values())


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def load_calibration(kube: Kube, pool: S.InferencePool):
    """The performance model ``spec.autoscaling.calibrationRef`` names (the ConfigMap's
    ``calibration.yaml``, docs/bench.md), or None when unset or unreadable (logged: the policy then
    sizes from latency alone)."""
    ref = pool.spec.autoscaling.calibrationRef
    if ref is None:
        return None
    import yaml

    from tandem.worker.api.calibration import Calibration
    ns = pool.metadata.namespace
    try:
        cm = kube.get(object_path("v1", "configmaps", ns, ref.configMap))
        if cm is None:
            raise ValueError("no such ConfigMap")
        return Calibration.from_dict(yaml.safe_load((cm.get("data") or {}).get("calibration.yaml") or "{}") or {})
    except (KubeError, ValueError, yaml.YAMLError) as e:
        log.warning("autoscaler: %s/%s: calibrationRef %s: %s; sizing from latency alone", ns,
                    pool.metadata.name, ref.configMap, e)
        return None


class _PoolState:
    def __init__(self, pool: S.InferencePool, window_s: float, interval_s: float, startup_s: float,
                 calibration=None):
        from .policy import Autoscaler
        self.generation = pool.metadata.generation
        self.policy = Autoscaler(pool.spec, calibration, startup_s=startup_s)
        pct = percentiles(pool.spec)
        m = pool.spec.autoscaling.metrics
        if m.source == "prometheus":
            from .prometheus_source import PrometheusSource
            self.source = PrometheusSource(m.url, pool.metadata.name, window_s, pct, m.queries)
        else:
            self.source = pods_source(pool.spec, window_s, interval_s)
        self.draining: dict[str, dict] = {}     # pod name -> drain record (in progress)
        self.absorbing = False                   # the routers were last told to absorb bursts
        self.last_key: Optional[tuple] = None
        self.limited: Optional[tuple] = None

    def carry_over(self, old: "_PoolState") -> None:
        """A new spec generation (a GitOps sync) keeps what the pool's history holds: the policy's
        stabilization windows, the step limits' record of recent changes, the demand trend and the
        learned capacity factor; the drains in progress; the scrape history when the source is alike.
        Starting afresh would forget the last scale-up (its periodSeconds limit) and act on a window
        of metrics that the old generation had already acted on (seen in tests/e2e)."""
        self.policy.state = old.policy.state
        self.draining, self.absorbing = old.draining, old.absorbing
        self.last_key, self.limited = old.last_key, old.limited
        if isinstance(old.source, PodsSource) and isinstance(self.source, PodsSource) and \
                (old.source.window_s, old.source.percentiles) == (self.source.window_s, self.source.percentiles):
            self.source = old.source


class KubeAutoscaler:
    """The operator's autoscaler loop (sync; the operator runs :meth:`tick` in a thread).

    Args:
        kube: the API client.
        lease: a :class:`~.lease.LeaderLease`; None acts without one (a single operator replica).
        events: posts an Event ``(body, reason, message)`` (the reconciler's, best effort).
        metrics: the operator's :class:`~tandem.operator.metrics.Metrics` (its autoscaler gauges), or None.
        namespaces: pools to watch (empty: all).
        window_s, interval_s: the metric window and the tick (seconds).
        drain_timeout_s: the longest a drained pod is waited for before replicas are lowered anyway.
        startup_s: the policy's start-up time of a worker pod.
        port: the workers' and router's HTTP port.
    """

    def __init__(self, kube: Kube, lease=None, events=None, metrics=None, namespaces: Optional[list[str]] = None,
                 window_s: float = 30.0, interval_s: float = 5.0, drain_timeout_s: float = 120.0,
                 startup_s: float = 120.0, port: int = S.WORKER_PORT):
        self.kube, self.lease, self.events, self.metrics = kube, lease, events, metrics
        self.pool_key = PoolKey(kube)
        self.namespaces = list(namespaces or [])
        self.window_s, self.interval_s = window_s, interval_s
        self.drain_timeout_s, self.startup_s, self.port = drain_timeout_s, startup_s, port
        self.pools: dict[tuple[str, str], _PoolState] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def run(self, min_wait_s: float = 0.5) -> None:
        """Tick every ``interval_s`` (at least ``min_wait_s`` apart) until :meth:`stop` (blocks)."""
        run_every(self.interval_s, self.tick, self._stop, min_wait_s)

    def stop(self, release_lease: bool = True) -> None:
        """End the ticks and the drains' waits; give the Lease up (an API call) unless told not to."""
        self._stop.set()
        if release_lease and self.lease is not None:
            self.lease.release()

    def leading(self) -> bool:
        ok = True if self.lease is None else self.lease.try_acquire()
        if self.metrics is not None:
            self.metrics.leader.set(1 if ok else 0)
        return ok

    # ---- the tick -------------------------------------------------------------------------------
    def _ticked(self, outcome: str) -> None:
        if self.metrics is not None and self.metrics.ticks is not None:
            self.metrics.ticks.labels(outcome=outcome).inc()

    def tick(self) -> None:
        """One pass over every autoscaled pool, when this replica leads. Counted by outcome
        (``tandem:autoscaler_ticks_total``): while the API server is down nothing is decided or acted on,
        since the pools, Deployments and pods are read afresh every tick (no stale copy is decided on);
        the chaos soak (bench/chaos_kube.py) records these counts through its API-server outages."""
        if not self.leading():
            self._ticked("not_leader")
            return
        from ..reconcile import list_pools
        seen = set()
        decided = failed = 0
        try:
            bodies = list_pools(self.kube, self.namespaces)
        except KubeError:
            self._ticked("api_unavailable")
            raise
        for body in bodies:
            md = body["metadata"]
            key = (md.get("namespace") or "default", md["name"])
            if md.get("deletionTimestamp"):
                continue
            try:
                pool = S.load_manifest({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
            except S.SpecError:
                continue   # the reconciler reports it (Degraded/InvalidSpec)
            if not autoscaled(pool):
                continue
            pool.metadata.namespace = key[0]
            seen.add(key)
            st = self.pools.get(key)
            if st is None or st.generation != pool.metadata.generation:
                old, st = st, _PoolState(pool, self.window_s, self.interval_s, self.startup_s,
                                         load_calibration(self.kube, pool))
                if old is not None:
                    st.carry_over(old)
                self.pools[key] = st
            try:
                self._pool(body, pool, st)
                decided += 1
            except KubeError as e:
                failed += 1
                log.warning("autoscaler: pool %s/%s: %s", *key, e)
        for gone in set(self.pools) - seen:
            del self.pools[gone]
        self._ticked("decided" if decided else "api_unavailable" if failed else "no_pools")

    def _pool(self, body: dict, pool: S.InferencePool, st: _PoolState) -> None:
        ns, name = pool.metadata.namespace, pool.metadata.name
        deps = {r: self.kube.get(object_path("apps/v1", "deployments", ns, S.service_name(name, r)))
                for r in ROLES}
        if any(d is None for d in deps.values()):
            return   # the reconciler has not made the children yet
        pods = (self.kube.request("GET", object_path("v1", "pods", ns),
                                  query={"labelSelector": f"{D.LABEL_POOL}={name}"}) or {}).get("items", [])
        tick(pool.spec, st.policy, st.source, KubeActuator(self, body, pool, st, deps, pods))

    def _url(self, pod: dict) -> str:
        return f"http://{pod['status']['podIP']}:{self.port}"

    # ---- acting ---------------------------------------------------------------------------------
    def _set_replicas(self, ns: str, name: str, role: str, n: int) -> None:
        """Change a Deployment's replicas (a merge patch; the reconciler keeps the count it finds)."""
        self.kube.merge_patch(object_path("apps/v1", "deployments", ns, S.service_name(name, role)),
                              {"spec": {"replicas": n}})

    def _pool_secret(self, pool: S.InferencePool) -> bytes:
        """The pool's secret, derived from the operator's key as the reconciler does (never read from
        its Secret: the operator may not get Secrets)."""
        return pool_secret_value(self.pool_key.key(), pool)

    def _pool_headers(self, pool: S.InferencePool) -> dict:
        """A fresh pool token for a worker's POST /drain (a worker of an older secret refuses it,
        which is logged and retried next tick)."""
        return pool_headers(self._pool_secret(pool))

    def _event(self, body: dict, reason: str, message: str) -> None:
        if self.events is not None:
            self.events(body, reason, message)

    # ---- recording ------------------------------------------------------------------------------
    def _metrics(self, ns: str, name: str, pool: S.InferencePool, decision, snap) -> None:
        m = self.metrics
        if m is None:
            return
        for role in ROLES:
            d, rs = decision.role(role), snap.role(role)
            labels = {"namespace": ns, "pool": name, "role": role}
            m.desired.labels(**labels).set(d.desired)
            a = getattr(pool.spec, role).autoscaling
            if a is not None and a.target is not None and rs.latency is not None:
                m.slo_ratio.labels(**labels).set(rs.latency / a.target.seconds)
            m.signal.labels(**labels, signal=rs.signal).inc()
            if d.delta:
                m.actions.labels(**labels, direction="up" if d.delta > 0 else "down").inc()

    def _record(self, body: dict, pool: S.InferencePool, st: _PoolState, decision, snap, acted: bool) -> None:
        ns, name = pool.metadata.namespace, pool.metadata.name
        key = tuple((decision.role(r).current, decision.role(r).desired, decision.role(r).signal,
                     decision.role(r).limited_by) for r in ROLES)
        bound = {"minReplicas", "maxReplicas", "gpuBudget", "ratio"}
        lim = [(r, decision.role(r)) for r in ROLES if decision.role(r).limited_by in bound]
        limited = (("True", "".join(x[:1].upper() + x[1:] for x in [lim[0][1].limited_by]) + "Bound",
                    "; ".join(f"{r}: {d.reason} (limited by {d.limited_by})" for r, d in lim)) if lim
                   else ("False", "WithinBounds", "no bound decided the last decision"))
        if key == st.last_key and limited == st.limited:
            return
        fresh = self.kube.get(object_path(S.API_VERSION, S.PLURAL, ns, name)) or body
        status = fresh.get("status") or {}
        history = list(status.get("lastScalingDecisions") or [])
        history.append(decision_record(decision, snap, acted))
        observed = {}
        for role, metric in (("prefill", "ttft"), ("decode", "tpot")):
            v = snap.role(role).latency
            if v is not None and math.isfinite(v):
                observed[f"{metric}Seconds"] = round(v, 6)
                observed[metric] = f"{v * 1000:.0f}ms"
        conds = [c for c in status.get("conditions") or [] if c.get("type") != "ScalingLimited"]
        prev = next((c for c in status.get("conditions") or [] if c.get("type") == "ScalingLimited"), None)
        ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == limited[0] else \
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conds.append({"type": "ScalingLimited", "status": limited[0], "reason": limited[1],
                      "message": limited[2][:1000], "lastTransitionTime": ltt,
                      "observedGeneration": pool.metadata.generation})
        patch: dict[str, Any] = {"lastScalingDecisions": history[-HISTORY:], "conditions": conds}
        if observed:
            patch["observed"] = observed
        self.kube.merge_patch(object_path(S.API_VERSION, S.PLURAL, ns, name, "status"), {"status": patch})
        st.last_key, st.limited = key, limited
        log.info("autoscaler: %s/%s: %s%s", ns, name, "" if acted else "advisory: ", summary(decision))


class KubeActuator:
    """A Kubernetes pool's backend of :func:`.loop.tick` for one tick: a replica is a pod of the role's
    Deployment, read once per tick (``deps``, ``pods``).

    - up: raise the Deployment's ``spec.replicas`` by ``delta`` (an Event ``ScaledUp``);
    - down: one pod a tick, and only while every other pod of the role is ready (module docstring):
      drain it, wait until it reports drained and reads not-ready, then lower ``spec.replicas`` by one;
    - record: the ``tandem:autoscaler_*`` metrics and the pool's status (:meth:`KubeAutoscaler._record`);
    - burst absorption: pushed to every ready router pod, renewed each tick while on.
    """

    drains_per_tick = 1

    def __init__(self, owner: KubeAutoscaler, body: dict, pool: S.InferencePool, st: _PoolState,
                 deps: dict, pods: list[dict]):
        self.owner, self.body, self.pool, self.st, self.deps, self.pods = owner, body, pool, st, deps, pods
        self.ns, self.pool_name = pool.metadata.namespace, pool.metadata.name
        self.name = f"{self.ns}/{self.pool_name}"

    def url_of(self, pod: dict) -> str:
        return self.owner._url(pod)

    def targets(self) -> tuple[Targets, bool]:
        t = Targets()
        for p in self.pods:
            md = p["metadata"]
            role = md.get("labels", {}).get(D.LABEL_ROLE)
            ip = (p.get("status") or {}).get("podIP")
            if md.get("deletionTimestamp"):
                state = "draining"
            elif md["name"] in self.st.draining:
                state = "draining"
            elif _ready(p):
                state = "ready"
            else:
                state = "starting"
            url = f"http://{ip}:{self.owner.port}" if ip else f"pending://{md['name']}"
            if role == "router":
                if state == "ready" and ip:
                    t.routers.append(url)
            elif role in ROLES:
                t.workers(role).append(Worker(url, state, md["name"]))
        # a change still being applied: the Deployment's pods are not (yet) what it asks for
        rolling = bool(self.st.draining) or any(
            (d.get("status") or {}).get("replicas", 0) != d["spec"].get("replicas", 1)
            or (d.get("status") or {}).get("observedGeneration", 0) < d["metadata"].get("generation", 0)
            for d in self.deps.values())
        return t, rolling

    def record(self, decision, snapshot, acted: bool) -> None:
        self.owner._metrics(self.ns, self.pool_name, self.pool, decision, snapshot)
        self.owner._record(self.body, self.pool, self.st, decision, snapshot, acted)

    def absorb_bursts(self, on: bool) -> None:
        """Tell each ready router pod to prefill bursts on decode workers with headroom for three ticks
        (renewed every tick while the decision asks; it lapses by itself if this leader dies), or to
        stop. Best effort: a router that does not answer is told again on the next tick."""
        st = self.st
        if not (on or st.absorbing):
            return
        routers = [p for p in self.pods if p["metadata"].get("labels", {}).get(D.LABEL_ROLE) == "router"
                   and _ready(p) and (p.get("status") or {}).get("podIP")]
        seconds = 3 * self.owner.interval_s if on else 0.0
        secret = self.owner._pool_secret(self.pool) if routers else None
        ok = True
        for p in routers:
            try:   # a token per request: each is accepted once
                push_absorb_bursts(self.url_of(p), seconds, headers=pool_headers(secret))
            except (OSError, ValueError) as e:
                ok = False
                log.warning("autoscaler: %s: router %s: absorb-bursts: %s", self.name, p["metadata"]["name"], e)
        if on != st.absorbing and ok:
            log.info("autoscaler: %s: burst absorption %s", self.name, "on" if on else "off")
        st.absorbing = on or not ok

    def scale_up(self, role: str, delta: int, reason: str) -> None:
        have = self.deps[role]["spec"].get("replicas", 1)
        want = have + delta
        self.owner._set_replicas(self.ns, self.pool_name, role, want)
        self.owner._event(self.body, "ScaledUp", f"{role}: {have} -> {want} replicas: {reason}")

    def drain_candidates(self, role: str) -> Optional[list]:
        mine = [p for p in self.pods if p["metadata"].get("labels", {}).get(D.LABEL_ROLE) == role
                and not p["metadata"].get("deletionTimestamp")]
        starting = [p["metadata"]["name"] for p in mine
                    if not _ready(p) and p["metadata"]["name"] not in self.st.draining]
        if starting:
            # a not-ready pod beside the drained one would let the ReplicaSet delete either (it ranks
            # not-ready pods alike): it could remove the starting pod and leave the drained one, not
            # ready for good. Scale down only when the rest are ready.
            log.info("autoscaler: %s: %s pods %s not ready; scale-down waits", self.name, role, starting)
            return None
        return [p for p in mine if _ready(p) and p["metadata"]["name"] not in self.st.draining
                and (p.get("status") or {}).get("podIP")]

    def drain(self, role: str, pod: dict, reason: str) -> None:
        owner, st, body, pool = self.owner, self.st, self.body, self.pool
        ns, name, pname = self.ns, self.pool_name, pod["metadata"]["name"]
        url = self.url_of(pod)
        try:
            at_drain = start_drain(url, headers=owner._pool_headers(pool))
        except (OSError, ValueError) as e:
            log.warning("autoscaler: drain of %s/%s failed: %s", ns, pname, e)
            return
        rec = {"pod": pname, "role": role, "atDrain": at_drain, "started": time.time()}
        st.draining[pname] = rec
        owner._event(body, "Draining", f"{role}: draining pod {pname} ({at_drain.get('in_flight', '?')} "
                                       f"in flight) before scaling down: {reason}")

        def finish():
            try:
                rec["drained"] = wait_drained(url, owner.drain_timeout_s, stop=owner._stop.is_set)
                # lower replicas only once the pod reads not-ready: then the ReplicaSet removes it first
                t_end = time.monotonic() + 60
                while time.monotonic() < t_end and not owner._stop.is_set():
                    p = owner.kube.get(object_path("v1", "pods", ns, pname))
                    if p is None or not _ready(p):
                        break
                    time.sleep(0.5)
                if owner.lease is not None and not owner.lease.held:
                    log.warning("autoscaler: lost the lease while draining %s; leaving replicas as they are", pname)
                    return
                dep = owner.kube.get(object_path("apps/v1", "deployments", ns, S.service_name(name, role)))
                have = dep["spec"].get("replicas", 1)
                a = getattr(pool.spec, role).autoscaling
                want = max(a.minReplicas, have - 1)
                if want < have:
                    owner._set_replicas(ns, name, role, want)
                    owner._event(body, "ScaledDown", f"{role}: {have} -> {want} replicas; drained pod {pname} "
                                                     f"goes first (not ready): {reason}")
            except Exception:  # noqa: BLE001 - a failed drain must not kill the loop
                log.exception("autoscaler: drain of %s/%s", ns, pname)
            finally:
                st.draining.pop(pname, None)
        t = threading.Thread(target=finish, name=f"drain-{pname}", daemon=True)
        owner._threads = [x for x in owner._threads if x.is_alive()] + [t]
        t.start()
