"""The faithful baselines (operator/simulate/baselines.py) replay inputs whose upstream decision was worked
out by hand from the upstream code (the arithmetic is in each comment), and must give the same replica
counts: Kubernetes HPA (replica_calculator.go getUsageRatioReplicaCount, horizontal.go
stabilizeRecommendationWithBehaviors / convertDesiredReplicasWithBehaviorRate), AIBrix APA and KPA
(algorithm/apa.go, algorithm/kpa.go, podautoscaler_controller.go stabilizeRecommendation, context.go
defaults) and Dynamo's SLA planner (planner_core.py _compute_replica_requirements)."""
import math

import pytest

from tandem.operator.autoscaler.snapshot import PoolSnapshot, RoleSnapshot
from tandem.operator.simulate import baselines as B

pytestmark = pytest.mark.timeout(60)
TARGETS = {"prefill": 1.0, "decode": 0.1}   # the SLOs: p90 TTFT 1 s, p90 TPOT 0.1 s


def snap(at, p=None, d=None, router=0):
    """A pool snapshot; ``p`` and ``d`` are RoleSnapshot fields (ready 2 and signal ok unless given)."""
    def role(name, kw):
        kw = {"ready": 2, **(kw or {})}
        return RoleSnapshot(name, **kw)
    return PoolSnapshot(at, role("prefill", p), role("decode", d), router_queued=router)


def counts(policy, s):
    dec = policy.decide(s)
    return dec.prefill.desired, dec.decode.desired


def test_hpa_queue_replays_hpa():
    hpa = B.HPAQueue(prefill_q=1.0, decode_q=0.5)
    # t=0 prefill: (4 running + 6 waiting + 2 at the router) / 4 ready = 3 per pod, ratio 3/1 = 3 > 1.1:
    #   ceil(3 x 4) = 12, then the scale-up limit max(4 + 4, 2 x 4) = 8 -> 8.
    # decode: 2 running / 4 ready = 0.5 per pod, ratio 0.5 / 0.5 = 1.0, within 0.1 -> 4.
    assert counts(hpa, snap(0, {"ready": 4, "running": 4, "waiting": 6}, {"ready": 4, "running": 2}, router=2)) == (8, 4)
    # t=15 prefill: 4 queued / 4 ready = 1, ratio 1 -> stays at its 8 (4 ready + 4 starting).
    # decode: 0.6 / 4 = 0.15, ratio 0.3: ceil(0.3 x 4) = ceil(1.2) = 2 < 4: the down window holds the
    #   largest recommendation of 300 s, max(4 at t=0, 2) = 4 -> 4.
    assert counts(hpa, snap(15, {"ready": 4, "starting": 4, "running": 4}, {"ready": 4, "running": 0.6})) == (8, 4)
    # t=330 (t=0 and t=15 out of the window): prefill 2 / 8 = 0.25, ceil(0.25 x 8) = 2 -> 2;
    # decode ceil(0.3 x 4) = 2 -> 2.
    assert counts(hpa, snap(330, {"ready": 8, "running": 2}, {"ready": 4, "running": 0.6})) == (2, 2)


def test_hpa_slo_replays_hpa_on_an_object_metric():
    hpa = B.HPASLO(TARGETS, prefill_fraction=0.8, decode_fraction=0.9)   # targets 0.8 s and 0.09 s
    # t=0 prefill: p90 2.0 s / 0.8 = 2.5: ceil(2.5 x 3 ready) = 8, limit max(3 + 4, 2 x 3) = 7 -> 7.
    # decode: 0.09 / 0.09 = 1.0 -> 3.
    assert counts(hpa, snap(0, {"ready": 3, "latency": 2.0}, {"ready": 3, "latency": 0.09})) == (7, 3)
    # t=15 prefill: 0.84 / 0.8 = 1.05, within 0.1 -> 7 (3 ready + 4 starting).
    # decode: 0.045 / 0.09 = 0.5: ceil(0.5 x 3) = 2; down window max(3, 2) = 3 -> 3.
    assert counts(hpa, snap(15, {"ready": 3, "starting": 4, "latency": 0.84}, {"ready": 3, "latency": 0.045})) == (7, 3)
    # t=330 prefill: no request finished, no p90: the metric is missing, HPA keeps 7.
    # decode: ceil(0.5 x 3) = 2, the window (t > 30) holds only 2 -> 2.
    assert counts(hpa, snap(330, {"ready": 7, "latency": None}, {"ready": 3, "latency": 0.045})) == (7, 2)


