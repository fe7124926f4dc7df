"""Issue 10's five scenarios: every policy on every scenario in the simulator (seed 0, the baselines'
knobs tuned on seed 1 and committed in operator/simulate/tuned.json), the table printed, and the aims
asserted. Aims that the measurements show out of reach are listed in KNOWN_MISSES with the figures in
bench/RESULTS.md; the test fails if one of them starts to pass (update the list and the docs) or if any
other aim fails. Each listed miss on attainment, cost or a comparison is then checked against the
reactive oracle (``run.reach``): a miss that a perfectly informed reactive policy avoids is tandem's
own and must be named so (TANDEM_OWN)."""
import json
import subprocess
import sys

import pytest

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.tune import DEFAULT_CALIBRATION, frontier_all, table_all
from tandem.worker.api.calibration import Calibration

# the table fixture runs Dynamo's planner with auto-ARIMA (45 fits a run): about 2 minutes on an idle 2-core
# machine, past 10 minutes on one shared with other jobs
pytestmark = pytest.mark.timeout(1800)
CAL = Calibration.load(DEFAULT_CALIBRATION)
PERF = PerfModel.of(CAL)

#: (scenario, aim) pairs measured out of reach or missed, each with the reactive oracle's verdict
#: (``run.reach``: the load of a minute known exactly once it has begun, replicas paying the start-up,
#: run at every setting of its grid) and the figures (bench/RESULTS.md, "Thirteenth session: room for the
#: rises seen", "Fourteenth session: the decode hold's share", "Sixteenth session: decode room once its
#: TPOT broke in two rises, and the catch-up at the learned capacity", and "Seventeenth session: the
#: capacity probe's guard"; the verdicts as of "Twenty-first session", the figures of "Twenty-fourth
#: session: rises beyond the counting noise"; the oracles' figures of "Twenty-eighth session: the reactive
#: oracle's first second"; tandem's of "Thirty-fifth session: the probe's cap").
#: Regenerated from `python -m
#: tandem.operator.simulate.tune --table-only --markdown FILE` whenever the policy, a baseline or the
#: simulator changes.
KNOWN_MISSES: dict = {
    ('step', 'GPU-hours <= 1.1x reactive oracle'):
        "only by a setting chosen on seed 0: the held oracle at utilization 1.5 misses TPOT on seed 1 (91.7%); at 1.25, which tuning on seed 1 picks, it costs 18.14 against tandem's 17.85; 17.85 vs 15.60 (x1.14; the reactive oracle held to the behavior at utilization 1.5, attainment 95.0%); the oracle with foresight 15.37",
    ('step', 'beats static'):
        "only by a setting chosen on seed 0: the held oracle at utilization 1.5 (95.0% / 95.0% at 15.60 GPU-h) misses TPOT on seed 1; no setting tuning there could choose reaches it; attainment 95.0% vs 65.0%, GPU-h 17.85 vs 16.01",
    ('step', 'beats hpa-queue'):
        'no setting of the reactive oracle meets it; attainment 95.0% vs 98.3%, GPU-h 17.85 vs 27.68',
    ('step', 'beats kpa'):
        'the reactive oracle meets it only by missing attainment >= 95% (TTFT and TPOT); attainment 95.0% vs 5.0%, GPU-h 17.85 vs 14.16',
    ('step', 'beats dynamo'):
        'no setting of the reactive oracle meets it; attainment 95.0% vs 5.0%, GPU-h 17.85 vs 7.51',
    ('diurnal', 'GPU-hours <= 0.7x best static'):
        'the reactive oracle meets it only by missing attainment >= 95% (TTFT and TPOT); 14.51 vs 15.01 (x0.97; static misses the SLO)',
    ('diurnal', 'beats apa'):
        "tandem's own: a setting of the reactive oracle meets it and both core aims; attainment 98.3% vs 100.0%, GPU-h 14.51 vs 22.77",
    ('diurnal', 'beats kpa'):
        'the reactive oracle meets it only by missing attainment >= 95% (TTFT and TPOT); attainment 98.3% vs 1.7%, GPU-h 14.51 vs 10.51',
    ('diurnal', 'beats dynamo'):
        'no setting of the reactive oracle meets it; attainment 98.3% vs 5.0%, GPU-h 14.51 vs 6.76',
    ('bursts', 'GPU-hours <= 1.1x reactive oracle'):
        "the pool's behavior's: reachable only past the pool's behavior: against the reactive oracle held to it tandem meets it, 15.79 vs 18.63 (x0.85; the reactive oracle held to the behavior at utilization 1, attainment 98.3%); 15.79 vs 13.11 (x1.20; the reactive oracle at utilization 1, attainment 95.0%); the oracle with foresight 10.52",
    ('bursts', 'GPU-hours <= 0.7x best static'):
        'the reactive oracle meets it only by missing attainment >= 95% (TTFT and TPOT); 15.79 vs 13.01 (x1.21; static meets the SLO)',
    ('bursts', 'beats static'):
        'no setting of the reactive oracle meets it; attainment 96.7% vs 96.7%, GPU-h 15.79 vs 13.01',
    ('bursts', 'beats hpa-slo'):
        'no setting of the reactive oracle meets it; attainment 96.7% vs 93.3%, GPU-h 15.79 vs 13.07',
    ('bursts', 'beats apa'):
        'no setting of the reactive oracle meets it; attainment 96.7% vs 100.0%, GPU-h 15.79 vs 17.27',
    ('bursts', 'beats kpa'):
        'the reactive oracle meets it only by missing attainment >= 95% (TTFT and TPOT); attainment 96.7% vs 8.3%, GPU-h 15.79 vs 9.03',
    ('bursts', 'beats dynamo'):
        'no setting of the reactive oracle meets it; attainment 96.7% vs 5.0%, GPU-h 15.79 vs 5.92',
    ('prompt-shift', 'prefill grows, decode changes by <= 1'):
        'prefill 3 -> 8, decode 2 -> 9 (medians; the oracle: decode 1 -> 8) (not judged by the reactive oracle)',
    ('prompt-shift', 'beats static'):
        'no setting of the reactive oracle meets it; attainment 95.0% vs 95.0%, GPU-h 14.16 vs 14.05',
    ('prompt-shift', 'beats kpa'):
        'the reactive oracle meets it only by missing attainment >= 95% (TTFT and TPOT); attainment 95.0% vs 33.3%, GPU-h 14.16 vs 11.72',
    ('prompt-shift', 'beats dynamo'):
        'no setting of the reactive oracle meets it; attainment 95.0% vs 31.7%, GPU-h 14.16 vs 5.78',
    ('output-shift', 'beats static'):
        'no setting of the reactive oracle meets it; attainment 95.0% vs 95.0%, GPU-h 11.89 vs 11.01',
    ('output-shift', 'beats hpa-slo'):
        'no setting of the reactive oracle meets it; attainment 95.0% vs 100.0%, GPU-h 11.89 vs 15.30',
    ('output-shift', 'beats kpa'):
        'the reactive oracle meets it only by missing attainment >= 95% (TTFT and TPOT); attainment 95.0% vs 21.7%, GPU-h 11.89 vs 8.66',
    ('output-shift', 'beats dynamo'):
        'no setting of the reactive oracle meets it; attainment 95.0% vs 6.7%, GPU-h 11.89 vs 4.98',
}
ORACLE_MISSES = "the oracle meets the SLO"   # not an aim of the issue: a check of the yardstick
#: Known misses that some setting of the reactive oracle reaches while meeting both core aims, plain or
#: held to the pool's scaling behavior as tandem is, and chosen where tandem's defaults were (seed 1):
#: tandem's own shortfalls, not the start-up's, the yardsticks' or hindsight's (``run.reach``, ``run.is_own``). Diurnal's comparisons: since the thirty-fifth session's
#: cap on prefill's capacity probe (the calibration's measured ``capacity.prefill_factor``, 1.19) tandem
#: has 100% / 98.3% at 14.51 GPU-hours and beats hpa-queue and hpa-slo (98.3% at 22.15 and 16.60); APA
#: has 100% / 100% at 22.77, and tandem's one TPOT minute is the last (minute 59, p90 at 1.00x the
#: target, decode 7 -> 9 on the ramp). Before the cap the probe climbed to 1.52 and prefill's TTFT broke
#: in minutes 52, 54 and 59 (95.0%, and all three comparisons were missed). Step's cost: 17.85 GPU-hours
#: against 1.1x the held oracle's 15.60 (17.59 before the cap, 17.01 before the twenty-ninth session's
#: gate on decode's probe). Bursts' cost (the plain oracle at utilization 1.0 meets the SLO at 13.11 GPU-hours
#: against tandem's 15.79) left this set in the twentieth session: held to the pool's scale-down window
#: and step, the oracle's cheapest setting at 95% costs 18.63. Since the twenty-first session the cost
#: aim's yardstick is the cheaper of both oracles (``run.yardsticks``), and an aim out of the plain
#: oracle's reach that the held one reaches is tandem's own: step's comparison with the static fleet (the
#: held oracle at utilization 1.5 meets 95% at 15.60 GPU-hours, tandem 17.85). Prompt-shift's attainment
#: (the held oracle at utilization 0.6 meets 95% / 95% at 22.89 GPU-hours) was tandem's own until the
#: thirty-third session: absorbing through a deep prefill backlog (``absorb_deep_backlog``) meets it,
#: 95.0% / 95.0% at 14.16 GPU-hours (was 93.3% / 93.3% at 14.51) (docs/autoscaler-issue25.md, "Both oracles as
#: the yardstick", "What the minutes after a shift need", "The probe's cap"). Step's cost and its comparison
#: with the static fleet left this set in the thirty-seventh session: the held oracle's setting behind both
#: (utilization 1.5) misses TPOT on seed 1 (91.7%), so tuning there, as tandem's defaults were, could not
#: choose it; the setting it could (1.25) costs 18.14 GPU-hours on seed 0, more than tandem's 17.85
#: (docs/autoscaler-issue25.md, "The yardstick tuned where tandem is").
TANDEM_OWN: set = {
    ('diurnal', 'beats apa'),
}


