"""The decision function (operator/autoscaler/policy.py) on hand-made snapshots: no fleet, no clock.

Each test drives ``Autoscaler.decide`` with a sequence of snapshots on a made-up clock, as the simulator
and the operator do."""
import copy
import dataclasses
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.policy import Autoscaler
from tandem.operator.autoscaler.snapshot import PoolSnapshot, RoleSnapshot
from tandem.operator.simulate.tune import DEFAULT_CALIBRATION
from tandem.operator.spec import InferencePoolSpec
from tandem.worker.api.calibration import Calibration

ROOT = Path(__file__).resolve().parents[2]
# the policy's rules on their own: without the calibration's measured prefill factor, which caps the
# capacity probe (tested on its own, test_the_capacity_probe_stops_at_the_calibrations_measured_factor)
CAL = dataclasses.replace(Calibration.load(ROOT / "bench/calibrations/smollm2-cpu.yaml"), capacity={})
pytestmark = pytest.mark.timeout(60)

TTFT, TPOT = 3.0, 0.09


def spec(pre=None, dec=None, pool=None, behavior=None):
    beh = behavior or {"scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 4, "periodSeconds": 30},
                       "scaleDown": {"stabilizationWindowSeconds": 0, "maxStep": 4, "periodSeconds": 30}}
    a_p = {"enabled": True, "minReplicas": 1, "maxReplicas": 10, "target": {"metric": "ttft", "seconds": TTFT},
           "behavior": beh, **(pre or {})}
    a_d = {"enabled": True, "minReplicas": 1, "maxReplicas": 10, "target": {"metric": "tpot", "seconds": TPOT},
           "behavior": beh, **(dec or {})}
    return InferencePoolSpec.model_validate({
        "model": {"name": "m", "source": {"package": "p/f.gguf"}},
        "prefill": {"autoscaling": a_p}, "decode": {"autoscaling": a_d}, "autoscaling": pool or {}})


def role(name, ready, starting=0, signal="ok", arrivals=0.3, prompt=380, output=16, latency=None, waiting=0,
         running=None):
    lat = latency if latency is not None else (1.2 if name == "prefill" else 0.06)
    if signal != "ok":
        lat = None
    return RoleSnapshot(name, signal, 30.0, arrivals, arrivals * prompt, arrivals * output,
                        running if running is not None else arrivals * output * 0.06, waiting, 0.1,
                        lat, ready, starting)


def snap(at, p, d, **kw):
    return PoolSnapshot(at, p, d, **kw)


def steady(a, at, arrivals, pre_ready, dec_ready, pre_lat=None, dec_lat=None, **kw):
    return a.decide(snap(at, role("prefill", pre_ready, arrivals=arrivals, latency=pre_lat),
                         role("decode", dec_ready, arrivals=arrivals, latency=dec_lat), **kw))


def test_step_up_then_down():
    a = Autoscaler(spec(), CAL)
    low = steady(a, 0, 0.05, 2, 2)
    assert low.prefill.desired <= 2 and low.decode.desired <= 2
    # five times the load, latency over target: both grow, at once and by more than one
    high = steady(a, 15, 0.5, 2, 2, pre_lat=2 * TTFT, dec_lat=2 * TPOT)
    assert high.prefill.desired >= 4 and high.decode.desired >= 4, high
    assert "above target" in high.prefill.reason
    assert high.prefill.inputs["ratio"] == pytest.approx(2.0)
    # back to low load, latency well under target: down (the 0 s window of this spec)
    p, d = high.prefill.desired, high.decode.desired
    down = steady(a, 300, 0.05, p, d, pre_lat=1.0, dec_lat=0.06)
    assert down.prefill.desired < p and down.decode.desired < d


def test_noise_inside_band_holds():
    a = Autoscaler(spec(), CAL)
    for i, f in enumerate([1.0, 0.95, 1.08, 0.92, 1.05, 0.99]):
        # latency wobbling within +-10% of target, demand that the current count can carry
        d = steady(a, 15 * i, 0.1, 4, 4, pre_lat=TTFT * f, dec_lat=TPOT * f)
        assert d.prefill.desired == 4 and d.decode.desired == 4, (f, d.prefill.reason, d.decode.reason)
        assert "tolerance band" in d.prefill.reason


def test_idle_reaches_min_and_no_data_holds():
    a = Autoscaler(spec(pre={"minReplicas": 2}), CAL)
    idle = a.decide(snap(0, role("prefill", 5, signal="idle", arrivals=0), role("decode", 5, signal="idle",
                                                                                  arrivals=0)))
    assert idle.prefill.signal == "idle" and idle.decode.signal == "idle"
    assert idle.prefill.desired == 2 and idle.decode.desired == 1
    assert "idle" in idle.prefill.reason
    b = Autoscaler(spec(pre={"minReplicas": 2}), CAL)
    nod = b.decide(snap(0, role("prefill", 5, signal="no_data"), role("decode", 5, signal="no_data")))
    assert nod.prefill.signal == "no_data" and nod.prefill.desired == 5 and nod.decode.desired == 5
    assert "no data" in nod.decode.reason
    # no data below min: brought up to min, never lower
    low = b.decide(snap(30, role("prefill", 1, signal="no_data"), role("decode", 0, signal="no_data")))
    assert low.prefill.desired == 2 and low.decode.desired == 1


def test_min_and_max_bound():
    a = Autoscaler(spec(pre={"maxReplicas": 3}, dec={"maxReplicas": 3}), CAL)
    d = steady(a, 0, 5.0, 2, 2, pre_lat=5 * TTFT, dec_lat=5 * TPOT)
    assert d.prefill.desired == 3 and d.prefill.limited_by == "maxReplicas"
    assert d.prefill.recommended > 3
    b = Autoscaler(spec(pre={"minReplicas": 3}), CAL)
    d = steady(b, 0, 0.01, 4, 4, pre_lat=0.5, dec_lat=0.06)
    assert d.prefill.desired == 3 and d.prefill.limited_by == "minReplicas"


def test_ratio_band_and_budget():
    # the ratio band raises the smaller role
    a = Autoscaler(spec(pool={"ratio": {"min": 0.5, "max": 2.0}}), CAL)
    d = a.decide(snap(0, role("prefill", 1, arrivals=0.05, latency=1.0),
                      role("decode", 6, arrivals=0.05, latency=2 * TPOT)))
    assert d.decode.desired >= 8
    assert d.prefill.desired * 2 >= d.decode.desired and d.prefill.limited_by == "ratio"
    # the budget binds: decode keeps its count, prefill gets the rest, and the decision says why
    b = Autoscaler(spec(pool={"gpuBudget": 8, "ratio": {"min": 0.25, "max": 4.0}}), CAL)
    d = steady(b, 0, 3.0, 3, 3, pre_lat=3 * TTFT, dec_lat=3 * TPOT)
    assert d.prefill.desired + d.decode.desired <= 8
    assert d.decode.desired >= d.prefill.desired
    assert d.priority and d.priority.startswith("decode")
    assert "gpuBudget" in (d.prefill.limited_by, d.decode.limited_by)
    assert d.prefill.desired >= 0.25 * d.decode.desired


def test_starting_replicas_count():
    a = Autoscaler(spec(), CAL)
    # 2 ready at twice the target, 3 more already starting: the proportional need (4) is on the way
    d = a.decide(snap(0, role("prefill", 2, starting=3, arrivals=0.1, latency=2 * TTFT),
                      role("decode", 2, starting=3, arrivals=0.1, latency=2 * TPOT)))
    assert d.prefill.current == 5
    assert d.prefill.desired <= 5 and d.decode.desired <= 5, (d.prefill.reason, d.decode.reason)
    # the same latency without replicas on the way does scale up
    b = Autoscaler(spec(), CAL)
    e = b.decide(snap(0, role("prefill", 2, arrivals=0.1, latency=2 * TTFT),
                      role("decode", 2, arrivals=0.1, latency=2 * TPOT)))
    assert e.prefill.desired >= 4 and e.decode.desired >= 4


