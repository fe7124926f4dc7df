"""The autoscaler in charge of a local fleet (``tandem up``): every ``interval_s`` it scrapes the
router's and the workers' /metrics (:class:`PodsSource`), asks the policy, and acts. The scaling logic
(enablement, advisory, which replica goes, the tick) is :mod:`.loop`'s, shared with the operator's
:mod:`.kube_loop`; this file is the fleet's backend of it (:class:`FleetActuator`):

- up: start worker processes; each joins the router's discovery file when it answers /ready;
- down: drain the least-loaded ready worker of the role (``POST /drain``; it leaves the discovery file
  at once, so the router sends it nothing new), wait until ``GET /drain`` says drained (its streams end
  at full length, a prefill worker's KV transfers too), then stop it (SIGTERM);
- advisory mode: record the decision, act on nothing.

Starting and draining workers make the snapshot ``rolling_out``: the policy holds until they settle. A
worker that crashed and is being restarted does not: it is a failure, not a change being applied (on
Kubernetes a crashed pod leaves its Deployment's replica count as it was, so the operator's loop does not
hold either). Held for it, a worker in a crash loop (restarted with a backoff up to 30 s) froze every
decision of both roles; now it is counted ``unresponsive`` (not capacity) and the role is sized without it.
Each decision is kept (``decisions``, the last 50) with its inputs, and every drain's state at drain
time (``drains``), for ``tandem up``'s log and for tests.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional

from .actuate import decision_record, start_drain, summary, wait_drained
from .loop import pods_source, run_every, tick
from .pods_source import Targets, Worker

log = logging.getLogger("tandem.autoscaler")


class FleetAutoscaler:
    """Runs the policy over a :class:`tandem.operator.local.LocalFleet` in a thread; the scaling logic
    is :func:`.loop.tick`'s, carried out by :class:`FleetActuator`.

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
        self.source = source or pods_source(spec, window_s, interval_s)
        self.interval_s, self.drain_timeout_s = interval_s, drain_timeout_s
        self.decisions: collections.deque = collections.deque(maxlen=50)
        self.drains: list[dict] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._drainers: list[threading.Thread] = []
        self.actuator = FleetActuator(self)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=run_every, args=(self.interval_s, self.tick, self._stop),
                                        name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for t in self._drainers:
            t.join(timeout=30)
        self.source.close()

    # ---- one tick -----------------------------------------------------------------------------
    def targets(self) -> Targets:
        router = [p.url for p in self.fleet.procs if p.role == "router"]
        by_role = {r: [Worker(p.url, p.state, p.name) for p in self.fleet.workers(r)] for r in ("prefill", "decode")}
        return Targets(routers=router, prefill=by_role["prefill"], decode=by_role["decode"])

    def tick(self):
        """Refresh the fleet, observe, decide, act. Returns the decision."""
        self.fleet.refresh()
        return tick(self.fleet.pool.spec, self.policy, self.source, self.actuator)


class FleetActuator:
    """The local fleet's backend of :func:`.loop.tick`: a replica is a ``tandem serve`` process.

    - up: start worker processes; each joins the router's discovery file when it answers /ready;
    - down: drain the chosen worker (``POST /drain``; it leaves the discovery file at once), then stop
      it (SIGTERM) once ``GET /drain`` says drained, on a thread of its own; as many a tick as asked.
    """

    drains_per_tick = None

    def __init__(self, owner: FleetAutoscaler):
        self.owner, self.fleet = owner, owner.fleet
        self.name = owner.fleet.pool.metadata.name

    def targets(self) -> tuple[Targets, bool]:
        t = self.owner.targets()
        repairing = {p.url for p in self.fleet.workers() if p.crashed}
        return t, any(w.state != "ready" and w.url not in repairing for w in t.prefill + t.decode)

    def record(self, decision, snapshot, acted: bool) -> None:
        self.owner.decisions.append(decision_record(decision, snapshot, acted))
        if decision.changes:
            self.fleet.out.write(f"[autoscaler] {'advisory: ' if not acted else ''}{summary(decision)}\n")
            self.fleet.out.flush()

    def absorb_bursts(self, on: bool) -> None:
        if on != self.fleet.absorb_bursts:
            self.fleet.absorb_bursts = on   # the router prefills bursts locally (or stops)
            self.fleet.write_discovery()

    def scale_up(self, role: str, delta: int, reason: str) -> None:
        for _ in range(delta):
            p = self.fleet.start_worker(role)
            self.fleet.out.write(f"[autoscaler] started {p.name} ({p.url})\n")

    def drain_candidates(self, role: str) -> list:
        return [p for p in self.fleet.workers(role) if p.state == "ready"]

    def url_of(self, p) -> str:
        return p.url

    def drain(self, role: str, p, reason: str) -> None:
        p.state = "draining"
        self.fleet.write_discovery()          # the router stops choosing it now
        try:
            at_drain = start_drain(p.url, headers=self.fleet.worker_headers)
        except (OSError, ValueError) as e:
            at_drain = {"error": str(e)}
        rec = {"name": p.name, "role": p.role, "url": p.url, "at": time.time(), "at_drain": at_drain}
        self.owner.drains.append(rec)
        self.fleet.out.write(f"[autoscaler] draining {p.name}: {at_drain}\n")
        self.fleet.out.flush()

        def finish():
            rec["drained"] = wait_drained(p.url, self.owner.drain_timeout_s, stop=self.owner._stop.is_set)
            self.fleet.stop_worker(p)
            rec["stopped_at"] = time.time()
            self.fleet.out.write(f"[autoscaler] stopped {p.name} (drained: {rec['drained']})\n")
            self.fleet.out.flush()
        t = threading.Thread(target=finish, name=f"drain-{p.name}", daemon=True)
        self.owner._drainers.append(t)
        t.start()
