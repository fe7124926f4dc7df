"""`tandem bench serve` against a TEST DOUBLE (tests/bench/scripted_endpoint.py): a scripted
OpenAI-compatible endpoint whose delays, chunking and errors are known exactly, so the reported
numbers can be checked against values computed from the script, and which records when each request
arrived, so the open-loop schedule can be checked from the server's side."""
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from scipy import stats

from tandem.operator.local import free_port
from tandem.worker.bench.client import Target
from tandem.worker.bench.datasets import BenchRequest, Dataset
from tandem.worker.bench.metrics import summarize
from tandem.worker.bench.runner import LoadShape, run
from tandem.worker.bench.sweep import sweep

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent


def start_double(tmp_path, spec: dict):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(spec))
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "scripted_endpoint.py"), "--script", str(script),
                             "--port", str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, f"http://127.0.0.1:{port}"


def stop(proc):
    proc.terminate()
    proc.wait(10)


def dataset(keys, output_tokens) -> Dataset:
    return Dataset("scripted", {}, [BenchRequest(k, [{"role": "user", "content": k}], 7, n)
                                    for k, n in zip(keys, output_tokens)])


def split_point(values) -> float:
    """An SLO between two scripted values, at the widest gap in their middle half, so measurement
    noise cannot move a request across it."""
    v = np.sort(values)
    lo, hi = len(v) // 4, 3 * len(v) // 4
    i = lo + int(np.argmax(np.diff(v[lo:hi + 1])))
    return float(v[i] + v[i + 1]) / 2


