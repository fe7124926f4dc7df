"""The peers' policies the simulator measures tandem's against. Each has the policy interface
(``decide(PoolSnapshot) -> Decision``) and knobs that ``tune`` picks on a grid (seed 1, the same 9-setting
budget as tandem's own grid, per role where the upstream system is configured per role).

The faithful baselines follow the upstream code where the simulator has the input; each class's
docstring names the upstream file and functions it follows and says where the simulator's snapshot
stands in for an upstream metric:

- ``static``: a fixed fleet; the best one is the fewest GPUs meeting the SLOs on the tuning seed.
- ``hpa-queue``: Kubernetes HPA on a Pods metric, the queue length per replica, one HPA per role.
- ``hpa-slo``: the same HPA on an Object metric, the role's p90 latency (TTFT, TPOT) against a target,
  as users wire an SLO through a custom-metrics adapter.
- ``apa``: AIBrix's APA, one PodAutoscaler per role on its SLO latency, with AIBrix's scaling-context
  defaults and its cooldown.
- ``kpa``: AIBrix's KPA: stable and panic windows and the panic threshold, on each role's concurrency.
- ``dynamo``: NVIDIA Dynamo's SLA planner with its default ARIMA load predictor (pmdarima, as upstream).
- ``apa-variant``, ``dynamo-variant``: the earlier, looser stand-ins (one SLO-fraction knob for both roles
  and no cooldown; a planner that adds replicas on queueing and scales its profile by a knob upstream
  lacks). Kept to compare with the older tables; not peers.
- ``oracle``: knows each minute's load (arrivals, mean lengths) a tick ahead and starts replicas with no
  start-up time; sizes with the calibrated capacity model, its knob the planned utilization of it.
- ``oracle-reactive``: the oracle without foresight: it knows the load of a minute once that minute has
  begun (from the first tick after its first second: at a minute's boundary it has seen none of it)
  and its replicas pay the start-up time like everyone's. No causal policy that sizes from the present
  load does better than it at the same utilization, so its settings, all run, show which aims a
  reactive policy can reach at all (``run.reach``). A yardstick, like the oracle, not a peer.
- ``oracle-reactive-behaved``: the reactive oracle held to the pool spec's scaling behavior (stabilization
  windows and steps), which tandem's policy keeps and the plain one ignores; ``run.reach`` uses it to
  tell an aim a reactive policy misses because of the pool's behavior from one it misses on its own.

The simulator decides every 15 s (HPA's default sync period; AIBrix reconciles every 10 s; Dynamo's planner
acts every 180 s). The snapshot's latency is the role's p90 over the last 30 s.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

from tandem.operator.autoscaler.behavior import stabilized, step_room
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


def _role_queue(snap: PoolSnapshot, r: str) -> float:
    """Requests a role holds: running plus waiting, and for prefill the router's queue too (sequences)."""
    rs = snap.role(r)
    return rs.running + rs.waiting + (snap.router_queued if r == "prefill" else 0)


