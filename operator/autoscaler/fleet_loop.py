"""The autoscaler in charge of a local fleet (``tandem up``): every ``interval_s`` it scrapes the
router's and the workers' /metrics (:class:`PodsSource`), asks the policy, and acts:

- up: start worker processes; each joins the router's discovery file when it answers /ready;
- down: drain the least-loaded ready worker of the role (``POST /drain``; it leaves the discovery file
  at once, so the router sends it nothing new), wait until ``GET /drain`` says drained (its streams end
  at full length, a prefill worker's KV transfers too), then stop it (SIGTERM);
- advisory mode: record the decision, act on nothing.

Starting and draining workers make the snapshot ``rolling_out``: the policy holds until they settle.
Each decision is kept (``decisions``, the last 50) with its inputs, and every drain's state at drain
time (``drains``), for ``tandem up``'s log and for tests.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional

from .actuate import (acted_on, decision_record, enabled_roles, least_loaded, percentiles, start_drain, summary,
                      wait_drained)
from .pods_source import PodsSource, Targets, Worker

log = logging.getLogger("tandem.autoscaler")


class FleetAutoscaler:
    """Runs the policy over a :class:`tandem.operator.local.LocalFleet` in a thread.

    Args:
        fleet: the running fleet.
        window_s: the metric window (seconds).
        interval_s: seconds between decisions.
        drain_timeout_s: the longest a drained worker is waited for before it is stopped anyway
            (SIGTERM still drains; the worker's own --drain-timeout then applies).
        startup_s: the policy's start-up time (how far it forecasts); a CPU worker starts in seconds.
        calibration: the performance model (:class:`tandem.worker.api.calibration.Calibration`, e.g.
            ``bench/calibrations/smollm2-cpu.yaml``); without one the policy sizes from latency alone.
        policy: a ready policy (default: ``Autoscaler(fleet.pool.spec, calibration)``).
        source: a metric source (default: a :class:`PodsSource` over the fleet's processes).
    """

    def __init__(self, fleet, window_s: float = 30.0, interval_s: float = 5.0, drain_timeout_s: float = 300.0,
                 startup_s: float = 30.0, calibration=None, policy=None, source=None):
        self.fleet = fleet
        spec = fleet.pool.spec
        if policy is None:
            from .policy import Autoscaler
            policy = Autoscaler(spec, calibration, startup_s=startup_s)
        self.policy = policy
        self.source = source or PodsSource(window_s, percentiles(spec), stale_s=max(window_s, 3 * interval_s))
        self.interval_s, self.drain_timeout_s = interval_s, drain_timeout_s
        self.enabled = enabled_roles(spec)
        self.decisions: collections.deque = collections.deque(maxlen=50)
        self.drains: list[dict] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._drainers: list[threading.Thread] = []

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for t in self._drainers:
            t.join(timeout=30)
        self.source.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - one bad tick never stops the loop
                log.exception("autoscaler tick failed")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    # ---- one tick -----------------------------------------------------------------------------
    def targets(self) -> Targets:
        router = [p.url for p in self.fleet.procs if p.role == "router"]
        by_role = {r: [Worker(p.url, p.state, p.name) for p in self.fleet.workers(r)] for r in ("prefill", "decode")}
        return Targets(routers=router, prefill=by_role["prefill"], decode=by_role["decode"])

    def tick(self):
        """Refresh the fleet, observe, decide, act. Returns the decision."""
        self.fleet.refresh()
        t = self.targets()
        rolling = any(w.state != "ready" for w in t.prefill + t.decode)
        snap = self.source.observe(t, rolling_out=rolling)
        decision = self.policy.decide(snap)
        acted = acted_on(self.fleet.pool.spec, decision)
        self.decisions.append(decision_record(decision, snap, acted))
        if decision.changes:
            self.fleet.out.write(f"[autoscaler] {'advisory: ' if not acted else ''}{summary(decision)}\n")
            self.fleet.out.flush()
        if acted and decision.absorb_bursts != self.fleet.absorb_bursts:
            self.fleet.absorb_bursts = decision.absorb_bursts   # the router prefills bursts locally (or stops)
            self.fleet.write_discovery()
        if acted:
            for role in ("prefill", "decode"):
                if self.enabled[role]:
                    self._apply(role, decision.role(role).delta)
        return decision

    def _apply(self, role: str, delta: int) -> None:
        for _ in range(max(0, delta)):
            p = self.fleet.start_worker(role)
            self.fleet.out.write(f"[autoscaler] started {p.name} ({p.url})\n")
        for _ in range(max(0, -delta)):
            ready = [p for p in self.fleet.workers(role) if p.state == "ready"]
            victim = least_loaded(ready, lambda p: p.url)
            if victim is None:
                log.warning("no %s worker answers to be drained", role)
                return
            self._drain(victim)

    def _drain(self, p) -> None:
        p.state = "draining"
        self.fleet.write_discovery()          # the router stops choosing it now
        try:
            at_drain = start_drain(p.url, headers=self.fleet.worker_headers)
        except (OSError, ValueError) as e:
            at_drain = {"error": str(e)}
        rec = {"name": p.name, "role": p.role, "url": p.url, "at": time.time(), "at_drain": at_drain}
        self.drains.append(rec)
        self.fleet.out.write(f"[autoscaler] draining {p.name}: {at_drain}\n")
        self.fleet.out.flush()

        def finish():
            rec["drained"] = wait_drained(p.url, self.drain_timeout_s, stop=self._stop.is_set)
            self.fleet.stop_worker(p)
            rec["stopped_at"] = time.time()
            self.fleet.out.write(f"[autoscaler] stopped {p.name} (drained: {rec['drained']})\n")
            self.fleet.out.flush()
        t = threading.Thread(target=finish, name=f"drain-{p.name}", daemon=True)
        self._drainers.append(t)
        t.start()
