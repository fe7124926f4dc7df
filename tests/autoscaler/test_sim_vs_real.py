"""The simulator against reality: a real one-replica fleet (`tandem up`-style: router, 1 prefill, 1 decode
worker of SmolLM2 on loopback), calibrated here with `tandem bench calibrate`'s code on a short grid
(the committed calibration was measured on another day's load of this shared machine), then replayed
with `tandem bench serve` at 30%, 60% and 80% of its capacity; the simulator, fed the same trace and
the fresh calibration, gives p90 TTFT and p90 TPOT within 30% of the measured ones.

Capacity: the fleet's prefill worker is its bottleneck (decode batches), so capacity is one request per
calibrated remote-prefill time of the trace's prompt length.

Runs only with TANDEM_SIM_VS_REAL=1. It takes about 6 minutes. The calibration takes the median of
3 repeats per point (``statistic="median"``): the fastest of 2, used before, ran 15-30% below the
replays on this shared VM, and one quiet run missed at every load that way. With the median, and the
KV transfer measured in rounds as well, three of five runs passed; the other two missed only on TTFT at
80% load (-31%, -32%). At 80% load a 6% longer service moves the p90 wait by about 45% (M/G/1), so
the bound needs the calibration right to ~5% during the replay, while this VM's step times move 10-25%
from minute to minute and the fleet shares its 2 cores with the load generator: too thin for CI here
(bench/RESULTS.md, seventh and ninth sessions; docs/autoscaler.md).

Before the batching change the real TPOT at 80% load was twice the simulated one. The cause was not
the cores the workers share. The engine prefills the waiting prompts in one step, so decode takes
them in groups and runs much larger batches than a one-prompt-a-step model predicts. Earlier runs
that failed at every load had a cause in this test: every run sent the same prompt texts, so later
runs hit the prefix cache."""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from fleet_utils import MODEL, start_fleet
from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate.baselines import Static
from tandem.operator.simulate.fleet import Fleet
from tandem.worker.bench.calibrate import calibrate
from tandem.worker.bench.trace import generate, write_trace

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TANDEM_SIM_VS_REAL") != "1",
                                 reason="a ~5 min measurement; set TANDEM_SIM_VS_REAL=1 (see the module docs)")]
PROMPT, OUTPUT = 128, 16
LEVELS = (0.3, 0.6, 0.8)
MIN_REQUESTS, MIN_SECONDS = 40, 60.0
TOLERANCE = 0.30


@pytest.fixture(scope="module")
def fleet():
    f = start_fleet(name="simreal")
    yield f
    f.stop(grace=10)


def _url(fleet, role):
    return next(p.url for p in fleet.procs if p.role == role)


def _serve(fleet, trace, out, seed):
    # a seed of its own per run: with one seed every run sends the same prompt texts, and the second run
    # found the first run's prompts in the prefix cache (80% of its TTFTs under one uncached prefill),
    # which the simulator, fed no cache hits, cannot know
    cmd = [sys.executable, "-m", "tandem.worker.cli", "bench", "serve", "--base-url", fleet.endpoint + "/v1",
           "--seed", str(seed), "--model", MODEL, "--endpoint", "completions", "--dataset", "trace",
           "--dataset-path", str(trace), "--prefix-len", "0", "--output-dir", str(out), "--no-progress", "--no-plots"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    # the one failure allowed: a stream whose every token was generated but decodes to no text (a random
    # prompt, ignore_eos, and special tokens after the end of text), which the bench counts as no_tokens
    # since it cannot time a first token; the load was applied all the same. Anything else fails here.
    failed = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines() if x.strip()]
    failed = [r for r in failed if r.get("status") == "error"]
    assert all(r["error_kind"] == "no_tokens" and r["completion_tokens"] == OUTPUT for r in failed), failed
    return json.loads((out / "summary.json").read_text())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (/proc/PID/stat), 0 when it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat's first line)."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = v[3] + v[4]
    return (sum(v) - idle) / os.sysconf("SC_CLK_TCK"), sum(v) / os.sysconf("SC_CLK_TCK")


def _cpu_use(fleet, before=None) -> dict:
    """CPU seconds per role of the fleet's processes and of the machine; with ``before``, the cores each
    used on average since then (the diagnosis of a miss: the simulator gives each role its own hardware)."""
    now = {p.role: _cpu_seconds(p.popen.pid) for p in fleet.procs}
    now["machine"], now["wall"] = _machine_busy()
    if before is None:
        return now
    wall = (now["wall"] - before["wall"]) / os.cpu_count()
    return {k: round((now[k] - before[k]) / wall, 2) for k in now if k != "wall"}


def _simulate(perf, records, duration):
    import numpy as np
    fleet = Fleet(perf, Static(1, 1), records, {"prefill": 1, "decode": 1}, duration=duration).run()
    ttft = np.array([r.ttft for r in fleet.requests])
    tpot = np.array([r.tpot for r in fleet.requests])
    return float(np.percentile(ttft, 90)), float(np.nanpercentile(tpot, 90))


def test_simulator_matches_a_real_fleet(fleet, tmp_path):
    decode = _url(fleet, "decode")
    cal = asyncio.run(calibrate(decode, MODEL, prefill_sizes=(32, 128, 256), cached=(128,), cached_sizes=(32,),
                                batches=(1, 2, 4, 8), contexts=(64, 192), decode_tokens=24, repeats=3,
                                pd_url=fleet.endpoint, pd_decode_url=decode, statistic="median"))
    assert "kv_transfer" in cal.fits
    cal.save(tmp_path / "calibration.yaml")   # beside the runs, for a look afterwards
    perf = PerfModel.of(cal)
    service = perf.remote_prefill_seconds(PROMPT)
    rows = []
    for level in LEVELS:
        rate = level / service
        duration = max(MIN_SECONDS, MIN_REQUESTS / rate)
        params, records = generate("step", duration, rate, PROMPT, OUTPUT, to_rate=rate, seed=int(level * 10))
        trace = tmp_path / f"trace-{level}.jsonl"
        write_trace(trace, "step", params, records)
        cpu0 = _cpu_use(fleet)
        real = _serve(fleet, trace, tmp_path / f"run-{level}", seed=int(level * 10))
        cores = _cpu_use(fleet, cpu0)
        sim_ttft, sim_tpot = _simulate(perf, records, duration)
        real_ttft, real_tpot = real["ttft_ms"]["p90"] / 1000, real["tpot_ms"]["p90"] / 1000
        rows.append({"load": level, "rate": round(rate, 3), "requests": len(records),
                     "real_ttft_p90": round(real_ttft, 3), "sim_ttft_p90": round(sim_ttft, 3),
                     "ttft_err": round(sim_ttft / real_ttft - 1, 3),
                     "real_tpot_p90": round(real_tpot, 4), "sim_tpot_p90": round(sim_tpot, 4),
                     "tpot_err": round(sim_tpot / real_tpot - 1, 3), "cores_used": cores})
    print("\ncalibration:", {k: f.quality() for k, f in cal.fits.items()}, "service", round(service, 3))
    for r in rows:
        print(r)
    bad = [r for r in rows if abs(r["ttft_err"]) > TOLERANCE or abs(r["tpot_err"]) > TOLERANCE]
    assert not bad, bad