@pytest.fixture(scope="module")
def table():
    return table_all(DEFAULT_CALIBRATION, R.load_tuned(), jobs=2)


@pytest.fixture(scope="module")
def front():
    """The reactive oracle at every setting of its grid (the cost aim's yardstick, ``run.reach``'s judge)."""
    return frontier_all(DEFAULT_CALIBRATION, jobs=2)


@pytest.fixture(scope="module")
def held():
    """The same, held to the pool's scaling behavior (``run.reach``'s second judge)."""
    return frontier_all(DEFAULT_CALIBRATION, jobs=2, policy=R.BEHAVED)


@pytest.fixture(scope="module")
def tuning():
    """Both on the tuning seed: the settings there that tuning could choose (``run.tuned_settings``)."""
    return (frontier_all(DEFAULT_CALIBRATION, jobs=2, seed=R.TUNING_SEED),
            frontier_all(DEFAULT_CALIBRATION, jobs=2, policy=R.BEHAVED, seed=R.TUNING_SEED))


def test_every_policy_on_every_scenario(table, front, held):
    rows = R.aims(table, R.yardsticks(front, held))
    print("\n" + R.format_table(table) + "\n\n" + R.format_aims(rows))
    missed = {(r["scenario"], r["aim"]) for r in rows if not r["ok"]}
    unexpected = [r for r in rows if not r["ok"] and (r["scenario"], r["aim"]) not in KNOWN_MISSES]
    assert not unexpected, unexpected
    now_met = [k for k in KNOWN_MISSES if k not in missed and k[1] != ORACLE_MISSES]
    assert not now_met, f"listed as out of reach but met now (update KNOWN_MISSES and RESULTS.md): {now_met}"
    # the simulation itself: every request served, the oracle's knowledge helps
    for sc, pols in table.items():
        for p, m in pols.items():
            assert m["finished"] == m["requests"], (sc, p)
        assert R.meets(pols["oracle"]) != ((sc, ORACLE_MISSES) in KNOWN_MISSES), sc


