"""The peers' policies the simulator measures tandem's against. Each has the policy interface
(``decide(PoolSnapshot) -> Decision``) and knobs that ``tune`` picks on a grid (seed 1).

- ``static``: a fixed fleet; the best one is the fewest GPUs meeting the SLOs on the tuning seed.
- ``hpa-queue``: Kubernetes HPA's algorithm (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale,
  "Algorithm details") on a queue-length target per replica (prefill: prompts queued or in service;
  decode: sequences running or waiting), tolerance 0.1, the default behavior (scale-up: the larger of
  4 pods or 100% per 15 s, no window; scale-down: a 300 s stabilization window, 100% per 15 s).
- ``dynamo``: a throughput planner in the manner of NVIDIA Dynamo's SLA planner (docs/architecture/
  sla_planner.md in ai-dynamo/dynamo): every 180 s, predicted demand (the last interval's mean, Dynamo's
  constant predictor) / the profiled per-replica throughput at the SLO, corrected by observed/expected
  latency (prefill: TTFT; decode: ITL, with the throughput re-read at target / correction). The profile
  is the calibration measured at a fixed batch, as Dynamo's profiler does; its knob scales the profiled
  throughput (how close to the profile the planner plans).
- ``apa``: AIBrix's Autoscaling Pod Autoscaler (aibrix.readthedocs.io, "Autoscaling: APA"): desired =
  ceil(ready x metric / target) outside a 10% tolerance, at most 2x up and 0.5x down per step; its
  metric here is the role's SLO latency and the knob the fraction of the SLO it targets.
- ``oracle``: knows each minute's load (arrivals, mean lengths) a tick ahead and starts replicas with no
  start-up time; sizes with the calibrated capacity model, its knob the planned utilization of it.
- ``oracle-reactive``: the oracle without foresight: it knows the load of the minute it is in (from its
  first second, so a little ahead of any metrics window) and its replicas pay the start-up time like
  everyone's. No causal policy that sizes from the present load does better than it at the same
  utilization, so its settings, all run, show which aims a reactive policy can reach at all
  (``run.reach``). A yardstick, like the oracle, not a peer.
"""
from __future__ import annotations

import math
from typing import Optional

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.snapshot import Decision, PoolSnapshot, RoleDecision

from tandem.worker.api.names import WORKER_ROLES as ROLES


def _bound(x: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, x)))


def _decision(snap: PoolSnapshot, want: dict, reasons: dict, inputs: Optional[dict] = None) -> Decision:
    ds = {}
    for r in ROLES:
        rs = snap.role(r)
        ds[r] = RoleDecision(r, rs.replicas, int(want[r]), int(want[r]), rs.signal, reasons[r], None,
                             (inputs or {}).get(r, {}))
    return Decision(snap.at, ds["prefill"], ds["decode"])


class Static:
    """A fixed fleet: ``prefill`` and ``decode`` replicas, whatever happens."""
    name = "static"

    def __init__(self, prefill: int, decode: int, **_):
        self.counts = {"prefill": int(prefill), "decode": int(decode)}

    def decide(self, snap: PoolSnapshot) -> Decision:
        return _decision(snap, self.counts, {r: "static" for r in ROLES})