class _HPA:
    """Kubernetes HPA's replica arithmetic and default behavior, one HPA per role (kubernetes/kubernetes
    pkg/controller/podautoscaler: ``ReplicaCalculator.getUsageRatioReplicaCount`` in replica_calculator.go,
    ``HorizontalController.stabilizeRecommendationWithBehaviors`` and
    ``calculateScaleUpLimitWithScalingRules`` in horizontal.go; the defaults in
    pkg/apis/autoscaling/v2/defaults.go and kube-controller-manager's flags):

    - inside the tolerance (|ratio - 1| <= 0.1) the count stays; else desired = ceil(ratio x ready pods);
    - scale-up: no stabilization window, at most max(4 pods, +100%) per 15 s period;
    - scale-down: the largest recommendation of the last 300 s (stabilization window), at most -100% per 15 s.

    Subclasses give the usage ratio (observed / target) of a role, or None when the metric is missing
    (HPA then keeps the scale: condition ScalingActive=False).
    """
    def __init__(self, min_replicas: int = 1, max_replicas: int = 16, tolerance: float = 0.1,
                 down_window: float = 300.0):
        self.min, self.max, self.tol, self.down_window = min_replicas, max_replicas, tolerance, down_window
        self.recs = {r: [] for r in ROLES}

    def ratio(self, snap: PoolSnapshot, r: str) -> tuple[Optional[float], str]:
        raise NotImplementedError

    def decide(self, snap: PoolSnapshot) -> Decision:
        want, why = {}, {}
        for r in ROLES:
            rs = snap.role(r)
            cur = rs.replicas
            ratio, text = self.ratio(snap, r)
            if ratio is None:
                want[r], why[r] = _bound(cur, self.min, self.max), f"{text}: metric missing, scale kept"
                continue
            if rs.ready == 0:
                rec = max(cur, self.min)
            else:
                # for a Pods metric HPA counts not-ready pods as using nothing when scaling up (so the
                # ratio is over the ready ones and applied to them); for an Object metric it multiplies
                # by the ready pods count: both read ``ratio x ready``
                rec = cur if abs(ratio - 1) <= self.tol else math.ceil(rs.ready * ratio - 1e-9)
            # stabilizeRecommendationWithBehaviors: the metric's recommendation is recorded; a scale-up takes
            # the least of the up window (0 s: itself), a scale-down the largest of the down window
            self.recs[r].append((snap.at, rec))
            self.recs[r] = [(t, v) for t, v in self.recs[r] if t > snap.at - self.down_window]
            if rec < cur:
                rec = min(cur, max(v for _, v in self.recs[r]))
            # convertDesiredReplicasWithBehaviorRate: scale-up at most max(+4 pods, +100%) per 15 s period
            if rec > cur:
                rec = min(rec, cur + max(4, cur))
            want[r] = _bound(rec, self.min, self.max)
            why[r] = f"{text}, ratio {ratio:.2f} over {rs.ready} ready"
        return _decision(snap, want, why)


class HPAQueue(_HPA):
    """HPA (see :class:`_HPA`) on a Pods metric: the role's queue per ready replica (prefill: prompts queued at
    the router or in the workers, or in service; decode: sequences running or waiting), targets
    ``prefill_q`` and ``decode_q`` (sequences per replica)."""
    name = "hpa-queue"

    def __init__(self, prefill_q: float, decode_q: float, **kw):
        super().__init__(**{k: v for k, v in kw.items() if k in ("min_replicas", "max_replicas", "tolerance",
                                                                  "down_window")})
        self.q = {"prefill": prefill_q, "decode": decode_q}

    def ratio(self, snap, r):
        rs = snap.role(r)
        queue = _role_queue(snap, r)
        if rs.ready == 0:
            return 1.0, f"queue {queue:.1f}"
        return (queue / rs.ready) / self.q[r], f"queue {queue:.1f} vs {self.q[r]} per replica"


class HPASLO(_HPA):
    """HPA (see :class:`_HPA`) on the SLO metric itself: an Object metric, the role's p90 latency (TTFT for
    prefill, TPOT for decode) as a custom-metrics adapter would serve it from Prometheus, with target value
    ``prefill_fraction`` / ``decode_fraction`` x the SLO. ratio = p90 / target; desired = ceil(ratio x ready).
    A window with no finished request has no p90: the metric is missing and the scale kept."""
    name = "hpa-slo"

    def __init__(self, targets: dict, prefill_fraction: float = 0.8, decode_fraction: float = 0.9, **kw):
        super().__init__(**{k: v for k, v in kw.items() if k in ("min_replicas", "max_replicas", "tolerance",
                                                                  "down_window")})
        self.target = {"prefill": targets["prefill"] * prefill_fraction, "decode": targets["decode"] * decode_fraction}

    def ratio(self, snap, r):
        lat = snap.role(r).latency
        if lat is None or snap.role(r).signal != "ok":
            return None, "no p90"
        return lat / self.target[r], f"p90 {lat:.3g}s vs target {self.target[r]:.3g}s"


class _TimeWindow:
    """AIBrix's metric window (pkg/controller/podautoscaler/types/metrics.go ``TimeWindow``, fed by
    ``MetricsClient.UpdateMetrics`` and read by ``GetMetricValue`` in metrics/client.go): the mean of the
    samples recorded in the last ``duration`` seconds; None (upstream: an error, so no scaling) when empty."""
    def __init__(self, duration: float):
        self.duration, self.samples = duration, []

    def record(self, t: float, v: float) -> None:
        self.samples.append((t, v))

    def avg(self, now: float) -> Optional[float]:
        self.samples = [(t, v) for t, v in self.samples if t > now - self.duration]
        return sum(v for _, v in self.samples) / len(self.samples) if self.samples else None