def test_known_misses_are_out_of_reach_of_a_reactive_policy(table, front, held, tuning):
    """Each known miss on attainment, cost or a comparison is checked, not just asserted: the reactive
    oracle (the load of a minute known exactly once it has begun, replicas paying the start-up) is run at
    every setting of its grid in tandem's place, plain and held to the pool's scaling behavior. Where no
    setting meets the aim, or none meets it without missing a core aim, or only the plain one does, or
    only one that tuning on seed 1 could not choose (tandem's defaults were tuned there), the miss
    belongs to the start-up time, the yardsticks, the pool's behavior or hindsight of seed 0; where one
    held to the behavior and chosen on seed 1 does, it is tandem's own and must be listed in TANDEM_OWN."""
    rows, verdicts = R.judge(table, front, held, tuning)
    print("\n" + R.format_frontier(front) + "\n\n" + R.format_frontier(held) + "\n\n"
          + R.format_reach(rows, verdicts))
    judged = {k: v for k, v in verdicts.items() if k in KNOWN_MISSES}
    assert judged, "no known miss was judged"
    own = {k for k, v in judged.items() if R.is_own(v)}
    assert own == TANDEM_OWN, judged


def test_tuned_knobs_are_current():
    """tuned.json covers every baseline on every scenario, and one cheap re-tuning reproduces it."""
    tuned = R.load_tuned()
    for n in S.NAMES:
        assert set(tuned[n]) == {p for p in R.POLICIES if p != "tandem"}, n
    sc = S.build("output-shift", PERF, 1)
    assert R.tune("apa", sc, PERF, CAL) == tuned["output-shift"]["apa"]