def test_reported_numbers_match_the_script(tmp_path):
    rng = np.random.default_rng(3)
    script, expect = {}, []
    n_ok = 36
    for i in range(n_ok):
        n_chunks = int(rng.integers(3, 9))
        # some chunks claim 2-3 tokens at once: usage, not the chunk count, gives the output length
        chunk_tokens = [int(x) for x in rng.choice([1, 1, 2, 3], size=n_chunks)]
        # delays long enough that a few ms of scheduling noise on a busy CI machine stays far below 5%
        ttft = float(rng.uniform(0.3, 1.2))
        gaps = [float(g) for g in rng.uniform(0.08, 0.25, size=n_chunks - 1)]
        script[f"ok{i}"] = {"ttft": ttft, "gaps": gaps, "chunk_tokens": chunk_tokens,
                            "empty_before": [1, n_chunks - 1]}
        e2e = ttft + sum(gaps)
        out = sum(chunk_tokens)
        expect.append({"ttft": ttft, "tpot": (e2e - ttft) / (out - 1), "itl": gaps, "out": out})
    errors = {"e500a": {"error": "http_500", "error_after": 0.1}, "e500b": {"error": "http_500"},
              "e429": {"error": "http_429", "error_after": 0.05},
              "serr": {"error": "stream_error", "error_at": 2, "ttft": 0.1, "gaps": [0.05],
                       "chunk_tokens": [1, 1, 1, 1]},
              "drop": {"error": "disconnect", "error_at": 1, "ttft": 0.1, "gaps": [0.05],
                       "chunk_tokens": [1, 1, 1]}}
    script.update(errors)
    proc, url = start_double(tmp_path, {"requests": script})
    try:
        keys = list(script)
        ds = dataset(keys, [sum(script[k].get("chunk_tokens", [1])) for k in keys])
        slo = {"ttft": split_point([e["ttft"] for e in expect]), "tpot": split_point([e["tpot"] for e in expect])}
        # a constant rate, so each request's intended send time is known: i / rate
        rate = 8.0
        result = asyncio.run(run(Target(url, "m"), ds, LoadShape("constant", rate)))
        sent = requests.get(url + "/_arrivals", timeout=10).json()
    finally:
        stop(proc)
    s = summarize(result, slo, percentiles=(50, 90, 99))

    assert s["completed"] == n_ok and s["failed"] == len(errors)
    assert s["errors_by_kind"] == {"http_500": 2, "http_429": 1, "stream_error": 1, "incomplete": 1}
    assert s["output_tokens"] == sum(e["out"] for e in expect)
    assert s["completion_tokens_mismatch"] == 0

    # What the client should report is computed from when the double actually wrote each chunk (the
    # same run, the same CLOCK_MONOTONIC), not from the script, and the check allows for each chunk's
    # trip to the client as measured in this run: on a busy machine either process can be scheduled
    # tens of ms late (beside another pytest worker the ITL p99 came out 31% over the script, and 34%
    # over what the double sent: the client was the late one). A percentile moves by at most the
    # largest change of any one value, so with `lag` the largest gap between a chunk's send and its
    # receipt: TTFT and E2E are within lag, an ITL within 2 lag, a TPOT within 2 lag / (tokens - 1).
    # What this protects is the client's arithmetic (TTFT from the send, TPOT over usage tokens - 1,
    # ITL per content chunk, the run's span, goodput): a wrong definition misses by more than that
    # on a quiet machine (an off-by-one in TPOT's tokens by 7-30%).
    recs = {r.id: r for r in result.records}
    seen, lags = [], []
    for i, e in enumerate(expect):
        key, rec = f"ok{i}", recs[f"ok{i}"]
        times, end = sent["chunks_sent"][key], sent["ended"][key]
        assert len(times) == len(e["itl"]) + 1 == len(rec.token_times_mono)
        lags += [abs(got - at) for got, at in zip(rec.token_times_mono + [rec.end_mono], times + [end])]
        ttft, e2e = times[0] - rec.send_mono, end - rec.send_mono
        seen.append({"ttft": ttft, "e2e": e2e, "tpot": (end - times[0]) / (e["out"] - 1),
                     "itl": list(np.diff(times)), "out": e["out"], "end": end})
        # the double kept to its script: otherwise the SLO split below would not mean what it says
        assert times[0] - dict(sent["arrivals"])[key] >= script[key]["ttft"] - 0.002
    lag = max(lags) * 1000 + 1.0   # ms, and 1 ms for the clocks' reading order
    print(f"largest send-to-receipt gap {lag - 1.0:.1f} ms, median {np.median(lags) * 1000:.1f} ms")
    assert lag < 1000.0   # a clock mix-up (another clock, a lost chunk) shows as seconds

    def close(got, want, what, trip=0.0):
        assert abs(got - want) <= 0.01 * want + trip, \
            f"{what}: reported {got:.2f}, the double sent at {want:.2f} (allowed {trip:.1f} for the trip)"

    fewest = min(e["out"] for e in seen) - 1
    trip = {"ttft_ms": lag, "tpot_ms": 2 * lag / fewest, "itl_ms": 2 * lag, "e2e_ms": lag}
    for key, values in (("ttft_ms", [e["ttft"] for e in seen]), ("tpot_ms", [e["tpot"] for e in seen]),
                        ("itl_ms", [g for e in seen for g in e["itl"]]), ("e2e_ms", [e["e2e"] for e in seen])):
        for p in (50, 90, 99):
            close(s[key][f"p{p}"], float(np.percentile(values, p)) * 1000, f"{key} p{p}", trip[key])
        close(s[key]["mean"], float(np.mean(values)) * 1000, f"{key} mean", trip[key])
    # the run lasts from the first intended send to the last answer's end
    duration = max(e["end"] for e in seen) - result.start_mono
    span = lag / 1000 / duration   # the run's span is off by at most one trip
    close(s["duration_s"], duration, "duration", lag / 1000)
    # goodput counts the requests whose own (client-measured) TTFT and TPOT meet the SLO
    good = sum(1 for r in (recs[f"ok{i}"] for i in range(n_ok)) if r.ttft <= slo["ttft"] and r.tpot <= slo["tpot"])
    assert 0 < good < n_ok   # the SLO splits the requests, so the check means something
    for key, count in (("request_throughput", n_ok), ("output_throughput", sum(e["out"] for e in seen)),
                       ("goodput", good)):
        close(s[key], count / duration, key, count / duration * span * 1.01)
    assert s["slo_attainment"] == pytest.approx(good / len(keys), abs=1.5 / len(keys))