def test_scale_to_zero_and_wake():
    s = spec(pre={"minReplicas": 0}, dec={"minReplicas": 0}, pool={"scaleToZero": True})
    a = Autoscaler(s, CAL)
    d = a.decide(snap(0, role("prefill", 2, signal="idle", arrivals=0), role("decode", 2, signal="idle",
                                                                               arrivals=0)))
    assert d.prefill.desired == 0 and d.decode.desired == 0
    # no request queued: stays at zero
    d = a.decide(snap(60, role("prefill", 0, signal="idle", arrivals=0), role("decode", 0, signal="idle",
                                                                                arrivals=0)))
    assert d.prefill.desired == 0 and d.decode.desired == 0
    # requests queued at the router with no replica: both roles wake together
    d = a.decide(snap(90, role("prefill", 0, signal="idle", arrivals=0), role("decode", 0, signal="idle",
                                                                                arrivals=0), router_queued=3))
    assert d.prefill.desired >= 1 and d.decode.desired >= 1
    assert "woken" in d.prefill.reason and "woken" in d.decode.reason
    # without scaleToZero, idle stops at min 1
    b = Autoscaler(spec(), CAL)
    d = b.decide(snap(0, role("prefill", 2, signal="idle", arrivals=0), role("decode", 2, signal="idle",
                                                                               arrivals=0)))
    assert d.prefill.desired == 1 and d.decode.desired == 1


def test_partial_behavior_keeps_defaults():
    s = spec(behavior={"scaleDown": {"maxStep": 3}})
    a = Autoscaler(s, CAL)
    lim = a.limits["prefill"]
    assert (lim.down_step, lim.down_window, lim.down_period) == (3, 300, 60)
    assert (lim.up_step, lim.up_window, lim.up_period) == (2, 0, 30)
    # the default up step (2 per 30 s) binds a big scale-up; the 300 s down window holds a scale-down
    d = steady(a, 0, 3.0, 1, 1, pre_lat=4 * TTFT, dec_lat=4 * TPOT)
    assert d.prefill.desired == 3 and d.prefill.limited_by == "maxStep"
    d = steady(a, 10, 3.0, 3, 3, pre_lat=4 * TTFT, dec_lat=4 * TPOT)
    assert d.prefill.desired == 3 and d.prefill.limited_by == "maxStep"   # same period
    d = steady(a, 45, 3.0, 3, 3, pre_lat=4 * TTFT, dec_lat=4 * TPOT)
    assert d.prefill.desired == 5
    d = steady(a, 60, 0.01, 5, 5, pre_lat=0.5, dec_lat=0.06)
    assert d.prefill.desired == 5 and d.prefill.limited_by == "stabilization"


def test_rollout_guard_and_advisory():
    a = Autoscaler(spec(pool={"mode": "advisory"}), CAL)
    d = steady(a, 0, 2.0, 2, 2, pre_lat=3 * TTFT, dec_lat=3 * TPOT, rolling_out=True)
    assert d.prefill.desired == 2 and d.prefill.limited_by == "rollout" and d.prefill.recommended > 2
    assert d.advisory
    d = steady(a, 15, 2.0, 2, 2, pre_lat=3 * TTFT, dec_lat=3 * TPOT)
    assert d.prefill.desired > 2


def test_forecast_leads_a_ramp():
    a = Autoscaler(spec(), CAL)
    needs = []
    for i in range(12):
        d = steady(a, 15 * i, 0.1 + 0.05 * i, 3, 3, pre_lat=TTFT * 0.5, dec_lat=TPOT * 0.8)
        needs.append(d.prefill.inputs["forecast"] / d.prefill.inputs["demand"])
    assert needs[-1] > 1.2   # a start-up time ahead of a rising ramp


def test_a_level_shift_is_not_extrapolated_as_a_trend():
    """A step in demand over the forecast window is a new level, not a rise that goes on (``step_fit``,
    a change-point test): the forecast stays at the level, where the line through the step would plan
    for 25% more. The ramp above, and the same step with the test off, still lead."""
    def last(a, rates):
        for i, x in enumerate(rates):
            d = steady(a, 15 * i, x, 3, 3, pre_lat=TTFT * 0.5, dec_lat=TPOT * 0.8)
        return d.prefill.inputs
    step = [0.2] * 7 + [0.6] * 5
    off = last(Autoscaler(spec(), CAL, step_fit=0), step)
    assert off["forecast"] > 1.2 * off["level"]   # the line through the step keeps rising
    on = last(Autoscaler(spec(), CAL), step)
    assert on["forecast"] == on["level"] == off["level"]
    ramp = last(Autoscaler(spec(), CAL), [0.1 + 0.05 * i for i in range(12)])
    assert ramp["forecast"] > 1.2 * ramp["level"]


def test_a_trend_is_not_read_further_ahead_than_its_window_spans():
    """An autoscaler that has just started holds a few samples: a line through four of them (45 s) is not
    read a start-up (120 s) ahead, however steep; once the samples span the start-up, the same ramp leads."""
    def last(n):
        a = Autoscaler(spec(), CAL)
        for i in range(n):
            d = steady(a, 15 * i, 0.1 + 0.05 * i, 3, 3, pre_lat=TTFT * 0.5, dec_lat=TPOT * 0.8)
        return d.prefill.inputs
    early = last(4)
    assert early["forecast"] == early["level"]
    later = last(9)   # 120 s of samples
    assert later["forecast"] > 1.2 * later["level"]


def test_absorb_bursts_when_prefill_breaks():
    """Prefill is breaking its target and decode has TPOT slack over its outputs for the stall a local
    prefill causes: absorb. With the same slack per token over 4-token outputs the stall does not fit
    (issue 25: 5k-token prefills stalled decode batches on the Azure trace)."""
    stall = PerfModel.of(CAL).local_prefill_seconds(380)
    a = Autoscaler(spec(), CAL)
    d = a.decide(snap(0, role("prefill", 2, arrivals=1.5, latency=2 * TTFT, waiting=4),
                      role("decode", 6, arrivals=1.5, latency=0.5 * TPOT, output=64)))
    assert 0.4 * TPOT * 64 > stall and d.absorb_bursts
    a = Autoscaler(spec(), CAL)
    d = a.decide(snap(0, role("prefill", 2, arrivals=1.5, latency=2 * TTFT, waiting=4),
                      role("decode", 6, arrivals=1.5, latency=0.5 * TPOT, output=4)))
    assert 0.4 * TPOT * 4 < stall and not d.absorb_bursts
    b = Autoscaler(spec(), CAL)
    d = b.decide(snap(0, role("prefill", 2, arrivals=1.5, latency=2 * TTFT, waiting=4),
                      role("decode", 2, arrivals=1.5, latency=2 * TPOT)))
    assert not d.absorb_bursts   # decode has no headroom


def test_absorb_bursts_only_while_every_arriving_prompt_s_stall_leaves_decode_its_band():
    """While absorbing, the router prefills every arriving prompt on a decode replica, so each replica
    spends u = prompts/s / decode replicas x the stall of its time prefilling, and its p90 TPOT becomes
    about p90 / (1 - u). One stall fitting a sequence's slack is not enough (issue 25: on the H200
    output-shift, 150 prompts/s on 6 decode replicas, u = 0.59, took p90 TPOT from 0.011 s to 0.043 s
    for four minutes). 1.5 prompts/s of 380 tokens over 64-token outputs at 0.5x the TPOT target: one
    stall fits the slack either way; on 6 decode replicas u = 0.40 keeps the band, on 4 u = 0.60 does
    not."""
    stall = PerfModel.of(CAL).local_prefill_seconds(380)
    band = 0.9 * TPOT

    def absorbs(dec_ready):
        a = Autoscaler(spec(), CAL)
        return a.decide(snap(0, role("prefill", 2, arrivals=1.5, latency=2 * TTFT, waiting=4),
                             role("decode", dec_ready, arrivals=1.5, latency=0.5 * TPOT, output=64))).absorb_bursts
    assert stall <= (band - 0.5 * TPOT) * 64                        # one stall fits the slack
    assert 0.5 * TPOT / (1 - 1.5 / 6 * stall) <= band and absorbs(6)
    assert 0.5 * TPOT / (1 - 1.5 / 4 * stall) > band and not absorbs(4)