class HPAQueue:
    """HPA's algorithm on queue length per ready replica (targets ``prefill_q`` and ``decode_q``)."""
    name = "hpa-queue"

    def __init__(self, prefill_q: float, decode_q: float, min_replicas: int = 1, max_replicas: int = 16,
                 tolerance: float = 0.1, down_window: float = 300.0, **_):
        self.q = {"prefill": prefill_q, "decode": decode_q}
        self.min, self.max, self.tol, self.down_window = min_replicas, max_replicas, tolerance, down_window
        self.recs = {r: [] for r in ROLES}
        self.last_up = {r: -math.inf for r in ROLES}

    def decide(self, snap: PoolSnapshot) -> Decision:
        want, why = {}, {}
        for r in ROLES:
            rs = snap.role(r)
            cur = rs.replicas
            queue = rs.running + rs.waiting + (snap.router_queued if r == "prefill" else 0)
            if rs.ready == 0:
                rec = max(cur, self.min)
            else:
                ratio = (queue / rs.ready) / self.q[r]
                # not-ready pods: HPA assumes they use nothing when scaling up (conservative), so the
                # ratio is taken over the ready ones and applied to the ready count
                rec = cur if abs(ratio - 1) <= self.tol else math.ceil(rs.ready * ratio - 1e-9)
                if rec > cur:
                    rec = max(rec, cur)
            # scale-up limit: max(4 pods, 100%) per 15 s
            if rec > cur:
                rec = min(rec, cur + max(4, cur))
            self.recs[r].append((snap.at, rec))
            self.recs[r] = [(t, v) for t, v in self.recs[r] if t >= snap.at - self.down_window]
            if rec < cur:
                rec = min(cur, max(v for _, v in self.recs[r]))
            want[r] = _bound(rec, self.min, self.max)
            why[r] = f"queue {queue:.1f} over {rs.ready} ready vs target {self.q[r]} per replica"
        return _decision(snap, want, why)


class DynamoPlanner:
    """A throughput planner in the manner of Dynamo's SLA planner (see module docs)."""
    name = "dynamo"

    def __init__(self, perf: PerfModel, targets: dict, scale: float = 1.0, interval: float = 180.0,
                 min_replicas: int = 1, max_replicas: int = 16, **_):
        self.perf, self.targets, self.scale, self.interval = perf, targets, scale, interval
        self.min, self.max = min_replicas, max_replicas
        self.next_at = 0.0
        self.seen: list[PoolSnapshot] = []
        self.current: Optional[dict] = None

    def decide(self, snap: PoolSnapshot) -> Decision:
        self.seen.append(snap)
        if self.current is None:
            self.current = {r: snap.role(r).replicas for r in ROLES}
        if snap.at < self.next_at:
            return _decision(snap, self.current, {r: "between adjustment intervals" for r in ROLES})
        self.next_at = snap.at + self.interval
        seen, self.seen = self.seen, []
        ok = [s for s in seen if s.prefill.arrivals_per_s > 0]
        if not ok:
            return _decision(snap, self.current, {r: "no traffic: unchanged (Dynamo keeps idle pools)" for r in ROLES})
        n = len(ok)
        rps = sum(s.prefill.arrivals_per_s for s in ok) / n
        isl = sum(s.prefill.prompt_tokens_per_s for s in ok) / n / max(rps, 1e-9)
        out_tps = sum(s.decode.output_tokens_per_s for s in ok) / n
        osl = out_tps / max(sum(s.decode.arrivals_per_s for s in ok) / n, 1e-9) if out_tps > 0 else 1.0
        ttfts = [s.prefill.latency for s in ok if s.prefill.latency is not None]
        itls = [s.decode.latency for s in ok if s.decode.latency is not None]
        # prefill: throughput per replica = isl / TTFT of one request (the profile), load corrected by
        # observed / expected TTFT
        single = self.perf.remote_prefill_seconds(max(isl, 1.0))
        p_corr = (sum(ttfts) / len(ttfts)) / single if ttfts else 1.0
        pre = math.ceil(rps * single * p_corr / self.scale - 1e-9)
        # decode: the profiled throughput at ITL <= target / correction, at the mean context
        ctx = isl + osl / 2
        itl_target = self.targets["decode"]
        b = 1.0   # the profile's batch: the largest whose step meets the (corrected) ITL target
        step = self.perf.decode_step_seconds
        expected = step(max(1.0, out_tps * step(1, ctx) / max(1, snap.decode.ready)), ctx)
        d_corr = (sum(itls) / len(itls)) / expected if itls else 1.0
        goal = itl_target / max(d_corr, 1e-3)
        while b < 256 and step(b + 0.05, ctx) <= goal:
            b += 0.05
        thpt = b / step(b, ctx)
        dec = math.ceil(out_tps / (thpt * self.scale) - 1e-9)
        self.current = {"prefill": _bound(pre, self.min, self.max), "decode": _bound(dec, self.min, self.max)}
        return _decision(snap, self.current, {"prefill": f"demand {rps:.2f} req/s x {single:.2f}s, correction "
                                                         f"{p_corr:.2f}",
                                              "decode": f"{out_tps:.1f} tok/s at {thpt:.1f} tok/s per replica"})