class _Cooldown:
    """AIBrix's cooldown (``PodAutoscalerReconciler.stabilizeRecommendation`` in
    pkg/controller/podautoscaler/podautoscaler_controller.go), applied to APA and KPA recommendations: every
    recommendation is kept for the longer window; a scale-up takes the largest recommendation of the
    ``up`` window (default 0 s: the present one), a scale-down the smallest of the ``down`` window
    (``ScaleDownCooldownWindow``, default 300 s). Upstream selects the minimum for a scale-down (not HPA's
    maximum), so its cooldown hastens a scale-down to the lowest recent recommendation rather than
    delaying it; this follows the code as written."""
    def __init__(self, up: float = 0.0, down: float = 300.0):
        self.up, self.down, self.hist = up, down, []

    def __call__(self, now: float, rec: int, cur: int) -> int:
        self.hist.append((now, rec))
        self.hist = [(t, v) for t, v in self.hist if t > now - max(self.up, self.down)]
        if rec == cur:
            return cur
        window = self.up if rec > cur else self.down
        inside = [v for t, v in self.hist if t > now - window]
        if not inside:
            return rec
        return max(inside) if rec > cur else min(inside)


#: AIBrix's scaling-context defaults (pkg/controller/podautoscaler/context/context.go ``NewBaseScalingContext``)
#: and metric windows (metrics/client.go ``DefaultStableWindowDuration``, ``DefaultPanicWindowDuration``).
AIBRIX_DEFAULTS = {"max_scale_up_rate": 2.0, "max_scale_down_rate": 2.0, "up_tolerance": 0.1, "down_tolerance": 0.1,
                   "up_cooldown": 0.0, "down_cooldown": 300.0, "panic_threshold": 2.0, "stable_window": 180.0,
                   "panic_window": 60.0}


class APA:
    """AIBrix's Application-specific Pod Autoscaler, one PodAutoscaler per role, each on its SLO latency
    (prefill: p90 TTFT; decode: p90 TPOT) with its own target, ``prefill_fraction`` / ``decode_fraction``
    x the SLO. Follows vllm-project/aibrix (commit e3e10f9):

    - pkg/controller/podautoscaler/algorithm/apa.go ``APAAlgorithm.ComputeRecommendation`` and
      ``computeTargetReplicas``: the metric is the stable window's mean (180 s, metrics/client.go
      ``GetMetricValue``); r = metric / target; if r > 1 + up tolerance: min(ceil(current x r),
      ceil(MaxScaleUpRate x current)); if r < 1 - down tolerance: max(ceil(current x r),
      floor(current / MaxScaleDownRate)); else current. ``current`` is the scale's replica count (our
      ready + starting);
    - context/context.go ``NewBaseScalingContext``: tolerances 0.1 / 0.1, MaxScaleUpRate 2,
      MaxScaleDownRate 2, ScaleUpCooldownWindow 0 s, ScaleDownCooldownWindow 300 s;
    - podautoscaler_controller.go ``stabilizeRecommendation``: the cooldown (:class:`_Cooldown`), then the
      min/max replica bounds.

    Upstream averages each scrape over pods before windowing; the simulator's p90 is already pool-wide.
    """
    name = "apa"

    def __init__(self, targets: dict, prefill_fraction: float = 0.8, decode_fraction: float = 0.9,
                 min_replicas: int = 1, max_replicas: int = 16, **kw):
        self.cfg = {**AIBRIX_DEFAULTS, **{k: v for k, v in kw.items() if k in AIBRIX_DEFAULTS}}
        self.target = {"prefill": targets["prefill"] * prefill_fraction, "decode": targets["decode"] * decode_fraction}
        self.min, self.max = min_replicas, max_replicas
        self.window = {r: _TimeWindow(self.cfg["stable_window"]) for r in ROLES}
        self.cooldown = {r: _Cooldown(self.cfg["up_cooldown"], self.cfg["down_cooldown"]) for r in ROLES}

    def recommend(self, cur: int, value: float, target: float) -> int:
        """apa.go ``computeTargetReplicas``: replicas for ``cur`` current replicas at metric ``value``."""
        c, r = self.cfg, value / target
        if r > 1 + c["up_tolerance"]:
            return min(math.ceil(cur * r - 1e-9), math.ceil(c["max_scale_up_rate"] * cur - 1e-9))
        if r < 1 - c["down_tolerance"]:
            return max(math.ceil(cur * r - 1e-9), math.floor(cur / c["max_scale_down_rate"] + 1e-9))
        return cur

    def decide(self, snap: PoolSnapshot) -> Decision:
        want, why = {}, {}
        for r in ROLES:
            rs = snap.role(r)
            cur = rs.replicas
            if rs.signal == "ok" and rs.latency is not None:
                self.window[r].record(snap.at, rs.latency)
            value = self.window[r].avg(snap.at)
            if value is None:
                want[r], why[r] = _bound(cur, self.min, self.max), "no samples in the window: scale kept"
                continue
            rec = _bound(self.recommend(cur, value, self.target[r]), self.min, self.max)
            want[r] = _bound(self.cooldown[r](snap.at, rec, cur), self.min, self.max)
            why[r] = f"mean p90 {value:.3g}s over {self.cfg['stable_window']:.0f}s vs target {self.target[r]:.3g}s"
        return _decision(snap, want, why)