def test_absorb_past_decode_s_slack_through_a_deep_backlog():
    """Behind a deep prefill backlog (the queue predicts a TTFT over ``absorb_deep_backlog`` = 2 targets)
    the router absorbs even with decode over its band, as long as a prompt prefilled on a decode
    replica would start sooner than in the queue it bypasses: the local prefills queued per decode
    replica, plus one more tick's excess when the arriving prompts need more than the replicas' time,
    plus its own. Issue 25: on the CPU calibration's prompt-shift decode's p90 TPOT sat at 1.2-1.4x its
    target after the shift, the slack rule refused, and prompts waited up to about 100 s; without the
    local-queue test the H200 calibration's step gave the decode replicas 7 times the prefill work they
    can do."""
    perf = PerfModel.of(CAL)
    service, stall = perf.remote_prefill_seconds(380), perf.local_prefill_seconds(380)
    waiting = math.ceil(2 * (4 * TTFT / service - 1))        # the queue predicts about 4 targets

    def decide(arrivals, dec_ready, dec_waiting=0, pre_waiting=waiting, **knobs):
        """(absorb, the TTFT the policy's queue predicted, at the capacity factor it learned)."""
        a = Autoscaler(spec(), CAL, **knobs)
        pre = role("prefill", 2, arrivals=arrivals, latency=2 * TTFT, waiting=pre_waiting)
        d = a.decide(snap(0, pre, role("decode", dec_ready, arrivals=arrivals, latency=1.3 * TPOT,
                                       waiting=dec_waiting)))
        return d.absorb_bursts, a._queued_ttft(pre, service)
    calm = 0.5 / stall                                       # decode replicas busy half their time
    absorbed, queued = decide(calm, 1)
    assert queued > 2 * TTFT and absorbed
    assert not decide(calm, 1, absorb_deep_backlog=0)[0]     # the slack rule alone refuses (decode over its band)
    assert not decide(calm, 1, pre_waiting=1)[0]             # a shallow queue, under 2 targets
    # the local queue: k prefills queued on the one decode replica still start a prompt sooner, k + 1 not
    k = math.ceil(queued / stall) - 2
    assert (k + 1) * stall < queued <= (k + 2) * stall
    assert decide(calm, 1, dec_waiting=k)[0] and not decide(calm, 1, dec_waiting=k + 1)[0]
    assert decide(calm, 2, dec_waiting=k + 1)[0]            # the same queue over two replicas is half as long
    # 7 times the prefill work the decode replica can do: one more tick (half the 30 s window on a first
    # decision) of it outgrows the queue; 1.3 times does not
    assert 6 * 15 + stall > queued and not decide(7 / stall, 1)[0]
    assert 0.3 * 15 + stall < queued and decide(1.3 / stall, 1)[0]


def test_absorption_with_no_tpot_in_the_window_is_gated_by_the_calibrated_step():
    """No request finished in decode's window (streams longer than it, or all of them still awaiting
    their prefill: the real-process deep-backlog test met it in a clean-clone run), so decode's p90 TPOT
    is unknown. With sequences running, the calibrated step at their batch stands in for it, and the
    slack rule applies as to a measured p90. Before, an unknown p90 let the router absorb whatever the
    decode replicas were running."""
    perf = PerfModel.of(CAL)
    band = 0.9 * TPOT
    ctx = 32 + 16 / 2
    stall = perf.local_prefill_seconds(32)
    # one sequence a replica leaves the slack a local prefill needs; six are over the band
    assert stall <= (band - perf.decode_step_seconds(1, ctx)) * 16 and perf.decode_step_seconds(6, ctx) > band

    def absorbs(running):
        a = Autoscaler(spec(), CAL)
        pre = role("prefill", 2, arrivals=1.0, prompt=32, latency=2 * TTFT, waiting=1)
        d = a.decide(snap(0, pre, role("decode", 2, arrivals=1.0, prompt=32, latency=math.nan, running=running)))
        return d.absorb_bursts
    assert absorbs(0) and absorbs(2)
    assert not absorbs(12)


def test_without_calibration():
    a = Autoscaler(spec())
    d = steady(a, 0, 1.0, 2, 2, pre_lat=2 * TTFT, dec_lat=2 * TPOT)
    assert 4 <= d.prefill.desired <= 5 and 4 <= d.decode.desired <= 5   # observed/target, with headroom
    d = steady(a, 30, 1.0, 4, 4, pre_lat=0.5 * TTFT, dec_lat=0.5 * TPOT)
    assert d.prefill.desired < 4


def test_policy_imports_no_kopf():
    code = ("import sys; import tandem.operator.autoscaler.policy; import tandem.operator.simulate; "
            "assert 'kopf' not in sys.modules, 'kopf imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONSAFEPATH": "1"})
    assert r.returncode == 0, r.stderr


def test_perf_model_agrees_with_the_calibration():
    """PerfModel's plain-float formulas give the calibration's own predictions; the pool sizes grow with
    load and a replica's decode slots follow the target."""
    from tandem.operator.autoscaler.capacity import PerfModel, erlang_c
    perf = PerfModel.of(CAL)
    for n in (1, 64, 256, 1000):
        assert perf.local_prefill_seconds(n) == pytest.approx(CAL.prefill_seconds(n), rel=1e-9)
        kv = CAL.kv_transfer_seconds(n * perf.kv_bytes_per_token)
        assert perf.remote_prefill_seconds(n) == pytest.approx(max(CAL.prefill_seconds(n), kv), rel=1e-9)
    for b, c in ((1, 100), (2, 300), (7, 50)):
        assert perf.decode_step_seconds(b, c) == pytest.approx(CAL.decode_step_seconds(b, c), rel=1e-9)
    assert erlang_c(1, 0.5) == pytest.approx(0.5) and erlang_c(2, 1.0) == pytest.approx(1 / 3)
    s = perf.remote_prefill_seconds(256)
    sizes = [perf.prefill_replicas(a, s, 3 * s) for a in (0.5, 2, 5, 10)]
    assert sizes == sorted(sizes) and sizes[-1] > 10
    # the shipped CPU calibration (one thread per worker): a batch-2 step is ~1.4x a batch-1 step, so a
    # replica holds 2-5 sequences at a 1.5x TPOT target (the scenarios' older one held 1: batch 2 missed)
    assert 2 < perf.decode_slots(1.5 * perf.decode_step_seconds(1, 300), 300)[0] < 5
    old = PerfModel.of(Calibration.load(DEFAULT_CALIBRATION))
    assert old.decode_slots(1.5 * old.decode_step_seconds(1, 300), 300)[0] < 2
    assert perf.decode_slots(10.0, 300)[0] > 8


def test_a_fresh_policy_holds_the_count_for_a_whole_down_window():
    """A restarted autoscaler, or the one the operator builds for a new spec generation (a GitOps sync),
    must not drop a serving pool on its second tick: its window has not seen a whole window of load yet."""
    beh = {"scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 1, "periodSeconds": 30},
           "scaleDown": {"stabilizationWindowSeconds": 20, "maxStep": 1, "periodSeconds": 20}}
    a = Autoscaler(spec(behavior=beh), CAL)

    def idle(at):
        return a.decide(snap(at, role("prefill", 1, signal="idle", arrivals=0),
                             role("decode", 2, signal="idle", arrivals=0)))
    for at in (0, 2, 4, 10, 19):
        assert idle(at).decode.desired == 2, at          # held through the first 20 s
    assert idle(21).decode.desired == 1                  # then the idle pool goes down, one step