class APA:
    """AIBrix APA on the SLO latency (see module docs)."""
    name = "apa"

    def __init__(self, targets: dict, fraction: float = 0.8, tolerance: float = 0.1, min_replicas: int = 1,
                 max_replicas: int = 16, **_):
        self.targets, self.fraction, self.tol = targets, fraction, tolerance
        self.min, self.max = min_replicas, max_replicas

    def decide(self, snap: PoolSnapshot) -> Decision:
        want, why = {}, {}
        for r in ROLES:
            rs = snap.role(r)
            cur = rs.replicas
            lat = rs.latency
            if rs.signal != "ok" or lat is None or rs.ready == 0:
                want[r], why[r] = _bound(cur, self.min, self.max), "no metric: unchanged"
                continue
            ratio = lat / (self.targets[r] * self.fraction)
            if abs(ratio - 1) <= self.tol:
                rec = cur
            else:
                rec = math.ceil(rs.ready * ratio - 1e-9)
                rec = min(rec, 2 * max(cur, 1)) if rec > cur else max(rec, math.floor(cur * 0.5))
                if rec > cur and rs.starting:
                    rec = max(cur, rec - rs.starting)
            want[r] = _bound(rec, self.min, self.max)
            why[r] = f"latency {lat:.3g}s vs {self.targets[r] * self.fraction:.3g}s"
        return _decision(snap, want, why)


class Oracle:
    """Knows each minute's load; its replicas start at once (the simulator skips start-up for it)."""
    name = "oracle"
    ignores_startup = True
    ahead = 1   # minutes of the future it sizes for, besides the present one

    def __init__(self, perf: PerfModel, targets: dict, minutes: list, utilization: float = 1.0,
                 min_replicas: int = 1, max_replicas: int = 16, **_):
        self.perf, self.targets, self.minutes, self.u = perf, targets, minutes, utilization
        self.min, self.max = min_replicas, max_replicas

    def need(self, load: dict) -> dict:
        s = self.perf.remote_prefill_seconds(max(load["prompt"], 1.0))
        pre = load["rps"] * s / max(1e-9, self.perf.prefill_capacity(self.targets["prefill"], s) * self.u)
        ctx = load["prompt"] + load["output"] / 2
        m = self.perf.decode_capacity(self.targets["decode"], ctx)
        tps = m / self.perf.decode_step_seconds(1 + m, ctx)
        dec = load["rps"] * max(0.0, load["output"] - 1) / max(1e-9, tps * self.u)
        return {"prefill": _bound(math.ceil(pre - 1e-9), self.min, self.max),
                "decode": _bound(math.ceil(dec - 1e-9), self.min, self.max)}

    def decide(self, snap: PoolSnapshot) -> Decision:
        # past the trace's last minute nothing arrives, but requests are still finishing: it keeps the
        # last minute's fleet (sized to the minimum, it drained decode replicas under running streams)
        m = min(int(snap.at // 60), len(self.minutes) - 1)
        loads = [self.minutes[i] for i in range(m, m + self.ahead + 1) if 0 <= i < len(self.minutes)]
        needs = [self.need(x) for x in loads] or [{"prefill": self.min, "decode": self.min}]
        want = {r: max(n[r] for n in needs) for r in ROLES}
        why = "this and the next minute's load" if self.ahead else "this minute's load"
        return _decision(snap, want, {r: why for r in ROLES})


class ReactiveOracle(Oracle):
    """Knows the load of the minute it is in, and no later one; its replicas pay the start-up time."""
    name = "oracle-reactive"
    ignores_startup = False
    ahead = 0
