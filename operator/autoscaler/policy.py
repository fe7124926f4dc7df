"""tandem's SLO autoscaling policy: one :class:`Autoscaler` per pool, fed a :class:`PoolSnapshot` per
tick, returning a :class:`Decision`. Pure and clock-free: time is ``snapshot.at`` only, so the operator,
the local fleet and the simulator drive the same code. Imports no kopf.

The algorithm (docs/autoscaler.md says what comes from whom):

1. Per role, the signal: ``no_data`` holds the count (never below min); ``idle`` goes to min, or to 0
   where the pool scales to zero; ``ok`` sizes the role.
2. Sizing from demand (DistServe's per-role capacity, Dynamo's planner): prefill demand is busy seconds
   per second (arrivals x the calibrated remote-prefill time of the mean prompt), decode demand is
   output tokens per second. Capacity per replica at the SLO comes from the calibration
   (:mod:`.capacity`), its latency multiplied by a correction learned online (observed / predicted).
   Demand is forecast one start-up time ahead (a linear trend over the last few minutes, never below
   the present; not extrapolated where a level shift fits the window clearly better than the line,
   nor further ahead than the window's samples span), and work
   queued in the workers is added as backlog to clear within a start-up time.
   Prefill keeps room for the rises within one start-up time it has seen over the last half hour (a
   quantile of them, ``burst_quantile``): bursts that recur cannot be chased, only provisioned for.
   Decode keeps such room too once its TPOT has broken in two separate rises (``decode_room``).
3. Latency is the constraint: above the tolerance band the role never shrinks and grows at least in
   proportion to observed/target (HPA's rule) beyond the ready replicas; inside the band nothing
   changes (unless the forecast alone needs more); below it the demand decides.
4. Starting replicas count as capacity on the way: the latency rule compares with ready + starting.
5. HPA's behavior: stabilization windows (up: the lowest recommendation of the window; down: the
   highest), and at most ``maxStep`` replicas per ``periodSeconds`` each way; then min and max. While
   latency is below the band (for prefill, also the TTFT its queue predicts), a scale-up must be called
   for over ``confirm_s`` (a burst shorter than the start-up is not chased), and prefill replicas still
   starting that are no longer needed are cancelled at once (``cancel_starting``).
6. Pool-wide: the prefill:decode ratio band and the GPU budget, the fewest GPUs meeting both. When the
   budget binds, decode gets priority: a decode shortfall slows every running sequence and nothing
   else can take it, while prefill overflow can go to decode replicas' local-prefill path.
7. Burst absorption (TokenScale, arXiv 2512.03416): when prefill breaks or is forecast to break its TTFT
   target while its new replicas start (or it cannot grow), and decode runs below its target, the
   decision asks the router to prefill on decode replicas until the next tick; behind a deep prefill
   backlog also past decode's target, while a decode replica would still start a prompt sooner
   (``absorb_deep_backlog``).
8. No new decision while a previous change is rolling out (``snapshot.rolling_out``).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Optional

from tandem.operator.autoscaler.behavior import stabilized, step_room
from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.snapshot import Decision, PoolSnapshot, RoleDecision, RoleSnapshot

from tandem.worker.api.names import WORKER_ROLES as ROLES

#: the no-wait p90 TTFT that the capacity probe's guard (``Autoscaler._one_fewer_holds``) assumes: the mean
#: service plus this many of its standard deviations (sqrt(cv^2) x the mean). The mean alone (0) reads the
#: service's own tail as queueing: on the CPU calibration's step it fitted 6.8 erlangs to 8 replicas that
#: then held the target at 7, and blocked probes that were safe (seed 1 TPOT 95% -> 93.3% by way of
#: decode's hold). Tuned on seed 1 among {0, 0.5, 0.8, 1.0, 1.28}: 0.5 keeps that TPOT miss, 1.28 (the
#: normal p90) lets the H200 prompt-shift's probe break TTFT again; 0.8 and 1.0 meet both.
PROBE_SERVICE_TAIL = 1.0


def measured(x) -> bool:
    """Whether a latency (seconds, or None / NaN when the window had no sample) was measured."""
    return x is not None and not math.isnan(x)


def gpus_per_replica(role_spec) -> int:
    """GPUs one replica of a role requests; a replica that requests none counts as 1 (the CPU fleet's
    stand-in for a GPU, so that budgets and GPU-hours still mean replicas)."""
    from tandem.operator.spec import _gpus
    return max(1, _gpus(role_spec))


@dataclass
class RoleLimits:
    """One role's autoscaling settings, flattened from the spec (defaults for a role without any)."""
    enabled: bool
    min: int
    max: int
    target: float
    percentile: float
    tolerance: float
    up_window: float
    up_step: int
    up_period: float
    down_window: float
    down_step: int
    down_period: float
    gpus: int

    @classmethod
    def of(cls, role_spec, default_target: float) -> "RoleLimits":
        a = role_spec.autoscaling
        fixed = role_spec.replicas if role_spec.replicas is not None else 1
        if a is None or not a.enabled:
            from tandem.operator.spec import RoleAutoscaling
            b = RoleAutoscaling().behavior
            return cls(False, fixed, fixed, default_target, 90.0, 0.1, b.scaleUp.stabilizationWindowSeconds,
                       b.scaleUp.maxStep, b.scaleUp.periodSeconds, b.scaleDown.stabilizationWindowSeconds,
                       b.scaleDown.maxStep, b.scaleDown.periodSeconds, gpus_per_replica(role_spec))
        b = a.behavior
        return cls(True, a.minReplicas, a.maxReplicas, a.target.seconds, a.target.percentile, a.tolerance,
                   b.scaleUp.stabilizationWindowSeconds, b.scaleUp.maxStep, b.scaleUp.periodSeconds,
                   b.scaleDown.stabilizationWindowSeconds, b.scaleDown.maxStep, b.scaleDown.periodSeconds,
                   gpus_per_replica(role_spec))


@dataclass
class _RoleState:
    recs: deque = field(default_factory=deque)        # (at, recommendation)
    events: deque = field(default_factory=deque)      # (at, delta) of applied changes
    demand: deque = field(default_factory=deque)      # (at, demand in the role's unit)
    correction: float = 1.0                           # capacity factor: real / modelled capacity
    ceiling: Optional[tuple] = None                   # (at, factor) when a factor was last found too high
    corrected_at: Optional[float] = None              # when the factor was last lowered, or last faded
    first_at: Optional[float] = None                  # this policy's first decision (restart or new spec)
    ups: deque = field(default_factory=deque)         # when scale-ups were applied, over one start-up
    seen: deque = field(default_factory=deque)        # (at, demand, level) awaiting one start-up of what came next
    rises: deque = field(default_factory=deque)       # (at, the peak over the next start-up / the level then)
    breaches: deque = field(default_factory=deque)    # [first, last] breach of each episode over the target
    readies: deque = field(default_factory=deque)     # (at, ready replicas) over the last metrics window
    last_over: Optional[tuple] = None                 # decode's last window measured, if it was above the
                                                      # band: (replicas that served it, at least 1; its
                                                      # p90 TPOT in s; the higher of its demand and level)


@dataclass
class _Sized:
    rec: int
    reason: str
    inputs: dict