def test_a_capacity_factor_learned_in_an_overload_fades_once_windows_stop_confirming_it():
    """Over target while the model says the ready replicas suffice: the factor drops (capacity was
    overrated). Afterwards, with no breach, it fades back toward 1 with a half-life of one metrics window
    (30 s here), so a trickle later is sized on the calibration again; a factor above 1 is left alone."""
    a = Autoscaler(spec(), CAL)
    for i in range(6):                       # 6 ticks over target at a load 2 replicas carry by the model
        steady(a, 5 * i, 0.05, 2, 2, dec_lat=2 * TPOT)
    low = a.state["decode"].correction
    assert low < 0.6, low
    steady(a, 25 + 30, 0.05, 2, 2, dec_lat=0.5 * TPOT)           # one window later: half the gap left
    assert a.state["decode"].correction == pytest.approx(1 - (1 - low) / 2, rel=1e-6)
    steady(a, 25 + 120, 0.05, 2, 2, dec_lat=0.5 * TPOT)
    assert a.state["decode"].correction > 0.95
    steady(a, 25 + 125, 0.05, 2, 2, dec_lat=2 * TPOT)             # a breach: the fade stops, it drops again
    assert a.state["decode"].correction < 0.9
    a.state["decode"].correction = 1.5
    steady(a, 25 + 400, 0.05, 2, 2, dec_lat=0.5 * TPOT)
    assert a.state["decode"].correction == 1.5


def test_a_burst_under_the_slo_is_confirmed_before_scaling_and_its_unneeded_starts_are_cancelled():
    """Issue 25 (bursts cost 1.71x the oracle): while latency is below the band, a scale-up must be called
    for over ``confirm_s`` (90 s), and prefill replicas still starting that the recommendation no longer
    needs are cancelled at once. Latency above the band still scales up at the first tick. (The policy has
    seen a whole down window of steady load first: a fresh one takes every rise as load, see below; and
    half an hour of it, so that the burst is an isolated one: bursts that recur keep their room, see
    ``burst_quantile``.)"""
    calm_pre, calm_dec = 0.4 * TTFT, 0.7 * TPOT
    slow_down = {"scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 4, "periodSeconds": 30},
                 "scaleDown": {"stabilizationWindowSeconds": 300, "maxStep": 1, "periodSeconds": 60}}
    # at 0.9 of the modelled capacity the steady load's prefill level needs 2 replicas, so the back-off
    # below has starting replicas to cancel (at the default 0.8 the level alone keeps 4)
    a = Autoscaler(spec(behavior=slow_down), CAL, headroom=0.9)
    # decode at the count the model sizes the steady load at (with every request's prefill holding a
    # place: PerfModel.decode_replicas), so that only the burst would call for more
    dec = steady(Autoscaler(spec(), CAL, headroom=0.9), 0, 0.3, 2, 2, pre_lat=calm_pre, dec_lat=calm_dec).decode.recommended
    w = 1830   # half an hour (burst_lookback_s) of steady load seen
    for t in range(0, w, 15):
        steady(a, t, 0.3, 2, dec, pre_lat=calm_pre, dec_lat=calm_dec)
    # a 30 s burst of 4x the requests, latency still under the band: nothing starts
    for t in (w, w + 15):
        burst = steady(a, t, 1.2, 2, dec, pre_lat=calm_pre, dec_lat=calm_dec)
        assert burst.prefill.desired == 2 and burst.prefill.limited_by == "confirmation", burst.prefill
        assert burst.decode.desired == dec and burst.decode.recommended > dec, burst.decode
    # the same load held past 90 s is a step, not a burst: it scales up
    pre_up, dec_up = [], []   # the counts fed back stay put, so the step limit holds later ticks back
    for t in range(w + 30, w + 120, 15):
        held = steady(a, t, 1.2, 2, dec, pre_lat=calm_pre, dec_lat=calm_dec)
        pre_up.append(held.prefill.desired)
        dec_up.append(held.decode.desired)
    assert max(pre_up) > 2 and max(dec_up) > dec, (pre_up, dec_up)
    # the load is gone before the new prefill replicas are ready: the starting ones it no longer needs
    # are cancelled, though the 300 s down window and 1 replica per 60 s would hold them; not on a
    # window that overlaps the last scale-up's (30 s here: that would be reversing a decision on the
    # evidence that made it, the step scenario's flapping), then at once
    up = max(pre_up)

    def back_at(t):
        return a.decide(snap(t, role("prefill", 2, starting=up - 2, arrivals=0.3, latency=calm_pre),
                             role("decode", dec, arrivals=0.3, latency=calm_dec)))
    early = back_at(w + 120)            # 15 s after the last scale-up (w + 105)
    assert early.prefill.desired == up, early.prefill
    queued = copy.deepcopy(a)
    back = back_at(w + 135)
    assert back.prefill.desired == max(2, back.prefill.recommended) < up, back.prefill
    # the same tick with a queue at the workers that predicts a TTFT above the band: not calm, so the
    # starting replicas stay (the p90, of first tokens already out, still reads calm)
    kept = queued.decide(snap(w + 135, role("prefill", 2, starting=up - 2, arrivals=0.3, latency=calm_pre,
                                            waiting=12),
                              role("decode", dec, arrivals=0.3, latency=calm_dec)))
    assert kept.prefill.recommended < up and kept.prefill.desired == up, kept.prefill
    # latency above the band scales up at once, with no confirmation
    b = Autoscaler(spec(), CAL)
    for t in range(0, w, 15):
        steady(b, t, 0.3, 2, 2, pre_lat=calm_pre, dec_lat=calm_dec)
    hot = steady(b, w, 1.2, 2, 2, pre_lat=2 * TTFT, dec_lat=2 * TPOT)
    assert hot.prefill.desired > 2 and hot.decode.desired > 2, (hot.prefill, hot.decode)


def test_a_fresh_policy_keeps_what_it_started_until_it_has_seen_a_down_window():
    """Issue 25, the Azure trace's start: a policy that has not yet seen a whole scale-down window cannot
    tell whether the replicas it started were for an isolated burst or for load that comes back, so it
    does not cancel them when latency calms; after a window of its own it does."""
    calm_pre, calm_dec = 0.4 * TTFT, 0.7 * TPOT
    slow_down = {"scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 4, "periodSeconds": 30},
                 "scaleDown": {"stabilizationWindowSeconds": 300, "maxStep": 1, "periodSeconds": 60}}

    def rise_then_calm(start):
        a = Autoscaler(spec(behavior=slow_down), CAL, headroom=0.9)
        for t in range(0, start, 15):
            steady(a, t, 0.3, 2, 2, pre_lat=calm_pre, dec_lat=calm_dec)
        hot = steady(a, start, 1.2, 2, 2, pre_lat=2 * TTFT, dec_lat=calm_dec)   # above the band: up at once
        assert hot.prefill.desired > 2, hot.prefill
        up = hot.prefill.desired
        # a metrics window later the load is back and latency calm; the new replicas are still starting
        return up, a.decide(snap(start + 45, role("prefill", 2, starting=up - 2, arrivals=0.3, latency=calm_pre),
                                 role("decode", 2, arrivals=0.3, latency=calm_dec)))
    up, fresh = rise_then_calm(60)
    assert fresh.prefill.desired == up, fresh.prefill          # kept: held by the down window
    up, seasoned = rise_then_calm(330)
    assert seasoned.prefill.desired < up, seasoned.prefill     # cancelled


def test_a_queue_that_predicts_a_ttft_over_the_band_is_not_calm():
    """Prefill's p90 is of first tokens already out; the prompts waiting at the workers say what the next
    ones get. A rise whose window p90 still reads calm but whose queue predicts a TTFT above the band is
    not confirmed first: it scales up at once. A short queue is still confirmed (issue 25, prompt-shift:
    the prompts grew 4x, and the queue built for 30 s before the p90 showed it)."""
    calm_pre, calm_dec = 0.4 * TTFT, 0.7 * TPOT

    def rise(waiting):
        a = Autoscaler(spec(), CAL)
        for t in range(0, 1830, 15):
            steady(a, t, 0.3, 2, 2, pre_lat=calm_pre, dec_lat=calm_dec)
        return a.decide(snap(1830, role("prefill", 2, arrivals=1.2, latency=calm_pre, waiting=waiting),
                             role("decode", 2, arrivals=1.2, latency=calm_dec))).prefill
    service = PerfModel.of(CAL).remote_prefill_seconds(380)
    short, long_ = rise(1), rise(12)
    assert service * (1 + 1 / 2) < 0.9 * TTFT < service * (1 + 12 / 2)   # the two sides of the band
    assert short.desired == 2 and short.limited_by == "confirmation", short
    assert long_.desired > 2 and long_.limited_by != "confirmation", long_