def test_tandem_defaults_are_the_grid_pick_on_seed_1():
    """tandem's headroom and catch_up_s defaults are what tuning picks on seed 1, as the baselines' knobs
    are (one setting for all scenarios; about 20 s on 2 cores)."""
    import inspect

    from tandem.operator.autoscaler.policy import Autoscaler
    from tandem.operator.simulate.tune import tandem_grid
    rows = tandem_grid(DEFAULT_CALIBRATION, seed=1, jobs=2)
    picked = [r["knobs"] for r in rows if r["pick"]]
    params = inspect.signature(Autoscaler).parameters
    assert picked == [{"headroom": params["headroom"].default, "catch_up_s": params["catch_up_s"].default}], \
        [(r["knobs"], r["gpu_hours"]) for r in rows]


def test_scenarios_are_deterministic_and_as_specified():
    a, b = S.build("bursts", PERF, 0), S.build("bursts", PERF, 0)
    assert a.records == b.records and S.build("bursts", PERF, 1).records != a.records
    for n in S.NAMES:
        sc = S.build(n, PERF, 0)
        ts = [r["timestamp"] for r in sc.records]
        assert 0 <= ts[0] and ts[-1] < S.DURATION
        assert all(r["output_tokens"] >= 2 for r in sc.records)
    step = S.build("step", PERF, 0)
    before = sum(1 for r in step.records if 600 <= r["timestamp"] < 1200) / 600
    after = sum(1 for r in step.records if 1800 <= r["timestamp"] < 2400) / 600
    assert after / before == pytest.approx(1.0 / 0.3, rel=0.15)
    ps = S.build("prompt-shift", PERF, 0)
    import numpy as np
    p0 = np.median([r["prompt_tokens"] for r in ps.records if r["timestamp"] < 1200])
    p1 = np.median([r["prompt_tokens"] for r in ps.records if r["timestamp"] >= 1200])
    assert p1 / p0 == pytest.approx(4, rel=0.1)


