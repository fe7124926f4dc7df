"""The scaling logic both autoscalers share, written once: one tick observes a pool, asks the policy,
records the decision, and carries it out through an :class:`Actuator`, the backend that knows what a
replica is. Two backends implement it: a Kubernetes pool's Deployments (:mod:`.kube_loop`: ``spec.replicas``
through the API server) and the local fleet's processes (:mod:`.fleet_loop`: ``tandem serve`` started
and stopped by ``tandem up``). What is decided here holds for both:

- which roles are acted on (``autoscaling.enabled``, :func:`~.actuate.enabled_roles`) and at which
  percentile their SLO is read (:func:`~.actuate.percentiles`);
- whether a decision is carried out (mode ``active`` and not advisory, :func:`~.actuate.acted_on`);
  an advisory decision is recorded and nothing else;
- burst absorption is passed to the backend before any replica changes;
- scale up starts ``delta`` replicas at once; scale down drains the least-loaded ready replica
  (:func:`~.actuate.least_loaded`), up to ``-delta`` of them a tick, fewer where the backend says so
  (``drains_per_tick``) or holds scale-down for now (``drain_candidates`` returns None);
- the tick: one every ``interval_s`` measured from the previous start, a failed tick logged and the loop
  going on (:func:`run_every`).

Standard library only; imports no Kopf and no Kubernetes client (tests/serving/test_import_directions.py).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Protocol

from tandem.worker.api.names import WORKER_ROLES

from .actuate import acted_on, enabled_roles, least_loaded, percentiles
from .pods_source import PodsSource, Targets
from .snapshot import Decision, PoolSnapshot

log = logging.getLogger("tandem.autoscaler")


class Actuator(Protocol):
    """What a backend does for :func:`tick`. Its methods raise what its transport raises (the caller's
    loop logs it and goes on); ``role`` is ``"prefill"`` or ``"decode"``."""

    #: names the pool in log lines
    name: str
    #: the most replicas of one role drained in one tick; None: as many as the decision lowers by
    drains_per_tick: Optional[int]

    def targets(self) -> tuple[Targets, bool]:
        """What to scrape, and whether a change is still being applied (``rolling_out``: the policy holds)."""

    def record(self, decision: Decision, snapshot: PoolSnapshot, acted: bool) -> None:
        """Write the decision down (status, log, metrics), acted on or not."""

    def absorb_bursts(self, on: bool) -> None:
        """Tell the routers to prefill bursts on decode workers with headroom (or to stop)."""

    def scale_up(self, role: str, delta: int, reason: str) -> None:
        """Add ``delta`` > 0 replicas of ``role``."""

    def drain_candidates(self, role: str) -> Optional[list]:
        """The ready replicas of ``role`` that may be drained; None: scale-down waits this tick."""

    def url_of(self, replica) -> str:
        """A candidate's HTTP base URL (its load is read at ``/health``)."""

    def drain(self, role: str, replica, reason: str) -> None:
        """Drain ``replica`` and remove it once drained (in the background: a tick never waits on it)."""


def pods_source(spec, window_s: float, interval_s: float) -> PodsSource:
    """The default metric source: every pod's /metrics, each role read at its SLO's percentile; a
    series older than the window or three ticks is stale."""
    return PodsSource(window_s, percentiles(spec), stale_s=max(window_s, 3 * interval_s))


def tick(spec, policy, source, actuator: Actuator) -> Decision:
    """Observe, decide, record, act: one decision for one pool. Returns the decision.

    Args:
        spec: the pool's ``InferencePoolSpec`` (its ``autoscaling`` mode and per-role settings).
        policy: the pool's :class:`~.policy.Autoscaler` (it keeps its history across ticks).
        source: a metric source (:class:`PodsSource` or :class:`~.prometheus_source.PrometheusSource`).
        actuator: the backend.
    """
    targets, rolling = actuator.targets()
    snap = source.observe(targets, rolling_out=rolling)
    decision = policy.decide(snap)
    acted = acted_on(spec, decision)
    actuator.record(decision, snap, acted)
    if not acted:
        return decision
    actuator.absorb_bursts(decision.absorb_bursts)
    enabled = enabled_roles(spec)
    for role in WORKER_ROLES:
        if not enabled[role]:
            continue
        d = decision.role(role)
        if d.delta > 0:
            actuator.scale_up(role, d.delta, d.reason)
        elif d.delta < 0:
            steps = -d.delta if actuator.drains_per_tick is None else min(-d.delta, actuator.drains_per_tick)
            for _ in range(steps):
                candidates = actuator.drain_candidates(role)
                if candidates is None:
                    break
                victim = least_loaded(candidates, actuator.url_of)
                if victim is None:
                    log.warning("autoscaler: %s: no ready %s replica answers; not scaling down", actuator.name, role)
                    break
                actuator.drain(role, victim, d.reason)
    return decision


def run_every(interval_s: float, fn: Callable[[], object], stop: threading.Event, min_wait_s: float = 0.0,
              logger: logging.Logger = log) -> None:
    """Call ``fn`` every ``interval_s`` seconds (from one start to the next; at least ``min_wait_s``
    between a call's end and the next start) until ``stop`` is set. An exception in ``fn`` is logged
    and the loop goes on: one bad tick never stops the autoscaler."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            fn()
        except Exception:  # noqa: BLE001 - one bad tick never stops the loop
            logger.exception("autoscaler tick failed")
        stop.wait(max(min_wait_s, interval_s - (time.monotonic() - t0)))