class KPA:
    """AIBrix's KPA (Knative-style: a stable and a panic window), one PodAutoscaler per role on its
    concurrency (prefill: prompts queued or in service, the router's queue included; decode: sequences
    running or waiting), target ``prefill_c`` / ``decode_c`` sequences per replica. Follows
    vllm-project/aibrix (commit e3e10f9) pkg/controller/podautoscaler/algorithm/kpa.go:

    - ``ComputeRecommendation`` / ``shouldEnterPanicMode``: panic when the stable value is <= 0 or
      panic / stable > PanicThreshold (2.0, context.go);
    - ``computeTargetReplicas``: each window's value v gives ceil(v / target) when v is outside
      [target x (1 - 0.1), target x (1 + 0.1)], else the current count; each is held in
      [floor(current / MaxScaleDownRate), max(1, ceil(MaxScaleUpRate x current))]; in panic the larger of
      the two. (Upstream then holds it at ``maxPanicPods``, but the base scaling context's
      ``GetMaxPanicPods`` returns 0 and ``SetMaxPanicPods`` does nothing, so in effect it is the larger.)
    - windows: stable 180 s, panic 60 s (metrics/client.go); the cooldown and bounds as for :class:`APA`.

    The metric is the role's total concurrency: kpa.go's own tests and Knative read ceil(value / target)
    with the value summed over pods (upstream's aggregator averages pod values, which would make the
    count independent of the pool's size).
    """
    name = "kpa"

    def __init__(self, prefill_c: float = 1.0, decode_c: float = 1.0, min_replicas: int = 1, max_replicas: int = 16,
                 **kw):
        self.cfg = {**AIBRIX_DEFAULTS, **{k: v for k, v in kw.items() if k in AIBRIX_DEFAULTS}}
        self.target = {"prefill": prefill_c, "decode": decode_c}
        self.min, self.max = min_replicas, max_replicas
        self.stable = {r: _TimeWindow(self.cfg["stable_window"]) for r in ROLES}
        self.panic = {r: _TimeWindow(self.cfg["panic_window"]) for r in ROLES}
        self.cooldown = {r: _Cooldown(self.cfg["up_cooldown"], self.cfg["down_cooldown"]) for r in ROLES}

    def recommend(self, cur: int, stable: float, panic: float, target: float) -> tuple[int, bool]:
        """kpa.go ``shouldEnterPanicMode`` + ``computeTargetReplicas``: (replicas, in panic)."""
        c = self.cfg
        in_panic = stable <= 0 or panic / stable > c["panic_threshold"]
        up = max(1.0, math.ceil(c["max_scale_up_rate"] * cur - 1e-9))
        down = math.floor(cur / c["max_scale_down_rate"] + 1e-9)
        hi, lo = target * (1 + c["up_tolerance"]), target * (1 - c["down_tolerance"])

        def pods(v):
            return math.ceil(v / target - 1e-9) if (v > hi or v < lo) else cur
        ds = int(min(max(pods(stable), down), up))
        dp = int(min(max(pods(panic), down), up))
        return (max(ds, dp) if in_panic else ds), in_panic

    def decide(self, snap: PoolSnapshot) -> Decision:
        want, why = {}, {}
        for r in ROLES:
            cur = snap.role(r).replicas
            q = _role_queue(snap, r)
            self.stable[r].record(snap.at, q)
            self.panic[r].record(snap.at, q)
            s, p = self.stable[r].avg(snap.at), self.panic[r].avg(snap.at)
            rec, panic = self.recommend(cur, s, p, self.target[r])
            rec = _bound(rec, self.min, self.max)
            want[r] = _bound(self.cooldown[r](snap.at, rec, cur), self.min, self.max)
            why[r] = f"{'panic' if panic else 'stable'}: concurrency {s:.2f} (stable) {p:.2f} (panic) vs {self.target[r]}"
        return _decision(snap, want, why)