def test_static_fleet_accounting():
    """A static fleet's GPU-hours are its size times the run; a generous one meets the SLOs."""
    sc = S.build("diurnal", PERF, 0)
    m, fleet = R.run_one("static", sc, PERF, CAL, {"prefill": 12, "decode": 12})
    assert m["gpu_hours"] == pytest.approx(24 * fleet.end / 3600, rel=1e-6)
    assert R.meets(m) and m["prefill"]["actions"] == 0
    small, _ = R.run_one("static", sc, PERF, CAL, {"prefill": 1, "decode": 1})
    # one prefill replica is the bottleneck (the lone decode replica only sees what it lets through)
    assert small["attainment_ttft"] < 0.5 and small["p90_ttft"] > 10 * m["p90_ttft"]


def test_cli(tmp_path):
    env = {"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}
    tandem = [sys.executable, "-m", "tandem.worker.cli"]
    r = subprocess.run(tandem + ["simulate", "--scenario", "output-shift", "--policy", "tandem", "--json",
                                 "--write-trace", str(tmp_path / "t.jsonl"), "--write-pool", str(tmp_path / "p.yaml"),
                                 "--plot", str(tmp_path / "p.png"), "--minutes"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["results"]["tandem"]["requests"] == out["trace"]["requests"] > 1000
    assert (tmp_path / "p.png").stat().st_size > 10000
    # --minutes: one row a simulated minute, whose misses are the attainment's, every arrival counted,
    # and the counts after each tick (four a minute at 15 s ticks from 30 s)
    rows, res = out["minutes"]["tandem"], out["results"]["tandem"]
    assert [r["minute"] for r in rows] == list(range(60))
    for key in ("ttft", "tpot"):
        judged = [r[f"{key}_met"] for r in rows if r[f"{key}_p90"] is not None]
        assert sum(judged) / len(judged) == pytest.approx(res[f"attainment_{key}"], abs=1e-4), key
    assert sum(r["arrivals"] for r in rows) == res["requests"]
    assert [len(r["decode"]) for r in rows] == [2] + [4] * 59
    assert max(max(r["decode"]) for r in rows) == res["decode"]["max_replicas"]
    # the same run from the written pool and trace gives the same figures
    r2 = subprocess.run(tandem + ["simulate", "--pool", str(tmp_path / "p.yaml"), "--trace", str(tmp_path / "t.jsonl"),
                                  "--policy", "tandem", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["results"]["tandem"]["gpu_hours"] == out["results"]["tandem"]["gpu_hours"]
    # bad input: a clear error, exit 2
    (tmp_path / "bad.yaml").write_text((tmp_path / "p.yaml").read_text().replace("target:", "targetx:"))
    r3 = subprocess.run(tandem + ["simulate", "--pool", str(tmp_path / "bad.yaml"), "--trace", str(tmp_path / "t.jsonl")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert r3.returncode == 2 and "error:" in r3.stderr
    r4 = subprocess.run(tandem + ["simulate", "--scenario", "step", "--policy", "nope"], capture_output=True,
                        text=True, env=env, timeout=120)
    assert r4.returncode == 2 and "unknown policy" in r4.stderr
    # a scenario runs on the calibration it is defined on, with the tuned knobs: the table's figures
    # (the command once defaulted to the serving calibration, where the tuned static fleet got 0% TTFT)
    r5 = subprocess.run(tandem + ["simulate", "--scenario", "bursts", "--policy", "static", "--json"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert r5.returncode == 0, r5.stderr
    expect, _ = R.run_one("static", S.build("bursts", PERF, 0), PERF, CAL, R.load_tuned()["bursts"]["static"])
    assert json.loads(r5.stdout)["results"]["static"]["gpu_hours"] == expect["gpu_hours"]
    # more bad input, each a one-line error and exit 2 before anything runs (a --tick of 0 once looped
    # until memory ran out; the others were tracebacks or silently ignored)
    (tmp_path / "bad.jsonl").write_text('{"timestamp": -1, "prompt_tokens": 8, "output_tokens": 2}\n')
    pool, trace = ["--pool", str(tmp_path / "p.yaml")], ["--trace", str(tmp_path / "t.jsonl")]
    for argv, says in ((pool + trace + ["--tick", "0"], "--tick"), (pool + trace + ["--startup", "-5"], "--startup"),
                       (["--pool", str(tmp_path / "nope.yaml")] + trace, "no such file"),
                       (pool + trace + ["--seed", "3"], "--seed"), (["--scenario", "step"] + trace, "not both"),
                       (pool + ["--trace", str(tmp_path / "bad.jsonl")], "bad.jsonl:1: timestamp"),
                       (pool + trace + ["--plot", str(tmp_path / "x.txt")], "--plot"),
                       (pool + trace + ["--policy", "tandem", "--aims"], "--policy all")):
        r6 = subprocess.run(tandem + ["simulate"] + argv, capture_output=True, text=True, env=env, timeout=60)
        assert r6.returncode == 2 and "error:" in r6.stderr and says in r6.stderr, (argv, r6.stderr[-500:])


def test_cli_judges_the_aims_as_the_table_does():
    """``tandem simulate --aims`` on a scenario: the same aims missed as the table's (KNOWN_MISSES), and
    the same verdicts, from the same machinery (run.aims, run.yardsticks, run.reach); about 12 s."""
    env = {"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "simulate", "--scenario", "output-shift",
                        "--aims", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["aims"]
    missed = {(a["scenario"], a["aim"]): a["verdict"] for a in rows if not a["ok"] and a["scenario"] != "all"}
    assert set(missed) == {k for k in KNOWN_MISSES if k[0] == "output-shift"}, missed
    for k, verdict in missed.items():
        # KNOWN_MISSES words "out of reach" as "no setting of the reactive oracle meets it"
        said = ("not judged" if verdict is None else "no setting" if verdict == "out of reach"
                else verdict.split(":")[0])
        assert said in KNOWN_MISSES[k], (k, verdict)
    cost = [a for a in rows if a["aim"] == R.COST_AIM]
    assert len(cost) == 1 and cost[0]["ok"] and "reactive oracle" in cost[0]["detail"]


def test_every_policy_keeps_to_the_pools_replica_bounds():
    """The baselines are held to the pool's minReplicas and maxReplicas as tandem's policy is (they once
    ran 16 + 16 replicas in a pool capped at 8 prefill replicas)."""
    from tandem.operator.spec import load_manifest
    sc = S.build("step", PERF, 0)
    m = S.manifest(sc)
    m["spec"]["prefill"]["autoscaling"]["maxReplicas"] = 4
    m["spec"]["decode"]["autoscaling"]["maxReplicas"] = 5
    spec = load_manifest(m).spec
    assert R.replica_bounds(spec)["prefill"][1] == 4
    for name in ("tandem", "hpa-queue", "hpa-slo", "apa", "kpa", "dynamo", "oracle", "oracle-reactive"):
        knobs = R.load_tuned()["step"].get(name)
        if name == "dynamo":   # the bounds do not depend on the forecast; auto-ARIMA costs 10-30 s a run
            knobs = {**knobs, "load_predictor": "constant"}
        _, fleet = R.run_one(name, sc, PERF, CAL, knobs, spec=spec)
        assert max(x["prefill"] for x in fleet.timeline) <= 4 and max(x["decode"] for x in fleet.timeline) <= 5, name


def test_the_oracle_keeps_its_fleet_while_the_last_requests_finish():
    """Past the trace's last minute the oracle keeps that minute's fleet: sized to the minimum, it
    drained decode replicas under running streams and missed its TPOT in the leftover seconds."""
    sc = S.build("step", PERF, 0)
    _, fleet = R.run_one("oracle", sc, PERF, CAL, R.load_tuned()["step"]["oracle"])
    last = [x for x in fleet.timeline if x["t"] >= S.DURATION - 60]
    assert min(x["decode"] for x in last) > 1 and min(x["prefill"] for x in last) > 1, last


def test_scale_to_zero_and_wake_in_the_simulator():
    """A pool with scaleToZero goes to 0 over an idle gap (the idle signal), the router queues the next
    requests, the policy wakes both roles and every request is served."""
    from tandem.operator.autoscaler.policy import Autoscaler
    from tandem.operator.spec import load_manifest
    sc = S.build("step", PERF, 0)
    m = S.manifest(sc)
    m["spec"]["autoscaling"]["scaleToZero"] = True
    for role in ("prefill", "decode"):
        m["spec"][role]["autoscaling"]["minReplicas"] = 0
    spec = load_manifest(m).spec
    records = [r for r in sc.records if r["timestamp"] < 120] + \
              [dict(r, timestamp=r["timestamp"] + 1500) for r in sc.records if r["timestamp"] < 30]
    fleet = R.simulate(Autoscaler(spec, CAL), records, PERF, sc.targets, {"prefill": 2, "decode": 2}, 2100.0)
    counts = [(x["t"], x["prefill"], x["decode"]) for x in fleet.timeline]
    assert any(p == 0 and d == 0 for t, p, d in counts if 600 < t < 1500), counts
    assert any(d.prefill.signal == "idle" for d in fleet.decisions)
    woken = [d for d in fleet.decisions if "woken" in d.prefill.reason]
    assert woken and woken[0].at >= 1500 and "woken" in woken[0].decode.reason
    assert all(r.finish == r.finish for r in fleet.requests)   # no NaN: every request finished
    late = [r for r in fleet.requests if r.arrival >= 1500]
    assert min(r.ttft for r in late) >= S.STARTUP_S - 30   # they waited for a replica to start (arrivals span 30 s)


def test_a_prefill_step_batches_the_prompts_waiting_at_its_start():
    """The simulated prefill replica runs engine steps: the prompts queued behind a running step go
    into the next step together (up to the token budget), and their first tokens come at its end."""
    from tandem.operator.simulate.baselines import Static
    from tandem.operator.simulate.fleet import Fleet
    records = [{"timestamp": t, "prompt_tokens": 128, "output_tokens": 4} for t in (0.0, 0.01, 0.02)]
    one, two = PERF.remote_prefill_seconds(128), PERF.remote_prefill_batch_seconds([128, 128])
    assert one < two < 2 * one
    fleet = Fleet(PERF, Static(1, 1), records, {"prefill": 1, "decode": 1}, duration=10.0).run()
    assert [r.first_token for r in fleet.requests] == pytest.approx([one, one + two, one + two])
    # a budget that holds one prompt: one prompt a step, first come, first served
    fleet = Fleet(PERF, Static(1, 1), records, {"prefill": 1, "decode": 1}, duration=10.0,
                  max_batched_tokens=200).run()
    assert [r.first_token for r in fleet.requests] == pytest.approx([one, 2 * one, 3 * one])


def test_the_cost_yardstick_is_the_cheapest_reactive_setting_at_the_same_attainment():
    """Issue 25's cost aim: tandem's GPU-hours against the reactive oracle's cheapest setting that reaches
    tandem's attainment, capped at the 95% aim (a policy above the aim is held to what meeting it costs)."""
    def point(att, gpu_h, u):
        return {"attainment_ttft": att, "attainment_tpot": 1.0, "gpu_hours": gpu_h, "knobs": {"utilization": u}}
    pts = [point(0.90, 8.0, 2.0), point(0.96, 10.0, 1.0), point(0.99, 12.0, 0.8)]
    assert R.reactive_yardstick(pts, 0.99)["gpu_hours"] == 10.0      # capped at the aim
    assert R.reactive_yardstick(pts, 0.92)["gpu_hours"] == 10.0
    assert R.reactive_yardstick(pts, 0.85)["gpu_hours"] == 8.0
    assert R.reactive_yardstick(pts[:1], 0.95) is None
    tab = {"s": {p: point(0.97, 11.0, 1.0) for p in R.POLICIES}}
    row = [r for r in R.aims(tab, {"s": pts}) if r["aim"] == R.COST_AIM]
    assert [r["ok"] for r in row] == [True] and "x1.10" in row[0]["detail"]
    tab["s"]["tandem"] = point(0.97, 11.2, 1.0)
    assert not [r for r in R.aims(tab, {"s": pts}) if r["aim"] == R.COST_AIM][0]["ok"]
    assert R.COST_AIM not in {r["aim"] for r in R.aims(tab)}    # no frontier, no cost aim
    # held to the pool's behavior, the oracle can be the cheaper: the yardstick is the cheaper of the two
    held = [{**point(0.96, 9.0, 1.5), "policy": R.BEHAVED}]
    both = R.yardsticks({"s": pts}, {"s": held})
    assert R.reactive_yardstick(both["s"], 0.97)["gpu_hours"] == 9.0
    row = [r for r in R.aims(tab, both) if r["aim"] == R.COST_AIM][0]
    assert not row["ok"] and "held to the behavior at utilization 1.5" in row["detail"], row


def test_an_aim_only_the_oracle_held_to_the_behavior_reaches_is_tandems_own():
    """``run.reach`` the other way round (twenty-first session): no plain setting of the reactive oracle
    meets the SLO, one held to the pool's scaling behavior does (its scale-down window kept the replicas
    the next rise needed); the miss is then tandem's own (``run.is_own``), and the verdict names the
    setting. Without the held frontier it stays out of reach."""
    def point(att, gpu_h, u, policy="oracle-reactive"):
        return {"attainment_ttft": att, "attainment_tpot": 1.0, "gpu_hours": gpu_h, "knobs": {"utilization": u},
                "policy": policy}
    tab = {"s": {"tandem": point(0.93, 16.0, 1.0, "tandem")}}
    plain = {"s": [point(0.90, 20.0, 0.6), point(0.85, 14.0, 1.0)]}
    held = {"s": [point(0.95, 23.0, 0.6, R.BEHAVED), point(0.90, 15.0, 1.0, R.BEHAVED)]}
    aim = "attainment >= 95% (TTFT and TPOT)"
    assert R.reach(tab, plain)[("s", aim)] == "out of reach"
    v = R.reach(tab, plain, held)[("s", aim)]
    assert R.is_own(v) and v.startswith(R.HELD_REACHABLE) and "utilization 0.6" in v and "23.00" in v, v
    assert not R.is_own(R.reach(tab, plain)[("s", aim)])
    assert R.reach(tab, plain, {}) == R.reach(tab, plain)   # a scenario with no held frontier: plain alone


def test_knobs_are_kept_per_calibration_and_the_table_runs_only_what_was_tuned():
    """Issue 25: knobs tuned on another calibration live beside tuned.json under that calibration's name,
    and the table leaves out a baseline nobody tuned there instead of running it at its defaults."""
    assert R.tuned_file() == R.TUNED_FILE
    other = R.tuned_file("bench/calibrations/llama3-8b-h200.yaml")
    assert other.parent == R.TUNED_FILE.parent and other.name == "tuned-llama3-8b-h200.json"
    static = R.load_tuned()["output-shift"]["static"]
    tab = R.table(PERF, CAL, {"output-shift": {"static": static}}, 0, ["output-shift"])
    assert set(tab["output-shift"]) == {"tandem", "static"}
    rows = R.aims(tab)
    assert {r["aim"] for r in rows if r["scenario"] == "all"} == {
        f"static fails somewhere (SLO, or GPU-h > {R.COST_FACTOR:g}x reactive oracle)"}
    assert "beats static" in {r["aim"] for r in rows} and "beats hpa-slo" not in {r["aim"] for r in rows}