def test_the_proportional_rule_scales_the_replicas_that_served_the_window():
    """HPA's rule multiplies a count by the window's latency ratio; the count is the replicas that
    produced that latency. Replicas that became ready within the window have not shown in it yet: with
    2 ready for a window and 6 ready now (4 just came up), a p90 TTFT at 2x the target asks for about
    2 x 2 more, not 6 x 2 (issue 25, the CPU step at seed 1: 14 then 17 asked of a pool that needed 10).
    A count that held through the window is scaled as before."""
    over = 2 * TTFT

    def breach(ready_before, ready_now):
        a = Autoscaler(spec(pre={"maxReplicas": 20}), CAL)
        for t in (0, 15):
            a.decide(snap(t, role("prefill", ready_before, starting=ready_now - ready_before, arrivals=0.1,
                                  latency=over), role("decode", 2, arrivals=0.1)))
        return a.decide(snap(30, role("prefill", ready_now, arrivals=0.1, latency=over),
                             role("decode", 2, arrivals=0.1))).prefill
    fresh, held = breach(2, 6), breach(6, 6)
    # the recommendation (the spec's maxStep of 4 then limits what is applied)
    assert held.recommended == 12, held                   # 6 x 2: the count served the whole window
    assert fresh.recommended == 7, fresh                  # ceil(10/3 x 2), where 6 x 2 would be 12
    assert fresh.inputs["served"] == pytest.approx(10 / 3, abs=0.01), fresh.inputs