class ARIMAPredictor:
    """Dynamo's default load predictor (components/planner/src/dynamo/planner/utils/load_predictor.py
    ``ARIMAPredictor``): ``pmdarima.auto_arima`` on the last ``window_size`` points, one step ahead; the
    last value until ``minimum_data_points`` points are in. NaN points are recorded as 0."""
    def __init__(self, window_size: int = 50, minimum_data_points: int = 5):
        self.window_size, self.minimum = window_size, minimum_data_points
        self.data: list[float] = []

    def add_data_point(self, v: float) -> None:
        self.data.append(0.0 if v is None or math.isnan(v) else float(v))
        self.data = self.data[-self.window_size:]

    def predict_next(self) -> float:
        if len(self.data) < self.minimum:
            return self.data[-1] if self.data else 0.0
        return _auto_arima_next(tuple(self.data))


@functools.lru_cache(maxsize=4096)
def _auto_arima_next(data: tuple) -> float:
    """pmdarima.auto_arima's one-step forecast (upstream's call and defaults). The request-count and ISL
    series of a scenario are the trace's, the same under every knob setting, so their forecasts are
    computed once per process.

    The fits run with one BLAS/OpenMP thread (threadpoolctl): their matrices are a few dozen points,
    where a second thread only adds synchronisation, and the simulator's ``--jobs`` processes would
    each start one per core. A scenario's dynamo run took 98 s with the default threads and 18 s with
    one on a shared 2-core machine, with the same figures (bench/RESULTS.md, eleventh session)."""
    import warnings

    import pmdarima
    from threadpoolctl import threadpool_limits
    with warnings.catch_warnings(), threadpool_limits(limits=1):
        warnings.simplefilter("ignore")
        model = pmdarima.auto_arima(list(data), suppress_warnings=True, error_action="ignore")
        return float(model.predict(n_periods=1)[0])


class ConstantPredictor(ARIMAPredictor):
    """load_predictor.py ``ConstantPredictor``: the last value."""
    def __init__(self, **_):
        super().__init__(minimum_data_points=1)

    def predict_next(self) -> float:
        return self.data[-1] if self.data else 0.0