def test_apa_replays_aibrix():
    apa = B.APA(TARGETS, prefill_fraction=0.8, decode_fraction=0.9)     # targets 0.8 s and 0.09 s
    # t=0 prefill: window mean 2.0, 2.0 / 0.8 = 2.5 > 1.1: min(ceil(3 x 2.5) = 8, ceil(2 x 3) = 6) = 6;
    #   the scale-up cooldown is 0 s -> 6.
    # decode: 0.09 / 0.09 = 1.0 -> 3.
    assert counts(apa, snap(0, {"ready": 3, "latency": 2.0}, {"ready": 3, "latency": 0.09})) == (6, 3)
    # t=15 prefill: window mean (2.0 + 0.4) / 2 = 1.2, / 0.8 = 1.5: min(ceil(6 x 1.5) = 9, 12) = 9 -> 9.
    # decode: mean (0.09 + 0.027) / 2 = 0.0585, / 0.09 = 0.65 < 0.9: max(ceil(3 x 0.65) = 2, floor(3 / 2) = 1)
    #   = 2; the cooldown takes the least recommendation of 300 s, min(3, 2) = 2 -> 2.
    assert counts(apa, snap(15, {"ready": 3, "starting": 3, "latency": 0.4}, {"ready": 3, "latency": 0.027})) == (9, 2)
    # t=200 (the 180 s window holds this sample only) prefill: 0.2 / 0.8 = 0.25:
    #   max(ceil(9 x 0.25) = 3, floor(9 / 2) = 4) = 4; cooldown min(6, 9, 4) = 4 -> 4.
    # decode at 4 replicas: 0.0675 / 0.09 = 0.75: max(ceil(3.0) = 3, 2) = 3 < 4; the cooldown takes the
    #   least of 300 s, min(3, 2, 3) = 2 -> 2 (upstream selects the minimum on a scale-down).
    assert counts(apa, snap(200, {"ready": 9, "latency": 0.2}, {"ready": 4, "latency": 0.0675})) == (4, 2)


def test_kpa_replays_aibrix():
    kpa = B.KPA(prefill_c=4.0, decode_c=1.0)
    # t=0 prefill: concurrency 2 + 4 = 6 in both windows; panic/stable = 1 <= 2: stable mode;
    #   6 > 4 x 1.1: ceil(6 / 4) = 2, within [floor(2 / 2) = 1, ceil(2 x 2) = 4] -> 2.
    # decode: 2 > 1.1: ceil(2 / 1) = 2 -> 2.
    assert counts(kpa, snap(0, {"running": 2, "waiting": 4}, {"running": 2})) == (2, 2)
    # t=90 prefill: stable (180 s) mean (6 + 20) / 2 = 13, panic (60 s, t > 30) 20; 20 / 13 = 1.54: stable;
    #   ceil(13 / 4) = 4, within [1, 4] -> 4.
    # decode: stable (2 + 0) / 2 = 1.0, inside [0.9, 1.1]: the current 2; panic 0 / 1 = 0: stable -> 2.
    assert counts(kpa, snap(90, {"running": 4, "waiting": 16}, {"running": 0})) == (4, 2)
    # t=150 prefill at 6 replicas: stable (6 + 20 + 60) / 3 = 28.67, panic (t > 90) 60; 60 / 28.67 = 2.09 > 2:
    #   panic. Stable: ceil(28.67 / 4) = 8; panic: ceil(60 / 4) = 15, held to ceil(2 x 6) = 12;
    #   in panic the larger -> 12 (stable mode would give 8).
    # decode: stable (2 + 0 + 0) / 3 = 0.67 < 0.9: ceil(0.67) = 1, within [1, 4]; panic 0: stable mode;
    #   the cooldown's least of 300 s, min(2, 2, 1) = 1 -> 1.
    assert counts(kpa, snap(150, {"ready": 6, "running": 6, "waiting": 54}, {"running": 0})) == (12, 1)


