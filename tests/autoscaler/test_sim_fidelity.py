"""The simulator's fleet where it decides outcomes (issue 25): KV capacity per decode replica, the prefix
cache from a trace's hash_ids with the router's prefix affinity, the router's queue as the real router
has it, and the decode token clock that advances in spans between events. Small hand-made traces on the
derived H200 calibration; every expected figure is computed from the calibration by hand here."""
from pathlib import Path

import pytest

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate.baselines import Static
from tandem.operator.simulate.fleet import Fleet
from tandem.worker.api.calibration import Calibration

pytestmark = pytest.mark.timeout(180)
CAL_PATH = Path(__file__).resolve().parents[2] / "bench/calibrations/llama3-8b-h200.yaml"
CAL = Calibration.load(CAL_PATH)
PERF = PerfModel.of(CAL)


def _run(records, p=1, d=1, **kw):
    return Fleet(PERF, Static(p, d), records, {"prefill": p, "decode": d}, duration=30.0, **kw).run()


def _rec(t, prompt, output, ids=None):
    r = {"timestamp": t, "prompt_tokens": prompt, "output_tokens": output}
    if ids is not None:
        r["hash_ids"] = ids
    return r


def test_a_full_decode_replica_queues_the_next_sequence_until_one_finishes():
    """Two sequences whose KV does not fit together: the second starts decoding when the first ends (its
    TPOT counts the wait); with room for both they decode side by side. The default capacity is the
    calibration's num_blocks x block_size."""
    recs = [_rec(0.0, 1000, 100), _rec(0.001, 1000, 100)]
    roomy = _run(recs)
    assert roomy.kv_tokens == CAL.engine["num_blocks"] * CAL.engine["block_size"]
    a, b = roomy.requests
    assert b.finish - b.first_token == pytest.approx(a.finish - a.first_token, rel=0.2)
    tight = _run(recs, kv_tokens=1500)
    a2, b2 = tight.requests
    assert a2.finish == pytest.approx(a.finish, rel=0.2)
    assert b2.finish >= a2.finish + 99 * PERF.decode_step_seconds(1, 1000) * 0.99   # it waited, then ran alone
    assert b2.tpot > 1.8 * b.tpot


def test_shared_prefix_blocks_are_not_prefilled_again():
    """The second request of a prefix (two 512-token blocks cached from the first) computes only its
    own tokens: its prefill is the calibration's a + b*n + c*n^2 + d*n*k at n = 1376, k = 1024. A third
    whose blocks the decode replica holds at least half of prefills there (the router's decode_cached
    rule), also from the cache."""
    recs = [_rec(0.0, 2400, 2, [7, 8, 9, 11, 12]), _rec(1.0, 2400, 2, [7, 8, 20, 21, 22]),
            _rec(2.0, 1124, 2, [7, 8, 30])]
    f = _run(recs)
    first, second, third = f.requests
    assert [r.cached for r in f.requests] == [0, 1024, 1024] and [r.local for r in f.requests] == [False, False, True]
    assert first.ttft == pytest.approx(PERF.remote_prefill_seconds(2400), rel=1e-6)
    assert second.ttft == pytest.approx(PERF.cached_prefill_seconds(2400, 1024), rel=1e-6)
    assert second.ttft < 0.7 * first.ttft
    assert third.ttft == pytest.approx(PERF.cached_prefill_seconds(1124, 1024), rel=1e-6)


def test_the_router_sends_a_prefix_to_the_replica_that_caches_it():
    """Prefix affinity within the load bound: with two prefill replicas, the request sharing the first
    one's blocks goes there (a cache hit), the unrelated one goes to the least loaded; without hash_ids
    the router balances by requests in flight."""
    recs = [_rec(0.0, 1100, 2, [1, 2, 3]), _rec(0.5, 600, 2, [50, 51]), _rec(1.0, 1100, 2, [1, 2, 4]),
            _rec(1.5, 1100, 2, [60, 61, 62])]
    f = _run(recs, p=2)
    assert [r.cached for r in f.requests] == [0, 0, 1024, 0]
    # the same trace with the ids shuffled between two replicas' caches: no hit when the ids differ
    recs[2]["hash_ids"] = [9, 2, 4]
    assert _run(recs, p=2).requests[2].cached == 0


def test_the_router_queues_only_without_a_ready_decode_replica():
    """As the real router: with no ready decode replica the request waits in the router's queue (the
    scale-from-zero signal); with decode ready but no prefill replica the decode replica prefills it
    (no_prefill_worker), it does not wait."""
    f = Fleet(PERF, Static(0, 1), [_rec(0.0, 512, 4)], {"prefill": 0, "decode": 1}, duration=30.0).run()
    (r,) = f.requests
    assert r.local and r.ttft == pytest.approx(PERF.cached_prefill_seconds(512), rel=1e-6)
    f = Fleet(PERF, Static(1, 0), [_rec(0.0, 512, 4)], {"prefill": 1, "decode": 0}, duration=30.0)
    f._on_arrive(0.0, 0)
    assert f.router_queue == [0]


def test_the_decode_token_clock_matches_step_by_step_accounting():
    """Sequences joining and leaving one decode replica: every generated token is counted once, and a
    sequence alone decodes at the batch-1 step of its context; with three at once the span's step is the
    batch-3 step of the mean context."""
    recs = [_rec(0.0, 512, 50), _rec(0.0, 512, 50), _rec(0.0, 512, 50), _rec(5.0, 2048, 20)]
    f = _run(recs, p=3)
    assert f.generated == pytest.approx(sum(r["output_tokens"] - 1 for r in recs), rel=1e-6)
    a = f.requests[0]
    assert a.tpot == pytest.approx(PERF.decode_step_seconds(3, 513), rel=1e-6)
    last = f.requests[3]
    assert last.tpot == pytest.approx(PERF.decode_step_seconds(1, 2049), rel=1e-6)