class DynamoPlanner:
    """NVIDIA Dynamo's SLA planner as upstream has it (ai-dynamo/dynamo
    components/planner/src/dynamo/planner/utils/planner_core.py ``Planner.observe_metrics``,
    ``make_adjustments``, ``_compute_replica_requirements``; defaults.py ``SLAPlannerDefaults``;
    perf_interpolation.py ``DecodeInterpolator.find_best_throughput_per_gpu``):

    - every ``adjustment_interval`` (180 s), from the start: observe the interval's request count, mean
      ISL and OSL, mean TTFT and ITL; add num_req, ISL and OSL to three load predictors (``arima``, the
      default: :class:`ARIMAPredictor`, window 50); skip the adjustment when a metric is missing (no traffic);
    - correction factors: p = observed TTFT / profiled TTFT(ISL); d = observed ITL / profiled ITL at the
      observed concurrency per decode worker and context ISL + OSL/2;
    - prefill = ceil(next_num_req x next_ISL / interval x ``min(1, p)`` / profiled prefill throughput per
      GPU at next_ISL);
    - decode = ceil(next_num_req x next_OSL / interval / the best profiled decode throughput per GPU whose
      ITL <= ``itl`` / d at context next_ISL + next_OSL/2);
    - at least ``min_endpoint`` (1) each; scaled to ``max_gpu_budget`` when over it (here the pool's
      largest fleet, since upstream's default of 8 GPUs is a deployment setting, not an algorithm).

    The profile is the calibration (:class:`PerfModel`): prefill TTFT at batch 1 (ISL / TTFT is the
    throughput per GPU), and a decode step at each concurrency (upstream's profiler sweeps KV usage). The
    simulator's snapshot gives p90 latencies per 30 s, not means: their mean over the interval stands
    in for the interval's mean TTFT and ITL, so the corrections run a little high. The knob is the planner's
    ITL target, ``itl_fraction`` x the TPOT SLO (``--itl``); the TTFT target (``--ttft``) does not enter the
    replica count upstream (only its dry run), so prefill has no knob.
    """
    name = "dynamo"

    def __init__(self, perf: PerfModel, targets: dict, itl_fraction: float = 1.0, interval: float = 180.0,
                 load_predictor: str = "arima", window_size: int = 50, min_replicas: int = 1,
                 max_replicas: int = 16, gpu_budget: Optional[int] = None, **_):
        self.perf, self.interval = perf, interval
        self.itl = targets["decode"] * itl_fraction
        self.min, self.max = min_replicas, max_replicas
        self.budget = gpu_budget if gpu_budget is not None else 2 * max_replicas
        make = {"arima": ARIMAPredictor, "constant": ConstantPredictor}[load_predictor]
        self.pred = {k: make(window_size=window_size) for k in ("num_req", "isl", "osl")}
        self.p_corr = self.d_corr = 1.0
        self.last_at: Optional[float] = None
        self.seen: list[PoolSnapshot] = []
        self.current: Optional[dict] = None

    def prefill_thpt_per_gpu(self, isl: float) -> float:
        return isl / self.perf.remote_prefill_seconds(max(isl, 1.0))

    def best_decode_thpt(self, itl: float, ctx: float, most: float = 256.0) -> float:
        """find_best_throughput_per_gpu: the highest throughput (tokens/s per replica) over concurrency whose
        step meets ``itl``, at the lowest concurrency when none does. Upstream scans a 100-point KV-usage
        grid because its interpolated ITL need not be monotone; the calibrated step is, so the largest
        concurrency meeting ``itl`` is found by bisection."""
        from tandem.operator.autoscaler.capacity import _bisect
        step = self.perf.decode_step_seconds
        if step(1.0, ctx) > itl:
            return 1.0 / step(1.0, ctx)
        b = _bisect(lambda x: step(x, ctx) <= itl, 1.0, most)
        return b / step(b, ctx)

    def observe(self, seen: list, d_ready: int) -> Optional[dict]:
        """The interval's metrics (planner_core.py ``observe_metrics``), None where one is missing."""
        n = len(seen)
        rps = sum(s.prefill.arrivals_per_s for s in seen) / n
        ptps = sum(s.prefill.prompt_tokens_per_s for s in seen) / n
        otps = sum(s.decode.output_tokens_per_s for s in seen) / n
        darr = sum(s.decode.arrivals_per_s for s in seen) / n
        ttfts = [s.prefill.latency for s in seen if s.prefill.latency is not None]
        itls = [s.decode.latency for s in seen if s.decode.latency is not None]
        return {"num_req": rps * self.interval,
                "isl": ptps / rps if rps > 0 else math.nan,
                "osl": otps / darr if darr > 0 else math.nan,
                "ttft": sum(ttfts) / len(ttfts) if ttfts else math.nan,
                "itl": sum(itls) / len(itls) if itls else math.nan,
                # Little's law, as upstream's num_req / workers x request_duration / interval
                "concurrency": sum(s.decode.running for s in seen) / n / max(1, d_ready)}

    def replicas(self, num_req: float, isl: float, osl: float) -> dict:
        """planner_core.py ``_compute_replica_requirements`` (raises ValueError on a NaN prediction, where
        upstream logs and skips the adjustment)."""
        p_thpt = num_req * isl / self.interval * min(1.0, self.p_corr)
        num_p = math.ceil(p_thpt / self.prefill_thpt_per_gpu(isl))
        itl = self.itl / self.d_corr if self.d_corr > 0 else self.itl
        d_thpt = num_req * osl / self.interval
        num_d = math.ceil(d_thpt / self.best_decode_thpt(itl, isl + osl / 2))
        num_p, num_d = max(num_p, self.min), max(num_d, self.min)
        if num_p + num_d > self.budget:
            scale = self.budget / (num_p + num_d)
            num_p = max(self.min, round(num_p * scale))
            num_d = max(self.min, round(self.budget - num_p))
        return {"prefill": num_p, "decode": num_d}

    def decide(self, snap: PoolSnapshot) -> Decision:
        if self.current is None:
            self.current = {r: snap.role(r).replicas for r in ROLES}
            self.last_at = snap.at
        self.seen.append(snap)
        if snap.at - self.last_at < self.interval - 1e-9:
            return _decision(snap, self.current, {r: "between adjustment intervals" for r in ROLES})
        self.last_at = snap.at
        seen, self.seen = self.seen, []
        m = self.observe(seen, snap.decode.ready)
        for k in self.pred:
            self.pred[k].add_data_point(m[k])
        if any(math.isnan(m[k]) for k in ("ttft", "itl", "isl", "osl")):
            return _decision(snap, self.current, {r: "metrics missing (no traffic): adjustment skipped" for r in ROLES})
        self.p_corr = m["ttft"] / self.perf.remote_prefill_seconds(max(m["isl"], 1.0))
        self.d_corr = m["itl"] / self.perf.decode_step_seconds(max(1.0, m["concurrency"]), m["isl"] + m["osl"] / 2)
        try:
            nxt = {k: self.pred[k].predict_next() for k in self.pred}
            want = self.replicas(nxt["num_req"], nxt["isl"], nxt["osl"])
        except (ValueError, ZeroDivisionError, OverflowError):
            return _decision(snap, self.current, {r: "prediction failed: adjustment skipped" for r in ROLES})
        self.current = {r: _bound(want[r], self.min, self.max) for r in ROLES}
        why = (f"predicted {nxt['num_req']:.0f} requests/{self.interval:.0f}s, ISL {nxt['isl']:.0f}, OSL "
               f"{nxt['osl']:.1f}; corrections TTFT {self.p_corr:.2f} (capped at 1), ITL {self.d_corr:.2f}")
        return _decision(snap, self.current, {r: why for r in ROLES})