class LinearProfile:
    """A hand-written performance profile (upstream reads one from the profiler's npz files): prefill TTFT
    of ``isl`` tokens = isl / 1000 s (1000 tokens/s per GPU); a decode step of ``b`` sequences 0.02 + 0.01 b s."""
    def remote_prefill_seconds(self, isl):
        return isl / 1000.0

    def decode_step_seconds(self, b, ctx):
        return 0.02 + 0.01 * b


def test_dynamo_replays_the_sla_planner():
    planner = B.DynamoPlanner(LinearProfile(), TARGETS, itl_fraction=0.5)   # --itl 0.05 s, arima predictor
    s1 = ({"arrivals_per_s": 3.0, "prompt_tokens_per_s": 1500.0, "latency": 1.0},
          {"arrivals_per_s": 3.0, "output_tokens_per_s": 60.0, "latency": 0.06, "running": 4.0})
    assert counts(planner, snap(0, *s1)) == (2, 2)          # t=0: the planner waits one interval
    # t=180: num_req 3 x 180 = 540, ISL 1500 / 3 = 500, OSL 60 / 3 = 20, TTFT 1.0, ITL 0.06, concurrency 4 / 2 = 2.
    #   Corrections: p = 1.0 / (500 / 1000) = 2.0, d = 0.06 / (0.02 + 0.01 x 2) = 1.5. Fewer than 5 points:
    #   ARIMA predicts the last value. Prefill: 540 x 500 / 180 x min(1, 2.0) = 1500 tokens/s over
    #   500 / 0.5 = 1000 per GPU = 1.5 -> 2 (uncapped it would be 3). Decode: ITL 0.05 / 1.5 = 0.0333:
    #   b = 1.333, throughput 1.333 / 0.0333 = 40 tokens/s; 540 x 20 / 180 = 60 -> 60 / 40 = 1.5 -> 2.
    assert counts(planner, snap(180, *s1)) == (2, 2)
    # t=360: num_req 6 x 180 = 1080, ISL 500, OSL 20, TTFT 0.4, ITL 0.036, concurrency 2 / 2 = 1.
    #   p = 0.4 / 0.5 = 0.8; d = 0.036 / 0.03 = 1.2. Prefill: 1080 x 500 / 180 x 0.8 = 2400 / 1000 = 2.4 -> 3.
    #   Decode: ITL 0.05 / 1.2 = 0.04167: b = 2.1667, 2.1667 / 0.04167 = 52 tokens/s; 120 / 52 = 2.31 -> 3.
    s2 = ({"arrivals_per_s": 6.0, "prompt_tokens_per_s": 3000.0, "latency": 0.4},
          {"arrivals_per_s": 6.0, "output_tokens_per_s": 120.0, "latency": 0.036, "running": 2.0})
    assert counts(planner, snap(360, *s2)) == (3, 3)
    # t=540: no traffic, no TTFT or ITL: the metrics are not valid and the adjustment is skipped -> 3, 3.
    assert counts(planner, snap(540, {"signal": "idle"}, {"signal": "idle"})) == (3, 3)
    assert planner.pred["num_req"].data == [540.0, 1080.0, 0.0]   # the idle interval is still recorded


@pytest.mark.timeout(240)   # importing pmdarima and ten fits: ~5 s idle, up to a minute on a loaded 2-core machine
def test_dynamo_default_predictor_is_auto_arima():
    """From the fifth point on, the default predictor is pmdarima's auto_arima (upstream's), which follows a
    trend the constant predictor cannot."""
    p = B.ARIMAPredictor()
    for v in [100.0, 110.0, 120.0, 130.0]:
        p.add_data_point(v)
    assert p.predict_next() == 130.0                   # under 5 points: the last value
    for v in [140.0, 150.0, 160.0, 170.0, 180.0, 190.0]:
        p.add_data_point(v)
    assert math.isclose(p.predict_next(), 200.0, rel_tol=0.03)