def arrivals_lag(tmp_path, rate: float, n: int):
    """One open-loop Poisson run against a double that holds every request 20 s: (lag at the server in
    ms per request, the double's arrival record, the run's result)."""
    # every request is held 20 s before its first token: 250 requests at 25/s arrive within ~10 s, so all
    # are open at once (aiohttp's default limit of 100 connections per client would hold 150 back)
    proc, url = start_double(tmp_path, {"default": {"ttft": 20.0, "gaps": [0.01], "chunk_tokens": [1, 1]}})
    try:
        ds = dataset([f"q{i}" for i in range(n)], [2] * n)
        result = asyncio.run(run(Target(url, "m", endpoint="completions"), ds, LoadShape("poisson", rate, seed=11)))
        seen = requests.get(url + "/_arrivals", timeout=10).json()
    finally:
        stop(proc)
    arrived = dict(seen["arrivals"])
    intended = {r.id: r.intended_mono for r in result.records}
    lag_ms = np.array([(arrived[k] - intended[k]) * 1000 for k in intended if k in arrived])
    return lag_ms, seen, result


def test_open_loop_arrivals_keep_the_schedule_with_a_slow_server(tmp_path):
    """Protects: the open loop sends on its schedule without waiting for answers. Every request is held
    20 s and the sends span about 10 s, so all 250 are open at the server at once only when no send
    waited for an answer (``max_open == n``); a client that waits (closed loop, or aiohttp's
    100-connection default holding requests 101-250 back) lags by 16 s or more. The lag bounds (p99 <=
    5,000 ms, max <= 8,000 ms) sit 2-3x below that and 2x or more above the worst a loaded 2-core machine
    measured: p99 2,462 ms, max 2,554 ms at twice this rate (50/s, 300 requests) in a CI run with three
    pytest-xdist workers, where the lag built up because the client's share of the CPU could not keep a
    50/s pace (p99 12.8-13.7 ms in serial runs; 570 ms beside one other xdist worker); at 25/s the client
    needs half that CPU. They test the loop, not the machine; the precise lag is a benchmark figure
    (bench/RESULTS.md), not a test's. That the sends form a Poisson process is tested on the schedule
    itself (a KS test of the 250 intended gaps, 40 ms mean): the gaps seen at the server carry the
    machine's scheduling noise (at 50/s a KS test of them noticed it, p = 0.001, with a p99 lag of 13.7
    ms); the lag bounds then say the server saw that schedule."""
    rate, n = 25.0, 250
    lag_ms, seen, result = arrivals_lag(tmp_path, rate, n)
    p99, worst = np.percentile(lag_ms, 99), lag_ms.max()
    print(f"p99 lag {p99:.1f} ms, max {worst:.1f} ms")
    arrived = dict(seen["arrivals"])
    assert len(arrived) == n and len(lag_ms) == n
    assert seen["max_open"] == n, f"{seen['max_open']} of {n} open at once (p99 lag {p99:.1f} ms)"
    assert p99 <= 5000.0, f"p99 lag {p99:.1f} ms"
    assert worst <= 8000.0, f"max lag {worst:.1f} ms"
    assert lag_ms.min() >= -1.0   # nothing went early
    gaps = np.diff(np.sort([r.intended_mono for r in result.records]))
    ks = stats.kstest(gaps, "expon", args=(0, 1 / rate))
    assert ks.pvalue > 0.01, ks
    s = summarize(result)
    assert s["failed"] == 0 and s["send_lag"]["count"] == n and s["send_lag"]["max_ms"] <= 8000.0


def test_closed_loop_holds_the_concurrency_and_has_no_send_lag(tmp_path):
    """Protects: a closed loop keeps exactly ``concurrency`` requests open, no more (the double's
    max_open) and no fewer (the wall time: 12 requests of ~0.5 s take 3 rounds, 1.5 s at the least; one
    at a time would take 6 s; the bound of 4.5 s is 3x the least, and a loaded 2-core machine adds tens
    of milliseconds a request)."""
    proc, url = start_double(tmp_path, {"default": {"ttft": 0.5, "gaps": [0.01], "chunk_tokens": [1, 1]}})
    try:
        ds = dataset([f"c{i}" for i in range(12)], [2] * 12)
        t0 = time.monotonic()
        result = asyncio.run(run(Target(url, "m"), ds, LoadShape(concurrency=4)))
        wall = time.monotonic() - t0
        seen = requests.get(url + "/_arrivals", timeout=10).json()
    finally:
        stop(proc)
    assert seen["max_open"] == 4
    assert 1.5 <= wall < 4.5     # 12 requests of ~0.51 s, 4 at a time: 3 rounds
    s = summarize(result)
    assert s["load"]["mode"] == "closed" and s["load"]["request_rate"] is None
    assert s["send_lag"]["count"] == 0 and "achieved_send_rate" not in s