class DynamoVariant:
    """The earlier stand-in for Dynamo's planner (not Dynamo: no ``min(1, ...)`` cap on the prefill
    correction, a constant predictor, a ``scale`` knob upstream lacks): every 180 s the last interval's
    mean demand over the profiled per-replica throughput, corrected by observed / expected latency."""
    name = "dynamo-variant"

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


class APAVariant:
    """The earlier stand-in for AIBrix APA (not AIBrix: one SLO-fraction knob for both roles, no metric
    window, no cooldown): desired = ceil(ready x latency / (fraction x SLO)) outside a 10% tolerance, at most
    2x up and 0.5x down per tick."""
    name = "apa-variant"

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
        # the minute's own service distribution where the loads carry it (scenarios.minute_loads with
        # perf): sized from the mean prompt alone, heavy-tailed prompts queue far past the model
        s = load.get("service_s") or self.perf.remote_prefill_seconds(max(load["prompt"], 1.0))
        cap = self.perf.prefill_capacity(self.targets["prefill"], s, cv2=load.get("service_cv2"))
        pre = load["rps"] * s / max(1e-9, cap * self.u)
        ctx = load["prompt"] + load["output"] / 2
        # decode as tandem's policy sizes it, with the minute's load known: the router's pick holds a
        # decode replica's place from arrival, through the prefill, to the last token
        # (PerfModel.decode_replicas)
        out = max(1.0, load["output"] - 1)
        dec = self.perf.decode_replicas(load["rps"] * out / self.u, ctx, self.targets["decode"], self.max * 4,
                                        s / out) if load["rps"] > 0 else 0
        return {"prefill": _bound(math.ceil(pre - 1e-9), self.min, self.max),
                "decode": _bound(math.ceil(dec - 1e-9), self.min, self.max)}

    @staticmethod
    def _minute(at: float) -> int:
        """The minute whose load the oracle knows at ``at`` (s): the one it is in, from its first second."""
        return int(at // 60)

    def decide(self, snap: PoolSnapshot) -> Decision:
        # past the trace's last minute nothing arrives, but requests are still finishing: it keeps the
        # last minute's fleet (sized to the minimum, it drained decode replicas under running streams)
        m = min(self._minute(snap.at), len(self.minutes) - 1)
        loads = [self.minutes[i] for i in range(m, m + self.ahead + 1) if 0 <= i < len(self.minutes)]
        needs = [self.need(x) for x in loads] or [{"prefill": self.min, "decode": self.min}]
        want = {r: max(n[r] for n in needs) for r in ROLES}
        why = "this and the next minute's load" if self.ahead else f"minute {m}'s load (the last begun)"
        return _decision(snap, want, {r: why for r in ROLES})


class ReactiveOracle(Oracle):
    """Knows the load of a minute once that minute has begun, and no later one; its replicas pay the
    start-up time.

    Once begun: at a tick on a minute's first second it still knows the minute before. Until the
    twenty-eighth session it knew the minute it was in from that first second, so at the tick on a
    minute's boundary it sized for 60 s that had not yet happened. The scenarios' shifts and bursts start
    on a minute's boundary, so it ordered their replicas one tick (15 s) before any policy that sees
    only the present can know of them. That tick decided aims: on the CPU calibration's output-shift at
    seed 1, replicas ordered at 1,200 s (ready at 1,320 s) met minute 22's TPOT, and the same replicas
    ordered at 1,215 s did not (docs/autoscaler-issue25.md, "The reactive oracle's first second")."""
    name = "oracle-reactive"
    ignores_startup = False
    ahead = 0

    @staticmethod
    def _minute(at: float) -> int:
        return max(0, math.ceil(at / 60) - 1)


class BehavedReactiveOracle(ReactiveOracle):
    """The reactive oracle held to the pool's own scaling behavior, as tandem's policy is held to it: each
    role's ``autoscaling.behavior`` from the spec (Kubernetes HPA's semantics,
    ``HorizontalController.stabilizeRecommendationWithBehaviors`` and ``calculateScaleUpLimitWithScalingRules``
    / ``calculateScaleDownLimitWithBehaviors`` in pkg/controller/podautoscaler/horizontal.go, with the spec's
    one policy per direction): a scale-up takes the lowest recommendation of the up window and at most
    ``maxStep`` replicas per ``periodSeconds``; a scale-down the highest of the down window and at most
    ``maxStep`` per ``periodSeconds``; the count found at first sight counts as a recommendation
    (``recordInitialRecommendation``). The plain reactive oracle ignores all of it, so it drops a burst's
    replicas the minute the burst ends, which no policy that keeps the pool's behavior can do. (tandem's
    policy keeps a sample exactly one window old, HPA does not: the oracle is 15 s quicker at the edge.)

    A yardstick, not a peer: ``run.reach`` asks whether an aim the plain reactive oracle reaches is still
    reachable by a reactive policy that keeps the behavior (with the scenarios' 300 s window and one
    replica a minute down, it is not always).

    Args:
        behavior: {role: :class:`~tandem.operator.autoscaler.policy.RoleLimits`} (windows and periods in
            seconds, steps in replicas); the other arguments as for :class:`Oracle`.
    """
    name = "oracle-reactive-behaved"

    def __init__(self, perf: PerfModel, targets: dict, minutes: list, behavior: dict, **kw):
        super().__init__(perf, targets, minutes, **kw)
        self.behavior = behavior
        self.recs = {r: None for r in ROLES}     # (at, the unbehaved recommendation); None until first seen
        self.changes = {r: [] for r in ROLES}    # (at, applied delta)

    def decide(self, snap: PoolSnapshot) -> Decision:
        d = super().decide(snap)
        for r in ROLES:
            x, lim = d.role(r), self.behavior[r]
            cur, want, at = x.current, x.desired, snap.at
            if self.recs[r] is None:
                # recordInitialRecommendation: the count found at first sight is a recommendation, so the
                # first down window cannot drop below it (tandem's policy does the same)
                self.recs[r] = [(at, cur)]
            span = max(lim.up_window, lim.down_window, lim.up_period, lim.down_period)
            prior = [(t, v) for t, v in self.recs[r] if t > at - span]
            self.changes[r] = [(t, n) for t, n in self.changes[r] if t > at - span]
            # HPA's cut-offs are strict (``timestamp.After(now - window)``): with no up window only the
            # present recommendation counts
            if want > cur:
                want = stabilized(cur, want, prior, at, lim.up_window, strict=True)
                want = min(want, cur + step_room(self.changes[r], at, lim.up_period, lim.up_step, up=True))
            elif want < cur:
                want = stabilized(cur, want, prior, at, lim.down_window, strict=True)
                want = max(want, cur - step_room(self.changes[r], at, lim.down_period, lim.down_step, up=False))
            self.recs[r] = prior + [(at, x.desired)]
            if want != cur:
                self.changes[r].append((at, want - cur))
            if want != x.desired:
                x.reason += f"; {want} by the pool's behavior"
            x.desired = want
        return d