def test_the_reactive_oracle_learns_of_a_minute_once_it_has_begun():
    """The reactive oracle is the cost aim's yardstick because no policy that sees only the present can
    do better. At the tick on a minute's boundary nothing of that minute has happened yet, so it still
    sizes for the minute before; until the twenty-eighth session it read the new minute there, one tick
    ahead of anything a present-only policy can know (the scenarios' shifts start on a boundary). The
    oracle with foresight does read it (and the next minute)."""
    minutes = [{"rps": 2}, {"rps": 2}, {"rps": 9}, {"rps": 5}]

    def sized(oracle):
        oracle.need = lambda load: {"prefill": load["rps"], "decode": load["rps"]}
        return oracle
    reactive = sized(B.ReactiveOracle(None, TARGETS, minutes))
    assert counts(reactive, snap(105)) == (2, 2)
    assert counts(reactive, snap(120)) == (2, 2)   # minute 2 begins now: none of it seen yet
    assert counts(reactive, snap(135)) == (9, 9)
    assert counts(reactive, snap(180)) == (9, 9)   # minute 3 begins now
    assert counts(reactive, snap(195)) == (5, 5)
    assert counts(reactive, snap(0)) == (2, 2)     # before anything: the first minute
    assert counts(reactive, snap(999)) == (5, 5)   # past the last minute: the last one
    foresight = sized(B.Oracle(None, TARGETS, minutes))
    assert counts(foresight, snap(105)) == (9, 9)  # this minute and the next
    assert counts(foresight, snap(120)) == (9, 9)
    assert counts(foresight, snap(180)) == (5, 5)  # from a minute's first second


def test_the_reactive_oracle_held_to_the_pools_behavior_replays_hpa_behavior():
    """The yardstick ``run.reach`` uses beside the plain reactive oracle: its recommendation (here forced,
    one per tick) goes through the pool's behavior as HPA applies it (horizontal.go
    recordInitialRecommendation, stabilizeRecommendationWithBehaviors with its strict cut-offs,
    calculateScaleUpLimitWithScalingRules and calculateScaleDownLimitWithBehaviors, one policy per
    direction)."""
    from tandem.operator.autoscaler.policy import RoleLimits
    # the scenarios' behavior: up no window, +4 per 30 s; down the largest of 300 s, -1 per 60 s
    lim = RoleLimits(True, 1, 16, 1.0, 90.0, 0.1, 0.0, 4, 30.0, 300.0, 1, 60.0, 1)
    oracle = B.BehavedReactiveOracle(None, TARGETS, [{}], {"prefill": lim, "decode": lim})
    recs = iter([{"prefill": 12, "decode": 3}, {"prefill": 12, "decode": 3}, {"prefill": 2, "decode": 2},
                 {"prefill": 2, "decode": 2}])
    oracle.need = lambda load: next(recs)
    # t=0, first sight: the current counts (prefill 2, decode 4) are recorded at t=0.
    #   prefill 2 -> 12: the up window (0 s) holds nothing after t=0, so 12; +4 per 30 s -> 6.
    #   decode 4 -> 3: the down window holds the initial 4, max(3, 4) = 4 -> stays 4.
    assert counts(oracle, snap(0, {"ready": 2}, {"ready": 4})) == (6, 4)
    # t=15: prefill 6 -> 12: the +4 of t=0 is within the 30 s period, so no room -> 6.
    #   decode 4 -> 3: the window holds 4 (t=0's initial) -> 4.
    assert counts(oracle, snap(15, {"ready": 2, "starting": 4}, {"ready": 4})) == (6, 4)
    # t=45: prefill 6 -> 2: the down window holds max(2, 12, 12, 2) = 12 >= 6 -> stays 6.
    #   decode 4 -> 2: max(2, 4, 3, 3) = 4 -> 4.
    assert counts(oracle, snap(45, {"ready": 6}, {"ready": 4})) == (6, 4)
    # t=400: the window (after t=100) holds nothing older, so 2; -1 per 60 s (nothing went down within
    #   60 s) -> prefill 6 - 1 = 5, decode 4 - 1 = 3.
    assert counts(oracle, snap(400, {"ready": 6}, {"ready": 4})) == (5, 3)