class Autoscaler:
    """The pool's policy. ``decide`` is called once per tick with the latest snapshot.

    Args:
        spec: the pool's :class:`~tandem.operator.spec.InferencePoolSpec`.
        calibration: the performance model (:class:`~tandem.worker.api.calibration.Calibration`); without
            one the policy sizes from latency alone (HPA's proportional rule on the SLO metric) and from
            the throughput per replica it observes.
        startup_s: how far ahead to forecast demand: a replica's start-up time (seconds).
        forecast_window_s: the span the linear trend is fitted over (seconds); a trend is extrapolated only
            from samples spanning ``startup_s`` or more, so a window shorter than that never leads. 240
            (was 180): on the Azure code trace x10 (H200 calibration) the first half, which is tuned on,
            costs 15% fewer GPU-hours at the same attainment and the second half 6% fewer; on the measured H200
            calibration the first half's TTFT attainment rises from 88.9% to 92.6% at 8.4% fewer. Each
            scenario suite's total at seed 1 stays within 0.4%; the CPU one misses one more aim there
            (bursts against hpa-queue, neither dominating) (bench/RESULTS.md, twenty-second session).
        correction_alpha: weight of each new observation in the latency correction (0..1).
        headroom: the fraction of the SLO capacity the demand sizing plans to use (0..1]; the rest absorbs
            noise between ticks.
        catch_up_s: prefill sizes to drain its backlog within this many seconds of new replicas being
            ready (see ``_catch_up``).
        confirm_s: while the role's latency is below the tolerance band (for prefill, also the TTFT its
            queue predicts: :meth:`_queued_ttft`), a scale-up waits until the demand has called for it
            for this many seconds (the lowest recommendation of that span is
            applied): a burst shorter than the start-up is over before new replicas are ready, and
            replicas started for it are then held by the scale-down window. Latency above the band
            scales up at once. 0 turns it off.
        cancel_starting: while prefill's latency (and its queue's TTFT) is below the band, replicas still
            starting that the recommendation no longer needs are cancelled at once (a ReplicaSet removes
            not-ready pods first), outside the scale-down window and step: they serve nothing yet. Not within one
            metrics window of the last scale-up: that window overlaps the one that called for it
            (cancelling on it was most of step's prefill flapping). Prefill only: a
            decode replica's TPOT sits at 0.67x its target with one sequence, so decode latency below the
            band says nothing about margin.
        hold_first_token: size decode for the requests in flight there, not only the running sequences:
            the router picks a request's decode replica at arrival and counts it in flight from then on
            (worker/router/policy.py ``pick_decode``), so a request holds a place in the balance through
            its prefill (:meth:`PerfModel.decode_replicas`, ``hold_s_per_token``). Off, the sizing counts
            running sequences alone, as it did until issue 25 (the simulator then picked the decode
            replica when the prefill ended).
        hold_service_share, hold_ttft_share: the hold is this share of the calibrated prefill service,
            or that share of the observed p90 TTFT when a queue makes that longer (both 0..1); the p90,
            of the last window, counts at most the TTFT prefill's queue predicts now (:meth:`_queued_ttft`;
            docs/autoscaler-issue25.md, "The hold after a backlog"). A held place is not a running sequence: it
            moves the router's balance, and the next arrivals go to the pool's other replicas, so
            counting the whole time to first token oversized
            decode (issue 10's diurnal scenario, seed 0: 2.5 decode replicas above the reactive oracle,
            GPU-hours x1.15 of it). 0.4 and 0.25 (were 1.0 and 0.5) were the cheapest pair of a grid on
            seed 1 that kept every attainment the old pair met: -8.7% GPU-hours on seed 1, -7.9% on
            seed 0 (docs/autoscaler-issue25.md, "The decode hold's share"). The TTFT share is 0 since the
            thirtieth session: a queue's wait is shared by every decode replica's held places alike, so
            it moves no balance. What the longer hold did was order decode replicas during a prefill
            backlog, ready only once the backlog's flood had passed (the CPU step at seed 0: 16 decode
            replicas for a level that needs 12-14); the TPOT it once protected (fourteenth session)
            was the headroom decode's probe took at the cliff, gated since (``decode_probe_min_slots``;
            ungated, a TTFT share of 0 takes step's TPOT at seed 1 to 93.3%). -1.8% GPU-hours on seed
            1 with every attainment kept, -1.5% on seeds 0, 2-4 and 15-19 with the same 33 of 45
            scenario-seeds meeting both SLOs; the H200 (derived) calibration and the Azure code trace
            x10 within 0.1% (docs/autoscaler-issue25.md, "The decode hold without the queue's wait").
        absorb_within_slack: burst absorption only while a local prefill of the mean prompt fits in the
            running sequences' TPOT slack over their output (target x (1 - tolerance) minus the observed
            p90 TPOT, times the mean output tokens): a local prefill stalls the decode batch it joins for
            its whole compute. Off, absorption needs decode below the band alone, as until issue 25; on
            the Azure code trace (H200 calibration) that stalled batches with 5k-token prefills and took
            TPOT attainment to 81.5%. And only while the stalls of all the prompts arriving, spread over
            the ready decode replicas, leave their steps the time to keep the band: with ``u`` the
            share of a replica's time spent prefilling (prompts/s / decode replicas x the stall), the
            p90 TPOT becomes about p90 / (1 - u). One stall that fitted the slack was not enough: at 150
            prompts/s on 6 H200 decode replicas (u = 0.59) absorption took p90 TPOT from 0.011 s to
            0.043 s for four minutes (docs/autoscaler-issue25.md, "Absorption at the rate prompts arrive").
        absorb_deep_backlog: absorb past decode's TPOT slack, while prefill is short and breaking as
            absorption always needs, when prefill's queue predicts a TTFT over this many times its
            target (:meth:`_queued_ttft`) and a prompt would still start sooner on a decode replica:
            its queue of local prefills, the one already there plus what one more tick of absorbing
            adds, plus the prompt's own local prefill, is shorter than the prefill queue's wait
            (:meth:`_deep_backlog`; 0 turns it off). The rationale: behind such a backlog (on the CPU
            calibration's prompt-shift up to about 100 s) a new prompt loses more to the queue than a
            local prefill's stall costs the sequences running beside it. After TokenScale's
            convertible decoders, here past its headroom condition. On that scenario it meets the SLO
            on seeds 1 and 0 (93.3% / 93.3% -> 95.0% / 95.0%) at 2.8% / 3.0% fewer GPU-hours, where
            decode's p90 TPOT after the shift (1.2-1.4x its target) left no slack. Seed 1's users:
            end-to-end p99 69 -> 39 s, at the price of 46 requests over 5x the TPOT target (none
            before). On the Azure trace with its own lengths on the CPU calibration (out of reach
            either way) the second half's TPOT attainment fell 51.8% -> 44.4%. Without the
            local-queue test the H200 calibration's step gave the decode replicas 7 times the
            prefill work they can do (TTFT / TPOT 91.7% / 89.8%); with it, nothing there moves. All of
            this is simulated. The real metric sources read decode's ``waiting`` and prefill's
            ``arrivals_per_s`` as the simulator does (docs/autoscaler-actuation.md), and
            ``test_fleet_autoscaling.py::test_a_deep_prefill_backlog_is_prefilled_on_the_decode_worker``
            checks on real processes that the rule fires and the router acts on it.
        recurring: confirmation and cancelling apply to isolated bursts only: while the role's
            recommendation was above its count within the last ``recurring_windows`` scale-down windows
            (before the confirmation span), another rise is load coming back, and scales up at once. An
            autoscaler that has not yet seen that span (just started, or rebuilt for a new spec) cannot
            tell whether what it started was for a burst, and cancels nothing: on the Azure code trace
            (H200 calibration) cancelling the replicas started for the first minute's load left 4
            prefill replicas for the burst at minute 4 (TTFT attainment of the first half 85.2% ->
            88.9%).
        recurring_windows: that memory in scale-down windows (default 1). Bursts that come back every
            5-8 minutes, as on the Azure code trace, need 3 (first half: 96.3% TTFT attainment at 5.81
            GPU-hours, where hpa-slo has 96.3% at 7.67); on issue 10's scenarios 2 already costs 3.6%
            more GPU-hours and output-shift's TPOT aim, so the tuned default is 1 (docs/autoscaler-issue25.md).
        burst_quantile: prefill keeps room for the rises in demand it has seen: for each past tick, the
            highest demand within the next start-up time over the level then; prefill's count covers the
            level times this quantile of those rises (over ``burst_lookback_s``), the headroom counting
            towards it. A reactive policy cannot start replicas for a burst in time, but it can learn how
            far the load jumps within a start-up and hold that room; steady load's rises stay within the
            headroom and change nothing. Prefill only: decode absorbs a burst by batching. 0.75 is the
            lowest setting of {0.5, 0.65, 0.7, 0.75, 0.8, 0.9} that meets the TTFT aim on the Azure code
            trace's first half (88.9% -> 96.3% at 5.36 -> 7.06 GPU-hours; hpa-slo: 96.3% at 7.67); on
            issue 10's scenarios at seed 1 it costs 0.3% more GPU-hours (0 is off; docs/autoscaler-issue25.md).
        burst_lookback_s: the span those rises are kept over (seconds).
        decode_room: decode keeps the same room, at this quantile of its own rises (output tokens/s),
            once its p90 TPOT has gone over the target in ``decode_room_breaches`` separate episodes
            (breaches less than a start-up apart are one) within ``decode_room_memory_s``: a decode pool
            absorbs a rise by batching, every sequence a little slower, and that suffices until a
            workload shows otherwise. On the H200 calibration's bursts (a step's cost nearly flat in the
            batch, so the pool runs at 3 replicas and the one-minute bursts push p90 TPOT 1-2% over the
            target) it meets the TPOT aim: seed 1 91.7% -> 96.7% at +1.6% GPU-hours, seed 0 93.3% ->
            98.3% at +1.8%; the other scenarios of both calibrations change by 0-1.5% (CPU bursts: 95% ->
            96.7%). Ungated (room from the first tick) it cost the CPU scenarios 2-16%, gaining only bursts'
            TPOT there (bench/RESULTS.md, fifteenth and sixteenth sessions). 0 is off.
        decode_room_breaches: the TPOT episodes that turn decode's room on (the first may be a one-off).
        decode_room_memory_s: how long an episode counts (seconds): longer than ``burst_lookback_s``,
            because the room, once on, prevents the breaches that turned it on.
        probe_guard: prefill's probe raises the factor only while one replica fewer would keep p90 TTFT
            under this times the target at the most load the measured p90 allows (``_one_fewer_holds``;
            0 turns it off). At 0.7x the target a probe that took one of 7 replicas away broke TTFT at
            1.1x on the H200 calibration's prompt-shift. With it (and ``catch_up_s`` 240, the grid's pick
            with it on seed 1) that scenario's TTFT attainment is 91.7% -> 95.0% at seed 1 and 90.0% ->
            95.0% at seed 0, at 1-2% fewer GPU-hours; the price is the H200 step, diurnal and bursts at
            +6-12% GPU-hours (the guard's M/G/c curve is steeper than a batching H200 replica's), and
            the CPU scenarios at seed 1 -0.6% in all (bench/RESULTS.md, seventeenth session).
        decode_probe_min_slots: decode's probe raises the factor only where a replica batches at least this
            many sequences at the SLO (:meth:`PerfModel.decode_slots` at the window's context; 0 turns the
            gate off). Below it the p90 TPOT reads no margin: a lone sequence's step is 0.67x the target
            (the SLO rule's 1.5x), a batch of two is past it, so the p90 sits at the batch-1 step until
            a tenth of the sequences share a replica and then jumps over the target, and "p90 under 0.75x
            the target", the probe's evidence of spare capacity, holds at every load short of that cliff.
            On the CPU calibration (1.6 slots) the factor climbed to 1.32 at steady load (output-shift,
            seed 4), where ``bench/decode_capacity_by_size.py`` measures 1.1, and decode ran the
            headroom away. With the gate, tandem met both SLOs in 20 of the 25 held-out scenario-seeds
            (seeds 5-9; 11 without) at +3.0% GPU-hours, the five left all prompt-shift; seed 1 +2.8%
            with the SLOs met on the same scenarios; the H200 calibration (10-22 slots) and the traces are unchanged
            (bench/RESULTS.md, twenty-ninth session; ``bench/seeds_table.py``).
        probe_memory_s: after an overload lowered the capacity factor, it is not raised past the lowered
            value again for this long (seconds; 0 turns it off): the factor's upward probe (``_learn``)
            lets the count fall until latency breaks, and at steady load repeating it repeats the miss
            (the H200 calibration's prompt-shift at seed 1: a miss every ~10 minutes after the shift,
            TTFT attainment 88.3% -> 91.7% at 4% fewer GPU-hours; issue 10's scenarios at seed 1 +0.3%).

        step_fit: the forecast extrapolates no trend while two levels split in the window fit it with a
            squared error this many times smaller than the line's, or smaller still (``_forecast``; 0 turns
            it off; negative raises ValueError). A line through a step in demand keeps rising for a whole
            forecast window after it, and the replicas planned for that were held by the scale-down
            window. 1.5 is the Bayesian information criterion's price for the split's two extra parameters
            (a second mean and the split point) over a 180 s window's 12-13 samples, n^(2/n) (over the
            240 s window's 16-17 it is 1.40-1.41, so 1.5 is a little stricter). Measured at 180 s: at 1 a noisy ramp
            (t about 5) lost its lead in 31% of draws, at 1.5 in 5%, while 96% of noisy steps were still
            held. At 1.5 issue 10's scenarios at seed 1 cost 1.4% fewer GPU-hours (step -2.1%,
            output-shift -2.8%), the H200 calibration's 1.5% (step -4.2%) and the Azure code trace's
            first half 2.8%, at the same attainments (bench/RESULTS.md, twenty-first session).

    The defaults of ``headroom`` and ``catch_up_s`` were tuned as the simulator's baselines are: on a
    grid, on issue 10's scenarios at seed 1, one setting for all five (docs/autoscaler.md);
    ``confirm_s`` and ``cancel_starting`` were chosen on seed 1 too (issue 25).
    """

    def __init__(self, spec, calibration=None, *, startup_s: float = 120.0, forecast_window_s: float = 240.0,
                 correction_alpha: float = 0.2, headroom: float = 0.8, catch_up_s: float = 240.0,
                 confirm_s: float = 90.0, cancel_starting: bool = True, hold_first_token: bool = True,
                 hold_service_share: float = 0.4, hold_ttft_share: float = 0.0,
                 absorb_within_slack: bool = True, absorb_deep_backlog: float = 2.0,
                 recurring: bool = True, recurring_windows: float = 1.0,
                 burst_quantile: float = 0.75, burst_lookback_s: float = 1800.0, probe_memory_s: float = 1800.0,
                 decode_room: float = 0.9, decode_room_breaches: int = 2, decode_room_memory_s: float = 3600.0,
                 decode_probe_min_slots: float = 2.0,
                 probe_guard: float = 1.0, step_fit: float = 1.5):
        self.spec = spec
        self.perf = PerfModel.of(calibration)
        self.startup_s = float(startup_s)
        self.forecast_window_s = float(forecast_window_s)
        self.correction_alpha = float(correction_alpha)
        self.headroom = float(headroom)
        self.catch_up_s = float(catch_up_s)
        self.confirm_s = float(confirm_s)
        self.cancel_starting = bool(cancel_starting)
        self.hold_first_token = bool(hold_first_token)
        self.hold_service_share = float(hold_service_share)
        self.hold_ttft_share = float(hold_ttft_share)
        self.absorb_within_slack = bool(absorb_within_slack)
        self.absorb_deep_backlog = float(absorb_deep_backlog)
        self.recurring = bool(recurring)
        self.recurring_windows = float(recurring_windows)
        self.burst_quantile = float(burst_quantile)
        self.burst_lookback_s = float(burst_lookback_s)
        self.decode_room = float(decode_room)
        self.decode_room_breaches = int(decode_room_breaches)
        self.decode_room_memory_s = float(decode_room_memory_s)
        self.decode_probe_min_slots = float(decode_probe_min_slots)
        self.probe_memory_s = float(probe_memory_s)
        self.probe_guard = float(probe_guard)
        if step_fit < 0:
            raise ValueError(f"step_fit must be >= 0 (0 turns the level-shift test off), not {step_fit}")
        self.step_fit = float(step_fit)
        self.limits = {"prefill": RoleLimits.of(spec.prefill, 1.0), "decode": RoleLimits.of(spec.decode, 0.1)}
        pa = spec.autoscaling
        self.scale_to_zero = bool(pa.scaleToZero)
        self.advisory = pa.mode == "advisory"
        self.ratio = (pa.ratio.min, pa.ratio.max) if pa.ratio is not None else None
        self.budget = pa.gpuBudget
        self.state = {r: _RoleState() for r in ROLES}
        self.sizes = {"prompt": 0.0, "output": 0.0}   # mean tokens per request, of the last window with arrivals
        self.last: Optional[Decision] = None

    # ------------------------------------------------------------------------------------------
    def decide(self, snapshot: PoolSnapshot) -> Decision:
        """The decision for this tick. Deterministic given the sequence of snapshots."""
        at = snapshot.at
        wake = snapshot.router_queued > 0 and any(snapshot.role(r).replicas == 0 for r in ROLES)
        # the requests' mean sizes come from the window's arrivals; a window with streams still running
        # and none arriving keeps the last ones seen: read as 0, a decode replica's context was 0 and
        # its slots at the SLO too many (the real-process fleet test, shipped CPU calibration: 13.7
        # against the 9.9 of its requests' 75 tokens), and each held place weighed a whole prefill per
        # output token
        pre, dec = snapshot.prefill, snapshot.decode
        if pre.arrivals_per_s > 0:
            self.sizes["prompt"] = pre.prompt_tokens_per_s / pre.arrivals_per_s
        if dec.arrivals_per_s > 0:
            self.sizes["output"] = dec.output_tokens_per_s / dec.arrivals_per_s
        sized = {r: self._size(r, snapshot, wake) for r in ROLES}
        decisions = {}
        for r in ROLES:
            rs, lim, st = snapshot.role(r), self.limits[r], self.state[r]
            cur = rs.replicas
            s = sized[r]
            if not lim.enabled:
                decisions[r] = RoleDecision(r, cur, lim.min, s.rec, rs.signal,
                                            f"autoscaling is off: {lim.min} replicas", None, s.inputs)
                continue
            if st.first_at is None:
                st.first_at = at
            st.recs.append((at, s.rec))
            horizon = max(lim.up_window, lim.down_window * max(1.0, self.recurring_windows), lim.up_period,
                          lim.down_period) + 1
            while st.recs and st.recs[0][0] < at - horizon:
                st.recs.popleft()
            queued = self._queued_ttft(rs, s.inputs.get("service_s")) if r == "prefill" else None
            desired, limited = self._behave(r, cur, s.rec, at, rs, wake, queued)
            decisions[r] = RoleDecision(r, cur, desired, s.rec, rs.signal, s.reason, limited, s.inputs)

        priority = self._pool_bounds(decisions, snapshot)
        if snapshot.rolling_out:
            for d in decisions.values():
                if d.desired != d.current:
                    d.reason += f"; held at {d.current}: the last change is still rolling out"
                    d.desired, d.limited_by = d.current, "rollout"
        for r in ROLES:
            d = decisions[r]
            if d.delta != 0:
                self.state[r].events.append((at, d.delta))
            if d.delta > 0:
                st = self.state[r]
                st.ups.append(at)
                while st.ups and st.ups[0] < at - self.startup_s:
                    st.ups.popleft()
        absorb = self._absorb(snapshot, decisions)
        self.last = Decision(at, decisions["prefill"], decisions["decode"], absorb, self.advisory, priority)
        return self.last

    # ------------------------------------------------------------------------------------------
    def _size(self, role: str, snap: PoolSnapshot, wake: bool) -> _Sized:
        rs, lim, st = snap.role(role), self.limits[role], self.state[role]
        cur = rs.replicas
        floor = lim.min
        if wake and cur == 0:
            return _Sized(max(1, floor), f"woken: {snap.router_queued} requests queued at the router with no "
                                         f"{role} replica", {"router_queued": snap.router_queued})
        if rs.signal == "no_data":
            return _Sized(max(cur, floor), f"no data (failed, absent or stale scrape): holding {max(cur, floor)}",
                          {})
        if rs.signal == "idle" or (rs.arrivals_per_s <= 0 and rs.running <= 0 and rs.waiting <= 0):
            to = floor if (self.scale_to_zero or floor > 0) else max(floor, 1)
            st.last_over = None   # the overload the last latency showed is over
            return _Sized(to, f"idle (the scrape answered, nothing arrived): down to {to}", {"idle": True})

        target = lim.target
        demand, model, inputs = self._demand(role, snap)
        # forecast one start-up ahead: a linear trend over the recent window, never below the present
        st.demand.append((snap.at, demand))
        while st.demand and st.demand[0][0] < snap.at - self.forecast_window_s:
            st.demand.popleft()
        level, forecast = self._forecast(st.demand, snap.at + self.startup_s, demand, self.step_fit)
        # a burst prefill cannot serve queues, and the queue outlives the burst (TTFT breaks for minutes);
        # decode absorbs one by batching, every sequence a little slower, until its TPOT has shown that
        # this workload's rises break it
        if role == "prefill":
            rise = self._beyond_noise(self._rise(st, snap.at, demand, level, self.burst_quantile), rs)
        elif self.decode_room > 0:
            rise = self._rise(st, snap.at, demand, level, self.decode_room)
            if self._breach_episodes(st, snap.at, rs.latency, lim) < self.decode_room_breaches:
                rise = 1.0
        else:
            rise = 1.0
        need = urgent = None
        if model is not None:
            self._learn(role, snap, model(demand), model(demand * 1.25), inputs.get("service_s"),
                        inputs.get("slots_per_replica"))
            # up on the window's own demand (or its trend), down only as far as the smoothed level
            # allows: one noisy window can add a replica but not take one away
            catch = self._catch_up(role, rs, demand, inputs)
            # room for the rises seen: the headroom already covers 1/headroom of the level
            covered = level * rise * self.headroom
            need = min(lim.max * 4, model(max(forecast, demand, covered) + catch))
            smooth = min(lim.max * 4, model(max(forecast, level, covered)))
            if need < cur:
                need = min(cur, max(need, smooth))
            urgent = need
        if rise > 1:
            inputs["rise"] = round(rise, 3)
        inputs.update(demand=round(demand, 4), level=round(level, 4), forecast=round(forecast, 4), target=target,
                      capacity_factor=round(st.correction, 3), need=need)
        lat = rs.latency
        if not measured(lat):
            rec = max(need if need is not None else cur, cur if rs.waiting > 0 else 0)
            last = st.last_over
            if last is not None and last[1] > target * (1 + lim.tolerance) and rec < cur:
                # no request finished in the window (closed-loop gaps, streams longer than the window),
                # and the last window that measured one was over the target: the model alone overrated
                # decode on the live CPU calibration ("needs 1" at 37 tokens/s where 2 replicas had just
                # measured 1.16-1.46x the target) and took the e2e story's pool 2 -> 1, 20 s after that
                # window. Kubernetes' HPA does not scale down on metrics it lacks; here the last latency
                # measured stands for the load it was measured at: the pool goes no lower than the count
                # that gives each replica no more of the demand now than each carried then (fewer would
                # be over the target too). Not scaled by the ratio, as HPA's rule is: a TPOT sits at the
                # batch-1 step below a load and rises steeply past it, so the ratio overstates lighter
                # loads. Once the load behind it has gone (the fleet test's heavy run at 120 tokens/s,
                # then a trickle of two streams at 29-39), the model decides, as before. Decode only: a
                # TPOT is measured when its request ends, so long streams leave windows without one, and
                # decode is where the model was seen to overrate the pool. The latency is kept in seconds
                # and compared with the target now, which a GitOps sync may have changed
                served, lat_then, then = last
                keep = math.ceil(served * demand / then - 1e-9) if then > 0 else cur
                if keep > rec:
                    rec = min(cur, keep)
                    return _Sized(rec, f"no latency yet; the last window measured was x{lat_then / target:.2f} "
                                       f"the target at {served:.3g} replicas and a load of {then:.3g}: at "
                                       f"{demand:.3g}, {rec} replicas", inputs)
            return _Sized(rec, f"no latency yet; demand {demand:.3g} needs {rec}", inputs)
        ratio = lat / target
        inputs.update(observed=round(lat, 4), ratio=round(ratio, 3))
        served = self._served(st, snap.at, rs)
        # a TPOT is measured when its request ends, and tells of the load over the request's whole stream:
        # the load behind it is the smoothed level as much as the window's demand (in the fleet test the
        # heavy run's last window read 1.87x the target at a demand of 38 tokens/s, where the run's windows
        # had read 128)
        breach = role == "decode" and ratio > 1 + lim.tolerance
        st.last_over = (max(served, 1.0), lat, max(demand, level)) if breach else None
        if served < rs.ready:
            inputs["served"] = round(served, 2)
        if ratio > 1 + lim.tolerance:
            # HPA's proportional rule on the replicas that served the window; starting ones are the
            # capacity on the way
            prop = math.ceil(max(served, 1) * min(ratio, 2.0) - 1e-9)
            rec = max(cur, prop, urgent or 0)
            if rec == cur and rs.starting == 0 and rs.waiting > 0:
                rec = cur + 1
            return _Sized(rec, f"{self._metric(role)} {lat:.3g}s above target {target:.3g}s (x{ratio:.2f}); "
                               f"{rec} replicas", inputs)
        if ratio >= 1 - lim.tolerance:
            rec = max(cur, need) if need is not None else cur
            why = "within the tolerance band" + (f", forecast needs {rec}" if rec > cur else "")
            return _Sized(rec, f"{self._metric(role)} {lat:.3g}s vs target {target:.3g}s {why}", inputs)
        rec = need if need is not None else max(1, math.ceil(rs.ready * ratio / (1 - lim.tolerance / 2)))
        return _Sized(rec, f"{self._metric(role)} {lat:.3g}s below target {target:.3g}s; demand "
                           f"{forecast:.3g} (forecast) needs {rec}", inputs)

    @staticmethod
    def _served(st: _RoleState, at: float, rs: RoleSnapshot) -> float:
        """The replicas that served the metrics window (``rs.window_s``): the mean of the ready counts this
        policy saw over it, never more than the ready count now. A replica that became ready within the
        window has not yet shown in the window's latency; scaled by that latency, it counts a breach it
        did not cause (after Kubernetes' HPA, which uses a pod's sample only if it was taken wholly while
        the pod was ready: ``--horizontal-pod-autoscaler-cpu-initialization-period``). On the CPU step
        (seed 1) prefill's ready count went 3, 5, 7, 9 over 1,320-1,365 s while the window's p90 TTFT
        still read the three's queue (x2.56, then x1.79), and the rule asked for 14, then 17, of a
        pool whose load needed 10: replicas started to be cancelled a minute later, at start-up cost."""
        st.readies.append((at, rs.ready))
        while st.readies and st.readies[0][0] < at - max(rs.window_s, 1.0):
            st.readies.popleft()
        return min(float(rs.ready), sum(r for _, r in st.readies) / len(st.readies))

    def _breach_episodes(self, st: _RoleState, at: float, lat, lim) -> int:
        """How many episodes of latency above the target ended within ``decode_room_memory_s`` (one episode:
        breaches less than a start-up time apart)."""
        if measured(lat) and lat > lim.target:
            if not st.breaches or at - st.breaches[-1][1] > self.startup_s:
                st.breaches.append([at, at])
            else:
                st.breaches[-1][1] = at
        while st.breaches and st.breaches[0][1] < at - self.decode_room_memory_s:
            st.breaches.popleft()
        return len(st.breaches)

    def _rise(self, st: _RoleState, at: float, demand: float, level: float, quantile: float) -> float:
        """The ``quantile`` of the rises seen over the last ``burst_lookback_s``: for each past tick,
        the highest demand of the start-up time after it over the level at it (1 when off, or with fewer
        than 8 ticks seen a whole start-up ago)."""
        if quantile <= 0:
            return 1.0
        st.seen.append((at, demand, level))
        while st.seen and st.seen[0][0] <= at - self.startup_s:
            t0, _, lv = st.seen.popleft()
            peak = max([d for t, d, _ in st.seen if t <= t0 + self.startup_s] + [0.0])
            if lv > 0:
                st.rises.append((t0, peak / lv))
        while st.rises and st.rises[0][0] < at - self.burst_lookback_s:
            st.rises.popleft()
        if len(st.rises) < 8:
            return 1.0
        xs = sorted(r for _, r in st.rises)
        return max(1.0, xs[min(len(xs) - 1, int(quantile * len(xs)))])

    def _beyond_noise(self, rise: float, rs: RoleSnapshot) -> float:
        """The part of prefill's ``rise`` (the quantile of peak demand over the level, :meth:`_rise`)
        that a steady Poisson stream's counting noise does not explain. At a steady rate, a window of
        ``rs.window_s`` seconds counts n = arrivals x window prompts, and its demand (their summed
        service) deviates from the mean by a relative standard deviation of sqrt((1 + cv^2) / n) (cv^2:
        the calibrated service time's). The highest of the k = start-up / window independent windows
        after a tick lies z of those above the level at the rises' quantile q, with z = Phi^-1(q^(1/k))
        (1.48 at q = 0.75 and k = 4). That much is noise, and the M/G/c sizing already provisions for
        Poisson arrivals; the excess over 1 counts beyond it, as two independent deviations add (in
        quadrature). On the CPU prompt-shift at seed 1 (1.2 prompts/s, n = 35, noise 0.27 of the mean),
        the rises after the shift read 1.31-1.40 and held one prefill replica more than the level needed
        for some forty minutes; beyond the noise they are 1.08-1.29. At the bursts scenario's 1.9
        prompts/s a rise of 2 keeps 1.98 and one of 1.4 keeps 1.34. Returns ``rise`` unchanged without a
        calibration or arrivals, or at or below 1."""
        if rise <= 1 or self.perf is None or rs.arrivals_per_s <= 0:
            return rise
        n = rs.arrivals_per_s * max(rs.window_s, 1.0)
        k = max(1.0, self.startup_s / max(rs.window_s, 1.0))
        z = NormalDist().inv_cdf(min(0.999, max(0.5, self.burst_quantile)) ** (1 / k))
        noise = z * math.sqrt((1 + self.perf.cv2) / n)
        return 1 + math.sqrt(max(0.0, (rise - 1) ** 2 - noise ** 2))

    @staticmethod
    def _metric(role: str) -> str:
        return "p90 TTFT" if role == "prefill" else "p90 TPOT"

    def _demand(self, role: str, snap: PoolSnapshot):
        """(demand, replicas-needed function of a demand or None without a model, inputs).

        prefill: demand in erlangs (arrivals/s x the calibrated service of the mean prompt), sized as one
        M/G/c queue (plus a catch-up load for its backlog, ``_catch_up``); decode: output
        tokens/s (plus the queued sequences' tokens over a start-up time), over the tokens/s one replica
        generates at the SLO. Both scaled by the capacity factor learned online. The mean prompt and
        output are ``self.sizes``, which ``decide`` keeps from the last window with arrivals."""
        rs, st, lim = snap.role(role), self.state[role], self.limits[role]
        pre, dec = snap.prefill, snap.decode
        prompt, output = self.sizes["prompt"], self.sizes["output"]
        phi = st.correction * self.headroom
        if self.perf is None:
            # no model: the throughput each ready replica carries now, scaled by the latency headroom
            load = rs.arrivals_per_s if role == "prefill" else rs.output_tokens_per_s
            lat = rs.latency
            if rs.ready > 0 and measured(lat) and lat > 0 and load > 0:
                per = load / rs.ready * min(2.0, lim.target / lat)
                return load, (lambda x: max(1, math.ceil(x / (per * self.headroom) - 1e-9))), \
                    {"unit": "requests/s" if role == "prefill" else "tokens/s", "per_replica": round(per, 4)}
            return load, None, {}
        if role == "prefill":
            s = self.perf.remote_prefill_seconds(max(prompt, 1.0))
            demand = rs.arrivals_per_s * s
            most = lim.max * 4

            def need(x):
                return self.perf.prefill_replicas(x / phi, s, lim.target, most) if x > 0 else 0
            return demand, need, {"unit": "erlangs", "mean_prompt_tokens": round(prompt, 1), "service_s": round(s, 4)}
        ctx = prompt + output / 2
        most = lim.max * 4
        # a request holds its decode replica's place from arrival (the router's pick) to its first
        # token: the prefill's service, or the TTFT observed when a queue makes it longer, each counted
        # at a share (a held place shifts the balance to the other replicas; it does not fill a slot).
        # The observed p90 is of the last window; the queue now bounds it (:meth:`_queued_ttft`): after
        # a backlog had drained, the window's p90 still read its long waits (prompt-shift at seed 1:
        # 86-96 s with 0-5 prompts waiting), and decode's recommendation stayed at 63-64 for a pool of
        # 16, which the scale-down window then held
        service = self.perf.remote_prefill_seconds(max(prompt, 1.0))
        first = self.hold_service_share * service
        if measured(pre.latency):
            now = self._queued_ttft(pre, service) or service
            first = max(first, self.hold_ttft_share * min(pre.latency, now))
        hold = first / max(output, 1.0) if self.hold_first_token else 0.0

        backlog = rs.waiting * max(output, 1.0) / self.startup_s
        demand = rs.output_tokens_per_s + backlog
        slots, _ = self.perf.decode_slots(lim.target, ctx)
        inputs = {"unit": "tokens/s", "context_tokens": round(ctx, 1), "slots_per_replica": round(slots, 3),
                  "hold_s_per_token": round(hold, 4)}
        population = rs.running + rs.waiting
        if dec.arrivals_per_s <= 0 and population > 0 and demand > 0 and slots >= 1:
            # nothing arrived: the running sequences are a fixed population, not a stream. None of them
            # waits for a slot, so they need their whole slots at the headroom and no queueing margin,
            # and a sequence stays on the replica it started on, so a replica added now serves none of
            # them: the population can let a pool shrink, never grow it (a breach still grows it by
            # the latency rule). Sized as a stream (Erlang C on tokens/s x the step), the real-process
            # fleet test's trickle of two streams held 2 replicas of 10-15 slots each. A level or
            # forecast above the window's demand reads as proportionally more sequences
            per_token_s = population / demand
            whole, cur = int(slots), rs.replicas
            inputs["fixed_population"] = round(population, 2)

            def need_d(x):
                return min(cur, max(1, math.ceil(x * per_token_s / (whole * phi) - 1e-9))) if x > 0 else 0
        else:
            def need_d(x):
                return self.perf.decode_replicas(x / phi, ctx, lim.target, most, hold) if x > 0 else 0
        return demand, need_d, inputs

    def _catch_up(self, role: str, rs: RoleSnapshot, demand: float, inputs: dict) -> float:
        """Prefill's extra load (erlangs) to drain, within ``catch_up_s`` of the new replicas being ready,
        the backlog that will have built by then: the work queued now plus what the ready replicas
        cannot serve (demand above one erlang each, in the calibration's erlangs: a replica serves as many
        as its learned capacity factor) for one start-up time (after Flink's autoscaler,
        which sizes for a catch-up duration). The router sends each prompt to the least-loaded worker, so
        new replicas share the backlog's waiting: it drains at (ready - demand) erlangs. Decode builds no
        queue (its sequences batch and slow down), so it has none."""
        if role != "prefill" or self.perf is None or demand <= 0:
            return 0.0
        s = inputs.get("service_s", 0.0)
        backlog = rs.waiting * s + max(0.0, demand - rs.ready * self.state[role].correction) * self.startup_s
        catch = backlog / self.catch_up_s
        if catch > 0:
            inputs["catch_up"] = round(catch, 3)
        return catch

    def _learn(self, role: str, snap: PoolSnapshot, planned: int, tight: int,
               service_s: Optional[float] = None, slots: Optional[float] = None) -> Optional[str]:
        """Correct the capacity factor from a steady window (replicas all ready, none draining, traffic
        flowing, a latency measured) in which the model's view can be checked: above the band while the
        model said the ready replicas suffice (``planned`` <= ready), capacity was overrated (-10%); well
        below the target (< 0.75) while the model said the count is tight (25% more load would need more
        replicas: ``tight`` > ready), it was underrated (+2% a tick; within ``probe_memory_s`` of an
        overload, not past the value that lowered it to, and never past :meth:`_probe_top`). The count
        follows a raise only at the scale-down window's pace, so while the window holds the count
        several raises go untested by a smaller pool. Every rule on the window alone that stopped
        prefill's probe sooner cost the H200 calibration, whose right factor is 2.0-2.3 where the CPU's
        is 1.2 (docs/autoscaler-issue25.md, "Prefill's factor is a different error on each
        calibration"); the calibration's measured factor is that rule's missing input. Low
        latency at low load says nothing about capacity, so it teaches nothing; nor does decode's p90 where
        a replica holds fewer than ``decode_probe_min_slots`` sequences at the SLO (``slots``: the
        model's, for decode; None for prefill), because it sits at the batch-1 step until the cliff.

        Returns ``"lowered"`` or ``"raised"`` when the window corrected the factor, else None (the fade of
        a lowered factor back towards 1 is not a correction; ``bench/decode_probe_evidence.py`` counts
        the probe's raises by it)."""
        rs, st, lim = snap.role(role), self.state[role], self.limits[role]
        lat = rs.latency
        known = measured(lat)
        above = known and lat / lim.target > 1 + lim.tolerance
        if st.correction < 1 and not above and st.corrected_at is not None and rs.window_s > 0:
            # A lowered factor is evidence of one overload (on a shared CPU, often the machine's and not
            # the replicas'); once the windows stop confirming it, it fades back to the calibration with
            # a half-life of one metrics window. Kept for good, it would hold replicas up long after the
            # overload, for a trickle that one replica serves (the flaw the guards exist for).
            fade = 0.5 ** (max(0.0, snap.at - st.corrected_at) / rs.window_s)
            st.correction = 1 - (1 - st.correction) * fade
        st.corrected_at = snap.at
        if (rs.signal != "ok" or rs.starting or rs.draining or rs.ready <= 0 or not known
                or rs.arrivals_per_s <= 0):
            return
        ratio = lat / lim.target
        if ratio > 1 + lim.tolerance and planned <= rs.ready:
            st.ceiling = (snap.at, st.correction)
            st.correction = max(0.3, st.correction * 0.9)
            return "lowered"
        if ratio < 0.75 and tight > rs.ready:
            if slots is not None and slots < self.decode_probe_min_slots:
                return   # decode's p90 sits at the batch-1 floor until its cliff: no margin to read
            if self.probe_guard > 0 and service_s and not self._one_fewer_holds(rs.ready, lat, service_s,
                                                                              self.probe_guard * lim.target):
                return   # the probe's next step would take away a replica the measured load still needs
            top = self._probe_top(role)
            if st.ceiling is not None and snap.at - st.ceiling[0] < self.probe_memory_s:
                # not past what the last overload lowered it to: probing past it again only repeats the miss
                top = min(top, max(st.correction, st.ceiling[1] * 0.9))
            if st.correction >= top:
                return None
            before, st.correction = st.correction, min(top, st.correction * 1.02)
            return "raised" if st.correction > before else None
        return None

    def _probe_top(self, role: str) -> float:
        """The most the capacity probe raises ``role``'s factor to: prefill's factor as the calibration
        measured it (``capacity.prefill_factor``, :attr:`PerfModel.prefill_factor`), else 3. The probe
        raises only while a window's p90 is well under the target, and the scale-down window then holds
        the count, so no raise is tested by a smaller pool until the load falls: on the CPU
        calibration's diurnal at seed 0 the factor climbed to 1.52 at a steady 7 replicas, where
        ``bench/capacity_by_size.py --role prefill`` measures 1.15-1.22, and the ramp after the trough
        broke TTFT. Capped at the measured 1.19, diurnal meets TTFT / TPOT in 100% / 98.3% of minutes
        on seed 0 (was 95.0% / 100%) at +3.3% GPU-hours, and on all 15 seeds measured (0-4, 15-24) the
        lower of its two attainments is as high or higher. On the H200 (derived) calibration (measured
        2.0-2.3) the probe stops below the cap and no decision changes (bench/RESULTS.md,
        "Thirty-fifth session: the probe's cap")."""
        factor = self.perf.prefill_factor if (role == "prefill" and self.perf is not None) else None
        return factor if factor is not None else 3.0

    def _one_fewer_holds(self, ready: int, p90: float, service_s: float, limit: float) -> bool:
        """Whether ``ready - 1`` prefill replicas would keep the p90 TTFT under ``limit`` (s) at the most
        load (erlangs) that the ``p90`` (s) measured at ``ready`` replicas allows: the model's M/G/c curve
        (:meth:`PerfModel.prefill_pool_p90`) anchored on what the pool measures, not on the calibrated
        speed, with the no-wait p90 one standard deviation of the service (``service_s``, s) above its
        mean (:data:`PROBE_SERVICE_TAIL`). False at one replica: there is nothing to probe for."""
        if ready <= 1:
            return False
        base = service_s * (1 + PROBE_SERVICE_TAIL * math.sqrt(self.perf.cv2))
        load = self.perf.prefill_pool_load(ready, p90, service_s, base)
        return self.perf.prefill_pool_p90(ready - 1, load, service_s, base) <= limit

    @staticmethod
    def _forecast(hist: deque, when: float, now_value: float, step_fit: float = 0.0) -> tuple[float, float]:
        """(level, forecast) of the demand, in the demand's unit: ``hist`` holds (time s, demand) samples
        of the recent window, ``when`` is the time (s) to forecast for, ``now_value`` the demand now
        (used while fewer than 4 samples are held). A least-squares line through the window gives the
        level now (the noise of one window averaged out) and, when its slope is significant (t > 2)
        and rising, the value at ``when``, capped at 1.25x the level (a trend, not a burst).

        A rise that is a level shift is not a trend: when two levels split at the best point of the
        window (at least two samples each) leave a squared error ``step_fit`` times smaller than the
        line's, or smaller still, nothing is extrapolated (one least-squares mean-shift test, the first
        split of binary segmentation; 0 turns it off). A line through a step keeps rising for a whole
        window after the step, and the forecast it gives held replicas that the scale-down window then
        kept.

        Nor is a line read further ahead than the span of samples it was fitted over (while the window
        fills: an autoscaler's first start-up time after it starts or restarts, or after a gap in the
        samples longer than the window): on the CPU step at seed 1, four samples over 45 s of steady
        load read as a rise and started a prefill and a decode replica that the scale-down window then
        held for five minutes.
        """
        n = len(hist)
        if n < 4:
            return now_value, now_value
        ts = [t for t, _ in hist]
        vs = [v for _, v in hist]
        mt, mv = sum(ts) / n, sum(vs) / n
        var = sum((t - mt) ** 2 for t in ts)
        if var <= 0:
            return now_value, now_value
        slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / var
        level = max(0.0, mv + slope * (ts[-1] - mt))
        sse_line = sum((v - (mv + slope * (t - mt))) ** 2 for t, v in zip(ts, vs))
        resid = sse_line / max(1, n - 2)
        se = math.sqrt(resid / var) if resid > 0 else 0.0
        if slope <= 0 or (se > 0 and slope / se < 2):
            return level, level
        if ts[-1] - ts[0] < when - ts[-1]:
            return level, level   # not read further ahead than the span it was fitted over
        if step_fit > 0 and step_fit * Autoscaler._two_levels_sse(vs) <= sse_line:
            return level, level
        return level, min(1.25 * max(level, 1e-9), level + slope * (when - ts[-1]))

    @staticmethod
    def _two_levels_sse(vs: list) -> float:
        """The least squared error (the values' unit squared) of the sequence ``vs`` split in two runs
        of at least two values each, each run at its mean; ``math.inf`` for fewer than 4 values (no
        such split)."""
        best = math.inf
        for k in range(2, len(vs) - 1):
            a, b = vs[:k], vs[k:]
            ma, mb = sum(a) / len(a), sum(b) / len(b)
            best = min(best, sum((v - ma) ** 2 for v in a) + sum((v - mb) ** 2 for v in b))
        return best

    # ------------------------------------------------------------------------------------------
    def _queued_ttft(self, pre: RoleSnapshot, service_s: Optional[float]) -> Optional[float]:
        """The TTFT (s) that prefill's queue at the workers (``pre``) gives the next prompt of
        ``service_s`` seconds: its own service plus the waiting prompts' service shared over the ready
        replicas. The queue drains at the learned
        capacity factor (as :meth:`_catch_up` counts it: batching moves more prompts per second), the
        next prompt's own service does not shrink. ``math.inf`` with prompts waiting and no replica
        ready; None with nothing queued, or without a calibrated service time (no calibration: the rule
        is then off)."""
        if not service_s or pre.waiting <= 0:
            return None
        if pre.ready <= 0:
            return math.inf
        return service_s * (1 + pre.waiting / (pre.ready * self.state["prefill"].correction))

    def _behave(self, role: str, cur: int, rec: int, at: float, rs: RoleSnapshot, wake: bool,
                queued_ttft: Optional[float] = None) -> tuple[int, Optional[str]]:
        """HPA's behavior: stabilization windows, step limits per period, then min and max. ``queued_ttft``
        (s, :meth:`_queued_ttft`): a queue that predicts a TTFT above the band is not calm."""
        lim, st = self.limits[role], self.state[role]
        lo = 0 if (self.scale_to_zero and lim.min == 0) else lim.min
        limited = None
        if rs.signal == "no_data":
            return max(cur, lim.min), ("minReplicas" if cur < lim.min else None)
        want = rec
        lat = rs.latency
        band = lim.target * (1 - lim.tolerance)
        # the p90 is of first tokens already out, over a window; the queue says what the next ones get:
        # 30 s after prompts grew 4x (prompt-shift, seed 1), 8 waiting on 3 replicas at a learned factor
        # of 1.04 predicted 15.1 s against an 11.5 s band while the window's p90 read 11.2 s, and
        # confirmation held the scale-up another 15 s
        calm = (measured(lat) and lat < band
                and (queued_ttft is None or queued_ttft < band))
        # bursts that recur within a scale-down window are load, not bursts: no confirmation, no cancelling
        memory = self.recurring_windows * lim.down_window
        recurring = self.recurring and any(r > cur for t, r in st.recs
                                           if at - memory <= t < at - max(self.confirm_s, 1.0))
        # an autoscaler that has not yet seen that span cannot tell whether what it started was for a
        # burst, so it keeps it (it still confirms a calm rise: a burst shorter than the start-up is
        # not chased, as a seasoned one would not)
        fresh = self.recurring and at - st.first_at < memory
        if want > cur:
            stab = stabilized(cur, want, st.recs, at, lim.up_window)
            if stab < want:
                want, limited = stab, "stabilization"
            if calm and not recurring and self.confirm_s > 0 and at - st.first_at >= self.confirm_s:
                seen = max(cur, min(r for t, r in st.recs if t >= at - self.confirm_s))
                if seen < want:
                    want, limited = seen, "confirmation"
            room = step_room(st.events, at, lim.up_period, lim.up_step, up=True)
            if wake and cur == 0:
                room = max(room, 1)
            if want > cur + room:
                want, limited = cur + room, "maxStep"
        elif want < cur:
            # a restarted autoscaler, or one rebuilt for a new spec generation (a GitOps sync), counts the
            # current count as recommended until its first decision: it does not drop a serving pool
            # before a whole window of its own has seen the load
            first = [(at, cur)] if at - st.first_at < lim.down_window else []
            stab = stabilized(cur, want, list(st.recs) + first, at, lim.down_window)
            if stab > want:
                want, limited = stab, "stabilization"
            room = step_room(st.events, at, lim.down_period, lim.down_step, up=False)
            if want < cur - room:
                want, limited = cur - room, "maxStep"
            # not on the evidence that started them: a window that overlaps the one behind the last
            # scale-up sees mostly the same requests, and reversing it then is noise (step's flapping)
            settled = all(t <= at - rs.window_s for t in st.ups)
            if (self.cancel_starting and calm and not recurring and not fresh and settled and rs.starting > 0
                    and role == "prefill"):
                keep = max(rec, rs.ready, lo)
                if want > keep:
                    want, limited = max(keep, cur - rs.starting), None
        if want < lo:
            want, limited = lo, "minReplicas"
        if want > lim.max:
            want, limited = lim.max, "maxReplicas"
        return want, limited

    def _pool_bounds(self, d: dict, snap: PoolSnapshot) -> Optional[str]:
        """Apply the ratio band and the GPU budget to both desired counts together; returns the priority
        sentence when the budget binds."""
        p, q = d["prefill"], d["decode"]
        lp, lq = self.limits["prefill"], self.limits["decode"]
        want_p, want_q = p.desired, q.desired
        priority = None
        if self.ratio is not None and want_p > 0 and want_q > 0:
            rmin, rmax = self.ratio
            if want_p < rmin * want_q:
                np_ = min(lp.max, math.ceil(rmin * want_q - 1e-9))
                if np_ != want_p:
                    p.reason += f"; raised to {np_} for the ratio band (>= {rmin:g} x decode)"
                    want_p, p.limited_by = np_, "ratio"
            elif want_p > rmax * want_q:
                nq = min(lq.max, math.ceil(want_p / rmax - 1e-9))
                if nq != want_q:
                    q.reason += f"; raised to {nq} for the ratio band (prefill <= {rmax:g} x decode)"
                    want_q, q.limited_by = nq, "ratio"
        if self.budget is not None:
            gp, gq = lp.gpus, lq.gpus
            if want_p * gp + want_q * gq > self.budget:
                # decode first (see module docs), prefill gets what is left, each at least its minimum
                min_p = 0 if (self.scale_to_zero and lp.min == 0) else lp.min
                nq = max(lq.min, min(want_q, (self.budget - min_p * gp) // gq))
                np_ = max(min_p, min(want_p, (self.budget - nq * gq) // gp))
                if self.ratio is not None and np_ > 0 and nq > 0 and np_ < self.ratio[0] * nq:
                    # keep the band where the budget allows: the fewest decode replicas the prefill count
                    # supports within it
                    nq = max(lq.min, min(nq, math.floor(np_ / self.ratio[0] + 1e-9)))
                    np_ = max(min_p, min(want_p, (self.budget - nq * gq) // gp))
                priority = (f"decode: the GPU budget ({self.budget}) cannot hold {want_p} prefill + {want_q} "
                            f"decode replicas; decode keeps {nq} (a TPOT shortfall slows every running "
                            f"sequence and nothing else can take it), prefill gets {np_} (its overflow can "
                            "be prefilled on decode replicas)")
                if np_ != want_p:
                    p.reason += f"; cut to {np_} by the GPU budget"
                    want_p, p.limited_by = np_, "gpuBudget"
                if nq != want_q:
                    q.reason += f"; cut to {nq} by the GPU budget"
                    want_q, q.limited_by = nq, "gpuBudget"
        p.desired, q.desired = want_p, want_q
        return priority

    def _absorb(self, snap: PoolSnapshot, d: dict) -> bool:
        """Whether the router should prefill on decode replicas until the next tick (TokenScale)."""
        pre, dec = snap.prefill, snap.decode
        lp, lq = self.limits["prefill"], self.limits["decode"]
        if pre.signal != "ok" or dec.signal != "ok" or dec.ready == 0:
            return False
        short = d["prefill"].recommended > pre.ready
        breaking = (measured(pre.latency) and pre.latency > lp.target) \
            or pre.waiting > pre.ready
        if not (short and breaking):
            return False
        band = lq.target * (1 - lq.tolerance)
        lat = dec.latency
        if not measured(lat) and dec.running > 0 and self.perf is not None:
            # no request finished in the window while sequences run (streams longer than the window, or
            # every one still awaiting its prefill): the calibrated step at the running batch stands in
            # for the p90, so that absorption stays gated where it cannot be measured
            lat = self.perf.decode_step_seconds(dec.running / dec.ready,
                                                self.sizes["prompt"] + self.sizes["output"] / 2)
        dec_ok = not measured(lat) or lat < band
        if self.perf is None:
            return dec_ok
        # a local prefill of the mean prompt stalls the decode batch it joins for its whole compute;
        # ``busy`` is the share of each decode replica's time the arriving prompts would take
        prompt = max(self.sizes["prompt"], 1.0)
        stall = self.perf.local_prefill_seconds(prompt)
        busy = pre.arrivals_per_s / dec.ready * stall
        if dec_ok and self.absorb_within_slack and pre.arrivals_per_s > 0 and dec.arrivals_per_s > 0 \
                and measured(lat):
            # absorb only when that stall fits in the running sequences' TPOT slack over their output,
            # and when the stalls of every prompt the router then sends to the decode replicas (all of
            # them, while absorbing: worker/router/policy.py) leave the decode steps the time to keep
            # the band
            dec_ok = stall <= (band - lat) * max(self.sizes["output"], 1.0) and busy < 1 \
                and lat / (1 - busy) <= band
        if not dec_ok and self.absorb_deep_backlog > 0:
            return self._deep_backlog(snap, prompt, stall, busy)
        return dec_ok

    def _deep_backlog(self, snap: PoolSnapshot, prompt: float, stall: float, busy: float) -> bool:
        """Whether to absorb past decode's slack (``absorb_deep_backlog``): prefill's queue predicts a
        TTFT over that many targets, and a prompt prefilled on a decode replica would still start
        sooner. Its wait there is the local prefills queued on each decode replica (decode's waiting
        sequences over its ready replicas, each a local prefill of the mean prompt: ``stall`` seconds)
        plus what one more tick of absorbing adds when the prompts arriving need more of the replicas'
        time than there is (``busy``, prompts/s per replica x ``stall``: the excess over 1, x the
        tick), plus its own local prefill. Absorption is decided again every tick, so one tick's growth
        is what this decision commits the decode replicas to. ``prompt``: the mean prompt (tokens)."""
        pre, dec = snap.prefill, snap.decode
        queued = self._queued_ttft(pre, self.perf.remote_prefill_seconds(prompt))
        if queued is None or queued <= self.absorb_deep_backlog * self.limits["prefill"].target:
            return False
        tick = snap.at - self.last.at if self.last is not None and snap.at > self.last.at else pre.window_s / 2
        local = dec.waiting / dec.ready * stall + max(0.0, busy - 1.0) * tick + stall
        return local < queued