def test_room_for_rises_counts_only_rises_beyond_the_counting_noise():
    """Prefill keeps room for the rises it has seen, minus what a steady Poisson stream's counting noise
    explains (``Autoscaler._beyond_noise``: at 1.2 prompts/s a 30 s window's demand deviates by 0.27 of
    its mean at the rises' quantile). Steady load whose windows wobble by less than that keeps no room
    beyond the headroom's (1 / 0.8); bursts of twice the load for a minute every 10 minutes still keep
    room beyond it (issue 25, the CPU prompt-shift: rises of 1.31-1.40 after the shift held a prefill
    replica more than the level needed). Before the rule the steady load's rises read up to 1.28."""
    def rises(arrivals_at):
        a = Autoscaler(spec(pre={"maxReplicas": 20}), CAL)
        out = []
        for t in range(0, 2400, 15):
            d = a.decide(snap(t, role("prefill", 4, arrivals=arrivals_at(t), latency=0.4 * TTFT),
                              role("decode", 4, arrivals=arrivals_at(t), latency=0.7 * TPOT)))
            out.append(d.prefill.inputs.get("rise", 1.0))
        return sorted(out[-40:])
    rng = random.Random(7)
    noisy = {t: 1.2 * max(0.5, rng.gauss(1.0, 0.15)) for t in range(0, 2400, 15)}
    steady = rises(lambda t: noisy[t])
    burst = rises(lambda t: 2.4 if t % 600 < 60 else 1.2)
    assert steady[-1] < 1.25, steady              # within the headroom: no room beyond it
    assert burst[len(burst) // 2] > 1.25, burst   # the bursts keep room beyond it


def test_confirmation_and_cancelling_off_restore_the_earlier_behavior():
    """With ``confirm_s=0`` and ``cancel_starting=False`` a calm burst starts replicas at once (the
    behavior the table of issue 25 measured before)."""
    a = Autoscaler(spec(), CAL, confirm_s=0, cancel_starting=False)
    for t in range(0, 120, 15):
        steady(a, t, 0.3, 2, 2, pre_lat=0.4 * TTFT, dec_lat=0.7 * TPOT)
    burst = steady(a, 120, 1.2, 2, 2, pre_lat=0.4 * TTFT, dec_lat=0.7 * TPOT)
    assert burst.prefill.desired > 2, burst.prefill


def test_a_decode_hold_weighs_one_slot_in_the_replicas_whole_slots():
    """Issue 25: a request held through its prefill moves the router's balance by one request, which
    fills a replica of one slot but only one of k slots on a replica of k: the hold counts at 1/k of its
    time. On the CPU scenarios' calibration (1 slot) a hold of one step per token is a doubled load; on
    the H200 one (~15 slots) it takes a hold of k steps per token to weigh that much."""
    root = Path(__file__).resolve().parents[2]
    for name, ctx in (("smollm2-cpu-scenarios.yaml", 300), ("llama3-8b-h200.yaml", 2000)):
        perf = PerfModel.of(Calibration.load(root / "bench/calibrations" / name))
        target = 1.5 * perf.decode_step_seconds(1, ctx)
        slots, step = perf.decode_slots(target, ctx)
        k = max(1, int(slots))
        assert (k == 1) == (name.startswith("smollm2")), (name, slots)
        for tokens in (50.0, 400.0, 3000.0):
            doubled = perf.decode_replicas(2 * tokens, ctx, target)
            assert perf.decode_replicas(tokens, ctx, target, hold_s_per_token=k * step) == doubled, (name, tokens)
            if k > 1 and tokens >= 400:   # one step's hold weighs 1/k of a step: short of doubling (whole: equal)
                assert perf.decode_replicas(tokens, ctx, target, hold_s_per_token=step) < doubled, (name, tokens)


def test_decode_wait_share_is_the_erlang_c_share_decode_replicas_keeps_under_a_tenth():
    """``PerfModel.decode_wait_share`` (the prediction bench/decode_probe_evidence.py checks the probe
    against) reads the queue ``decode_replicas`` sizes: at the count that method returns, at most 10% of
    requests find every slot taken; at one replica fewer, more do. On both calibrations, with and
    without a hold."""
    root = Path(__file__).resolve().parents[2]
    for name, ctx in (("smollm2-cpu-scenarios.yaml", 300), ("llama3-8b-h200.yaml", 2000)):
        perf = PerfModel.of(Calibration.load(root / "bench/calibrations" / name))
        target = 1.5 * perf.decode_step_seconds(1, ctx)
        for tokens in (50.0, 400.0, 3000.0):
            for hold in (0.0, perf.decode_step_seconds(1, ctx)):
                c = perf.decode_replicas(tokens, ctx, target, hold_s_per_token=hold)
                assert perf.decode_wait_share(c, tokens, ctx, target, hold) <= 0.1, (name, tokens, hold, c)
                if c > 1:
                    assert perf.decode_wait_share(c - 1, tokens, ctx, target, hold) > 0.1, (name, tokens, hold, c)
    perf = PerfModel.of(CAL)
    assert perf.decode_wait_share(0, 50.0, 300, 1.0) == 1.0
    assert perf.decode_wait_share(4, 50.0, 300, 0.5 * perf.decode_step_seconds(1, 300)) == 1.0   # batch 1 misses


def decode_beside_prefill(pre_lat, waiting, **kw):
    """Decode's decision at 2 requests/s on 4 + 4 replicas (decode calm at 0.8x its target), prefill at a
    p90 TTFT of ``pre_lat`` with ``waiting`` prompts queued; ``kw`` goes to the Autoscaler."""
    a = Autoscaler(spec(), CAL, **kw)
    return a.decide(snap(0, role("prefill", 4, arrivals=2.0, latency=pre_lat, waiting=waiting),
                         role("decode", 4, arrivals=2.0, latency=0.8 * TPOT))).decode


def test_decode_counts_a_held_place_at_a_share_of_its_prefill_service():
    """Fourteenth session: a request held through its prefill shifts the router's balance to the other
    decode replicas; it does not fill a slot for its whole time to first token. The hold is 0.4 of the
    calibrated prefill service (the old 1.0, with half the p90 TTFT under a queue, sized decode 2.5
    replicas over the reactive oracle on the diurnal scenario). Thirtieth session: a queue's wait no
    longer counts (``hold_ttft_share`` 0, was 0.25), since every replica's held places wait alike.
    Asserted on one decision: the recorded hold, the same with and without a queue, and a decode count
    between the sizing without a hold and the fourteenth session's, strictly below it under a queue (so
    the check fails on that share)."""
    queued = 2 * TTFT   # a prefill queue: p90 TTFT well past the calibrated service of 380 tokens

    def decode_of(pre_lat, **kw):
        # 40 prompts waiting on 4 prefill replicas: the queue predicts more than the p90, which counts
        return decode_beside_prefill(pre_lat, 40, **kw)

    service = PerfModel.of(CAL).remote_prefill_seconds(380)
    for pre_lat in (0.5 * service, queued):
        d = decode_of(pre_lat)
        assert d.inputs["hold_s_per_token"] == pytest.approx(0.4 * service / 16, abs=1e-4), (pre_lat, d.inputs)
    new, fourteenth = decode_of(queued).inputs["need"], decode_of(queued, hold_ttft_share=0.25).inputs["need"]
    old = decode_of(queued, hold_service_share=1.0, hold_ttft_share=0.5).inputs["need"]
    none = decode_of(queued, hold_first_token=False).inputs["need"]
    assert none <= new < fourteenth <= old, (none, new, fourteenth, old)


def test_a_drained_backlog_holds_no_decode_places_for_its_past_waits():
    """Where the queue's wait counts (``hold_ttft_share`` > 0): the p90 TTFT is of the last window; once
    prefill's queue has drained it still reads the backlog's long waits. The decode hold counts at most
    what the queue predicts now (Autoscaler._queued_ttft): with nothing waiting, the calibrated service
    share; with a queue, the p90 (twenty-third session: prompt-shift's drained backlog kept decode's
    recommendation at 63-64 for a pool of 16)."""
    service = PerfModel.of(CAL).remote_prefill_seconds(380)
    p90 = 10 * service
    drained = decode_beside_prefill(p90, 0, hold_ttft_share=0.25)
    backlog = decode_beside_prefill(p90, 60, hold_ttft_share=0.25)
    assert drained.inputs["hold_s_per_token"] == pytest.approx(0.4 * service / 16, abs=1e-4), drained.inputs
    assert backlog.inputs["hold_s_per_token"] == pytest.approx(0.25 * p90 / 16, abs=1e-4), backlog.inputs
    assert drained.inputs["need"] < backlog.inputs["need"], (drained.inputs, backlog.inputs)


def replay_ticks(loads, dec_lat=lambda t, x: 0.7 * TPOT, **kw) -> list:
    """The decisions of one policy over 15-s ticks, one per load (requests/s), from 2 + 2 replicas, each
    tick's desired counts ready at the next (replicas start at once here); prefill calm (0.4x its
    target), decode's p90 TPOT ``dec_lat(t, load)``. ``kw`` goes to :class:`Autoscaler`."""
    a = Autoscaler(spec(), CAL, **kw)
    pre = dec = 2
    out = []
    for i, x in enumerate(loads):
        d = steady(a, 15 * i, x, pre, dec, pre_lat=0.4 * TTFT, dec_lat=dec_lat(15 * i, x))
        pre, dec = d.prefill.desired, d.decode.desired
        out.append(d)
    return out


def test_prefill_keeps_room_for_the_rises_it_has_seen_and_steady_load_changes_nothing():
    """Issue 25, the Azure code trace: bursts that come back every few minutes cannot be chased (they
    are over before new replicas start), so prefill holds room for the rises within one start-up time it
    has seen (``burst_quantile``). Under steady load with noise the rises stay within the headroom and
    the counts are those of the policy without it."""
    def replay(loads, **kw):
        return [(d.prefill.desired, d.decode.desired, d.prefill.inputs.get("rise", 1.0))
                for d in replay_ticks(loads, **kw)]

    # 0.3 requests/s with a 60-s burst to 1.2 every 6 minutes, for 36 minutes, then quiet for a minute
    bursty = [1.2 if (15 * i) % 360 < 60 else 0.3 for i in range(144)] + [0.3] * 4
    held, plain = replay(bursty), replay(bursty, burst_quantile=0)
    assert held[-1][2] > 2, held[-1]                       # it saw the load quadruple within a start-up
    assert held[-1][0] > plain[-1][0], (held[-1], plain[-1])  # and keeps prefill room for it when quiet
    assert held[-1][1] == plain[-1][1]                     # decode is sized as before
    rng = __import__("random").Random(7)
    noisy = [0.3 * (1 + rng.uniform(-0.1, 0.1)) for _ in range(144)]
    assert [c[:2] for c in replay(noisy)] == [c[:2] for c in replay(noisy, burst_quantile=0)]


def test_the_catch_up_counts_the_ready_replicas_at_their_learned_capacity():
    """Issue 25, the H200 calibration's step (seed 0): prefill's catch-up load is what the ready replicas
    cannot serve for a start-up time. Demand is in the calibration's erlangs, so the ready replicas serve
    ``ready x capacity factor`` of them: counted as ``ready`` alone, a pool whose replicas had proven 1.9x
    faster than calibrated saw a backlog that was not there, added a replica at 0.78x the TTFT target
    and dropped it again, 3 direction changes in 10 steady minutes. The same snapshot gives a catch-up
    at the calibrated capacity and none at twice it."""
    service = PerfModel.of(CAL).remote_prefill_seconds(380)
    arrivals = 1.5 * 4 / service            # 1.5 calibrated erlangs per ready replica, of 4

    def catch_up(factor):
        a = Autoscaler(spec(), CAL)
        a.state["prefill"].correction = factor   # as learned online (``_learn``)
        d = steady(a, 0, arrivals, 4, 10, pre_lat=0.8 * TTFT, dec_lat=0.5 * TPOT)
        return d.prefill.inputs.get("catch_up", 0.0)
    assert catch_up(1.0) > 0
    assert catch_up(2.0) == 0


def test_decode_keeps_room_for_rises_only_once_its_tpot_broke_in_two_of_them():
    """Issue 25, the H200 calibration's bursts: a decode pool absorbs a rise by batching, so it keeps no
    room for one until its p90 TPOT has gone over the target in two separate episodes
    (``decode_room_breaches``); then it holds room as prefill does, and keeps it while the room prevents
    new breaches (``decode_room_memory_s``). The same bursts with TPOT under the target, or breaking
    it once, leave decode sized as without the room."""
    def replay(loads, breaking, **kw):
        def lat(t, x):
            return 1.03 * TPOT if breaking(t, x) else 0.7 * TPOT   # over the target, inside the band
        return [(d.decode.desired, d.decode.inputs.get("rise", 1.0)) for d in replay_ticks(loads, lat, **kw)]

    # 0.3 requests/s with a 60-s burst to 1.2 every 6 minutes, for 54 minutes, then quiet for a minute
    bursty = [1.2 if (15 * i) % 360 < 60 else 0.3 for i in range(216)] + [0.3] * 4
    every = replay(bursty, lambda t, x: x > 1)
    plain = replay(bursty, lambda t, x: x > 1, decode_room=0)
    assert every[-1][1] > 2, every[-1]                          # it saw the load quadruple within a start-up
    assert every[-1][0] > plain[-1][0], (every[-1], plain[-1])  # and keeps decode room for it when quiet
    # on only from the second episode: the first burst's quiet minute is sized as without the room
    first_quiet = 8   # ticks 4-7 are the second minute of load 0.3 after the first burst
    assert every[first_quiet][0] == plain[first_quiet][0], (every[:10], plain[:10])
    # breaking once, or never, keeps no room
    for breaking in (lambda t, x: x > 1 and t < 360, lambda t, x: False):
        assert [c[0] for c in replay(bursty, breaking)] == [c[0] for c in replay(bursty, breaking, decode_room=0)]


def test_the_capacity_probe_does_not_climb_again_past_an_overload_it_just_found():
    """Issue 25, the H200 calibration's prompt-shift: the capacity factor probes upward (+2% a tick) while
    latency is well below target and the count is tight, which lets the count fall until latency breaks;
    at steady load, climbing straight back repeats the miss every few minutes. Within
    ``probe_memory_s`` of an overload the factor stays at the value the overload lowered it to."""
    def probe(**kw):
        a = Autoscaler(spec(), CAL, **kw)
        # one replica short of what the model sizes this load at: tight, and calm as the latency says
        ready = steady(Autoscaler(spec(), CAL), 0, 1.0, 2, 2).prefill.recommended - 1
        factors = []
        for i in range(60):
            t = 15 * i
            lat = 1.5 * TTFT if i == 20 else 0.5 * TTFT      # one overload, calm before and after
            steady(a, t, 1.0, ready, 4, pre_lat=lat, dec_lat=0.7 * TPOT)
            factors.append(a.state["prefill"].correction)
        return factors
    held, free = probe(), probe(probe_memory_s=0)
    assert held[19] > 1.1, held[19]                       # it probed up before the overload
    assert held[20] < held[19]                            # the overload lowered it
    assert max(held[20:]) == pytest.approx(held[20])      # and it did not climb again
    assert free[20] < free[19] and free[-1] > free[20] * 1.1   # without the memory it climbs straight back


def test_the_capacity_probe_stops_where_one_replica_fewer_would_break_the_target():
    """Issue 25, the H200 calibration's prompt-shift: at 0.7x the TTFT target the probe took one of 7
    prefill replicas away and TTFT broke at 1.1x. The probe now climbs only while one replica fewer
    would hold the target at the most load the measured p90 allows (the M/G/c curve anchored on the
    measurement, ``_one_fewer_holds``): a p90 near the no-wait service leaves room to probe, and a p90
    whose queueing says the pool is nearly full does not. 7 replicas, 3.3 prompts/s (about 5.5 erlangs:
    25% more would need an 8th, so the probe may run), a 6 s target."""
    import math

    from tandem.operator.autoscaler.policy import PROBE_SERVICE_TAIL
    target, ready, arrivals = 6.0, 7, 3.3
    sp = spec(pre={"target": {"metric": "ttft", "seconds": target}, "maxReplicas": 20})
    perf = PerfModel.of(CAL)
    s = perf.remote_prefill_seconds(380)
    no_wait = s * (1 + PROBE_SERVICE_TAIL * math.sqrt(perf.cv2))
    calm = s * 1.05                                           # a p90 within the service's own tail
    near = perf.prefill_pool_p90(ready, 5.7, s, no_wait)     # the queue of 5.7 erlangs at 7 replicas
    assert near < 0.75 * target and perf.prefill_pool_p90(ready - 1, 5.7, s, no_wait) > target

    def factor(lat, **kw):
        a = Autoscaler(sp, CAL, **kw)
        for i in range(20):
            a.decide(snap(15 * i, role("prefill", ready, arrivals=arrivals, latency=lat),
                          role("decode", 4, arrivals=arrivals, latency=0.7 * TPOT)))
        assert a.last.prefill.inputs["service_s"] == pytest.approx(s, rel=1e-3)
        return a.state["prefill"].correction
    assert factor(calm) > 1.2                   # it probes where one fewer holds
    assert factor(near) == 1.0                  # not where the measured queue says one fewer breaks
    assert factor(near, probe_guard=0) > 1.2    # the blind probe (before) climbed there too


def test_the_capacity_probe_stops_at_the_calibrations_measured_factor():
    """Issue 25, thirty-fifth session: the probe climbed prefill's factor to 1.52 on the CPU
    calibration's diurnal (seed 0) where the simulator serves 1.15-1.22 times what the model sizes
    (``bench/capacity_by_size.py --role prefill``), and the ramp after the trough broke TTFT. A
    calibration that carries that measurement (``capacity.prefill_factor``) caps the raises there; one
    below 1 stops them, and takes nothing away (only an overload lowers the factor). Without it the
    probe keeps its old ceiling of 3. Same calm pool as the test above: 7 replicas, one fewer holds."""
    target, ready, arrivals = 6.0, 7, 3.3
    sp = spec(pre={"target": {"metric": "ttft", "seconds": target}, "maxReplicas": 20})
    calm = PerfModel.of(CAL).remote_prefill_seconds(380) * 1.05

    def factors(cal):
        a = Autoscaler(sp, cal)
        out = []
        for i in range(40):
            a.decide(snap(15 * i, role("prefill", ready, arrivals=arrivals, latency=calm),
                          role("decode", 4, arrivals=arrivals, latency=0.7 * TPOT)))
            out.append(a.state["prefill"].correction)
        return out
    free = factors(CAL)
    capped = factors(dataclasses.replace(CAL, capacity={"prefill_factor": 1.1}))
    below = factors(dataclasses.replace(CAL, capacity={"prefill_factor": 0.9}))
    assert free[-1] > 1.3, free[-1]                                  # uncapped, it climbs past 1.1
    assert max(capped) == pytest.approx(1.1) and capped[-1] == pytest.approx(1.1), capped
    assert capped[:3] == free[:3]                                    # the same raises up to the cap
    assert set(below) == {1.0}, below


def test_a_window_with_streams_running_and_none_arriving_keeps_the_last_request_sizes():
    """Thirtieth session's note, the real-process fleet test: a metrics window in which streams still ran
    and no request arrived read the mean prompt and output as 0, so decode sized a replica's slots at a
    context of 0 (13.7 slots where its 75-token requests allow 9.9) and weighed each held place as a
    whole prefill per output token. The sizes are now those of the last window with arrivals."""
    a = Autoscaler(spec(), CAL)
    first = steady(a, 0, 0.3, 2, 2).decode.inputs
    assert first["context_tokens"] == pytest.approx(380 + 16 / 2)
    streams = 4
    quiet = a.decide(snap(15, RoleSnapshot("prefill", "ok", 30.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 1.2, 2),
                          RoleSnapshot("decode", "ok", 30.0, 0.0, 0.0, streams / 0.06, streams, 0.0, 0.1,
                                       0.06, 2))).decode.inputs
    assert quiet["context_tokens"] == first["context_tokens"], quiet
    assert quiet["slots_per_replica"] == first["slots_per_replica"]
    assert quiet["hold_s_per_token"] == first["hold_s_per_token"]


def test_a_window_with_streams_running_and_none_arriving_sizes_them_as_a_fixed_population():
    """Thirty-second session: with nothing arriving, decode's running sequences are a fixed population,
    not a stream. Sized as a stream (Erlang C on their tokens/s x the step), two streams held two decode
    replicas of 10-15 slots each in the real-process fleet test, and its drain came only after the
    streams ended. As a population they need their whole slots at the headroom; and since a sequence
    stays on its replica, the population never grows the pool."""
    def quiet(streams, decode_ready, arrivals):
        a = Autoscaler(spec(), CAL)
        a.decide(snap(0, role("prefill", 2, prompt=50), role("decode", decode_ready, prompt=50)))
        tokens = streams / 0.06
        return a.decide(snap(15, role("prefill", 2, arrivals=0.0),
                             RoleSnapshot("decode", "ok", 30.0, arrivals, 0.0, tokens, streams, 0.0, 0.1, 0.06,
                                          decode_ready))).decode
    whole = int(PerfModel.of(CAL).decode_slots(TPOT, 50 + 16 / 2)[0])
    assert whole == 4
    population = quiet(2, 3, 0.0)
    assert population.inputs["fixed_population"] == 2
    assert population.recommended == math.ceil(2 / (whole * 0.8)) == 1, population
    # the same tokens/s from arrivals is a stream: Erlang C keeps a margin for the next arrivals
    stream = quiet(2, 3, 2 / 16)
    assert "fixed_population" not in stream.inputs
    assert stream.recommended > 1, stream
    # more sequences than one replica's whole slots: the sizing would add a replica, which would serve
    # none of them, so the pool holds
    held = quiet(9, 2, 0.0)
    assert math.ceil(9 / (whole * 0.8)) > 2
    assert held.recommended == 2, held


def test_a_window_without_latency_after_one_above_target_holds_the_count():
    """Thirty-fifth session's note: under closed-loop load (the e2e story's ramp), a decode window in which
    no request measured a TPOT fell back to the model ("no latency yet"), which overrates decode on the
    live CPU calibration, and the pool went 2 -> 1 twenty seconds after a window over the target. Without
    a latency, the last one measured stands for the load it was measured at: the pool goes no lower than
    the count that gives each replica no more of the demand now than each carried then (as Kubernetes'
    HPA does not scale down on metrics it lacks), and never above its count now. With none measured
    yet, after a window in or under the band or an idle one, once the load behind the breach has gone,
    or once a new target puts that latency within the band, the model alone sizes it. Prefill is not
    held: a TTFT comes at the first token, not at a stream's end."""
    nan = math.nan

    def gap_after(last_latency, then=0.01, now=0.01):
        a = Autoscaler(spec(), CAL)
        if last_latency is not None:
            steady(a, 0, then, 2, 2, dec_lat=last_latency)
        return steady(a, 15, now, 2, 2, dec_lat=nan).decode

    alone = gap_after(None)
    assert alone.recommended == 1 and alone.desired == 1, alone   # the model alone: one replica
    held = gap_after(1.5 * TPOT)
    assert held.recommended == 2 and held.desired == 2, held       # the same demand on 2: both stay
    assert "the last window measured was x1.50 the target" in held.reason
    # a window within the band, or under it, lets the model size the next gap
    assert gap_after(1.05 * TPOT).desired == 1
    assert gap_after(0.5 * TPOT).desired == 1
    # the load behind the breach has gone: a fifth of it fits one of the two replicas, each at what it
    # carried then; at two thirds of it, one replica would carry more than each did, so both stay
    assert gap_after(1.5 * TPOT, then=0.05, now=0.01).desired == 1
    assert gap_after(1.5 * TPOT, then=0.03, now=0.02).desired == 2
    # the hold lasts until a window measures again: under the target, the pool goes down
    a = Autoscaler(spec(), CAL)
    steady(a, 0, 0.01, 2, 2, dec_lat=1.5 * TPOT)
    assert steady(a, 15, 0.01, 2, 2, dec_lat=nan).decode.desired == 2
    assert steady(a, 30, 0.01, 2, 2, dec_lat=nan).decode.desired == 2
    assert steady(a, 45, 0.01, 2, 2, dec_lat=0.5 * TPOT).decode.desired == 1
    assert steady(a, 60, 0.01, 2, 2, dec_lat=nan).decode.desired == 1   # that window ended the hold
    # or until an idle window: the overload is over
    b = Autoscaler(spec(), CAL)
    steady(b, 0, 0.01, 2, 2, dec_lat=1.5 * TPOT)
    b.decide(snap(15, role("prefill", 2, signal="idle", arrivals=0), role("decode", 2, signal="idle", arrivals=0)))
    assert steady(b, 30, 0.01, 2, 2, dec_lat=nan).decode.desired == 1
    # a GitOps sync that loosens the target keeps the policy's state (kube_loop's carry_over): the
    # breach, 1.5x the old target, is within the band of one twice as loose, and holds nothing
    c = Autoscaler(spec(), CAL)
    steady(c, 0, 0.01, 2, 2, dec_lat=1.5 * TPOT)
    loose = Autoscaler(spec(dec={"target": {"metric": "tpot", "seconds": 2 * TPOT}}), CAL)
    loose.state = copy.deepcopy(c.state)
    assert steady(loose, 15, 0.01, 2, 2, dec_lat=nan).decode.desired == 1
    c2 = Autoscaler(spec(), CAL)
    c2.state = copy.deepcopy(c.state)
    assert steady(c2, 15, 0.01, 2, 2, dec_lat=nan).decode.desired == 2   # the same target: held
    # prefill is not held: a breach of its TTFT, then a window without one, is sized by the model
    p = Autoscaler(spec(), CAL)
    p.decide(snap(0, role("prefill", 2, arrivals=0.01, latency=1.5 * TTFT), role("decode", 2, arrivals=0.01)))
    gap = p.decide(snap(15, role("prefill", 2, arrivals=0.01, latency=nan), role("decode", 2, arrivals=0.01)))
    assert gap.prefill.recommended == 1 and "last window measured" not in gap.prefill.reason, gap.prefill


def test_hpa_behavior_arithmetic_shared_by_the_policy_and_the_held_oracle():
    """``behavior.stabilized`` and ``behavior.step_room`` (Kubernetes HPA's stabilization window and step
    limit, horizontal.go): up takes the lowest recommendation of the window, down the highest, neither
    past the current count; HPA's cut-off is strict (a sample exactly one window old is out), tandem's
    keeps it; each direction may move ``step`` per period, less what it moved in the last period."""
    from tandem.operator.autoscaler.behavior import stabilized, step_room
    recs = [(0.0, 3), (30.0, 6), (60.0, 9)]
    assert stabilized(4, 9, recs, 60.0, 60.0) == 4                  # 3, 60 s old, is in the window
    assert stabilized(4, 9, recs, 60.0, 60.0, strict=True) == 6     # HPA: it is out
    assert stabilized(8, 2, recs, 60.0, 45.0) == 8                  # down: the highest (9), not above 8
    assert stabilized(8, 2, recs, 60.0, 0.0, strict=True) == 2      # no window: the present alone
    assert stabilized(5, 5, recs, 60.0, 60.0) == 5
    changes = [(0.0, 2), (20.0, 1), (25.0, -1)]
    assert step_room(changes, 29.0, 30.0, 4, up=True) == 1          # 2 + 1 moved up within 30 s
    assert step_room(changes, 40.0, 30.0, 4, up=True) == 3          # the first change left the period
    assert step_room(changes, 40.0, 30.0, 1, up=False) == 0


def test_decode_probe_reads_no_margin_where_a_replica_holds_one_sequence_at_the_slo():
    """Twenty-ninth session: decode's capacity probe raised the factor whenever the p90 TPOT was under
    0.75x the target with the count tight. Where a batch of two misses the target (the scenarios' CPU
    calibration: 1.6 slots at the SLO rule's 1.5x a lone sequence's step), the p90 sits at the batch-1
    step, 0.67x the target, at every load short of the cliff, so that held at any factor: it climbed to
    1.32 at steady load and decode ran its headroom away (TPOT attainment under 95% in 14 of 25 held-out
    scenario-seeds, 9 of them outside prompt-shift). The probe now needs two slots; where a replica batches several sequences under the
    target (the shipped CPU calibration: 2-5) the same windows still raise it."""
    def factor(cal, **kw):
        perf = PerfModel.of(cal)
        target = 1.5 * perf.decode_step_seconds(1, 380 + 16 / 2)
        sp = spec(dec={"target": {"metric": "tpot", "seconds": target}, "maxReplicas": 40})
        ready = steady(Autoscaler(sp, cal), 0, 2.0, 4, 8).decode.recommended - 1   # tight: one short
        a = Autoscaler(sp, cal, **kw)
        for i in range(20):
            steady(a, 15 * i, 2.0, 4, ready, pre_lat=0.5 * TTFT, dec_lat=target / 1.5)   # the batch-1 step
        return a.state["decode"].correction, a.last.decode.inputs["slots_per_replica"]
    cliff = Calibration.load(DEFAULT_CALIBRATION)
    held, slots = factor(cliff)
    assert slots < 2 and held == 1.0, (held, slots)
    assert factor(cliff, decode_probe_min_slots=0)[0] > 1.2      # ungated (before), it climbed
    raised, slots = factor(CAL)
    assert slots >= 2 and raised > 1.2, (raised, slots)