def test_sweep_stops_at_saturation_and_reports_the_best_rate(tmp_path):
    # the double serves 2 requests at a time for ~0.1 s each: it saturates at ~20 requests/s
    proc, url = start_double(tmp_path, {"capacity": 2,
                                        "default": {"ttft": 0.06, "gaps": [0.02, 0.02], "chunk_tokens": [1, 1, 1]}})
    try:
        ds = dataset([f"s{i}" for i in range(20)], [3] * 20)

        async def run_one(shape):
            return await run(Target(url, "m"), ds, shape)

        # rates far past saturation: on a quiet machine it stops at 40 or 80/s; on a busy one the first
        # rate's TTFT is inflated and 20 requests' throughput is noisy, so it once went on to 160/s; by
        # 320-640/s the throughput is flat (~20/s) whatever the machine, so "stops by itself" is asserted
        # as stopping before the list runs out, above the double's capacity
        grid = [2.5, 5, 10, 40, 80, 160, 320, 640]
        res = asyncio.run(sweep(run_one, grid, LoadShape("poisson", seed=2), {"ttft": 0.3}))
    finally:
        stop(proc)
    rates = [p["load"]["request_rate"] for p in res["points"]]
    assert rates[:3] == [2.5, 5, 10] and len(rates) < len(grid), res["stopped"]
    assert res["stopped"] and ("TTFT" in res["stopped"] or "throughput" in res["stopped"])
    assert res["max_rate_meeting_slo"] in (5, 10)
    assert max(p["request_throughput"] for p in res["points"]) < 21
    from tandem.worker.bench.plots import sweep_plot
    sweep_plot(res["points"], tmp_path / "sweep.png", "saturable test double")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_client_sends_again_a_stream_that_broke_before_its_first_token(tmp_path):
    """Protects the chaos soak's client (Target.resend_s): a stream whose connection broke after its head
    but before any token or event id (a router killed between relaying its decode worker's head and the
    first event, once in seven clean-clone soaks) is sent afresh, since nothing would repeat; one that
    broke after a token is never sent afresh. The double drops the connection after the role chunk
    (``none``) or after one token (``one``): every time, or on the first arrival only (``*1``)."""
    from tandem.worker.bench.client import RequestRecord, send
    drop = {"error": "disconnect", "ttft": 0.05, "gaps": [0.02], "chunk_tokens": [1, 1, 1]}
    script = {"none": {**drop, "error_at": 0}, "one": {**drop, "error_at": 1}}
    script.update({k + "1": {**v, "error_times": 1} for k, v in script.items()})
    proc, url = start_double(tmp_path, {"requests": script})

    async def each(keys, resend_s):
        import aiohttp
        async with aiohttp.ClientSession() as s:
            return [await send(s, Target(url, "m", resend_s=resend_s, timeout=30), r,
                               RequestRecord(r.id, None, 0, False, None))
                    for r in dataset(keys, [3] * len(keys)).requests]
    try:
        always = asyncio.run(each(["none", "one"], 5.0))
        first = asyncio.run(each(["none1", "one1"], 5.0))
        seen = requests.get(url + "/_arrivals", timeout=10).json()
    finally:
        stop(proc)
    arrivals = [k for k, _ in seen["arrivals"]]
    none, one = always
    assert none.error_kind == "disconnected" and none.resends >= 2 and none.text == ""   # sent again until resend_s
    assert one.error_kind == "incomplete" and one.resends == 0 and one.text.strip() == "tok"
    assert arrivals.count("one") == 1
    none1, one1 = first
    assert none1.ok and none1.resends == 1 and none1.text.strip() == "tok tok tok"
    assert not one1.ok and one1.error_kind == "incomplete" and arrivals.count("one1") == 1