def test_simulate_an_imported_trace_as_a_user_would(tmp_path):
    """`tandem simulate --trace IMPORTED --calibration llama3-8b-h200.yaml` without a pool: the SLOs
    come from the trace's p90 lengths (scenarios.trace_slo), every baseline is tuned on the trace's
    first half and its knobs kept in --tuned, which a second run reads instead of tuning again."""
    import json
    import os
    import subprocess
    import sys

    from tandem.operator.simulate import scenarios as S
    from tandem.worker.bench.trace import read_trace
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    cli = [sys.executable, "-m", "tandem.worker.cli"]
    data = Path(__file__).resolve().parents[1] / "bench" / "data" / "mooncake_small.jsonl"
    trace = tmp_path / "m.jsonl"
    r = subprocess.run(cli + ["bench", "trace", "import", "--format", "mooncake", str(data), "-o", str(trace),
                              "--scale", "20"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    run = cli + ["simulate", "--trace", str(trace), "--calibration", str(CAL_PATH), "--json", "--tuned",
                 str(tmp_path / "k.json"), "--write-pool", str(tmp_path / "pool.yaml")]
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tuning the baselines on the trace's first half" in r.stderr
    out = json.loads(r.stdout)
    ttft, tpot = S.trace_slo(PERF, read_trace(trace)[1])
    assert out["targets"] == {"ttft_p90_s": pytest.approx(ttft), "tpot_p90_s": pytest.approx(tpot)}
    knobs = json.loads((tmp_path / "k.json").read_text())
    # the file records what its knobs were tuned for, and a run for something else says so
    assert knobs.pop("_tuned_on") == {"calibration": CAL_PATH.name, "ttft_p90_s": pytest.approx(ttft),
                                      "tpot_p90_s": pytest.approx(tpot), "input": "the trace's first half"}
    assert set(knobs) == set(out["results"]) - {"tandem"} and {"hpa-slo", "kpa", "dynamo"} <= set(knobs)
    assert all(out["results"][n]["knobs"] == k for n, k in knobs.items() if n != "static")
    assert out["knobs_source"] == f"tuned on the trace's first half, kept in {tmp_path / 'k.json'}"
    r2 = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert r2.returncode == 0 and "tuning" not in r2.stderr
    assert json.loads(r2.stdout)["results"] == out["results"]
    assert json.loads(r2.stdout)["knobs_source"] == f"read from {tmp_path / 'k.json'}"
    other = Path(__file__).resolve().parents[2] / "bench/calibrations/smollm2-cpu-scenarios.yaml"
    r5 = subprocess.run(run[:-6] + [str(other), "--json", "--tuned", str(tmp_path / "k.json"), "--policy", "static"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert r5.returncode == 0 and "was tuned for" in r5.stderr and "smollm2-cpu-scenarios.yaml" in r5.stderr, \
        r5.stderr[-500:]
    assert "was tuned for" not in r2.stderr
    # a bad --tuned file, or one that could not be written, is a one-line error before anything runs
    # (they were tracebacks, the last one after the minutes of tuning)
    for text, says in (("{bad", "not a JSON file"), ("[]", "must be a JSON object"),
                       ('{"nope": {}}', "nope: unknown policy"), ('{"kpa": 3}', "kpa: the knobs must be"),
                       ('{"static": {"bogus": 1}}', "static: bad knobs"),
                       ('{"static": {"prefill": "x", "decode": 1}}', "static: bad knobs")):
        (tmp_path / "bad.json").write_text(text)
        r3 = subprocess.run(run[:-4] + ["--tuned", str(tmp_path / "bad.json")], capture_output=True, text=True,
                            env=env, timeout=120)
        assert r3.returncode == 2 and "error: --tuned" in r3.stderr and says in r3.stderr, (text, r3.stderr[-500:])
        assert "Traceback" not in r3.stderr
    r4 = subprocess.run(run[:-4] + ["--tuned", str(tmp_path / "no" / "k.json")], capture_output=True, text=True,
                        env=env, timeout=120)
    assert r4.returncode == 2 and "no such directory" in r4.stderr, r4.stderr[-500:]


def test_the_text_output_notes_oracles_that_miss_where_a_peer_meets_the_slo():
    """On a bursty trace the plain oracles can miss the SLOs that a peer meets (the Azure code trace x10:
    the reactive oracle at 1.8% TTFT, static at 100%); the text output then says why, and says nothing
    where every policy misses (a trace of a few seconds) or the oracles meet them."""
    from tandem.operator.simulate.cli import _yardstick_note

    def res(ttft, tpot):
        return {"attainment_ttft": ttft, "attainment_tpot": tpot}
    note = _yardstick_note({"tandem": res(0.98, 1.0), "static": res(1.0, 1.0), "oracle": res(0.736, 0.962),
                            "oracle-reactive": res(0.018, 0.807)})
    assert "oracle and oracle-reactive miss the SLOs here where tandem, static meet them" in note
    assert _yardstick_note({"tandem": res(1.0, 0.0), "oracle": res(1.0, 0.0)}) == ""
    assert _yardstick_note({"tandem": res(0.98, 1.0), "oracle": res(0.96, 0.97)}) == ""
