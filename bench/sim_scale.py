"""How fast the fleet simulator runs: simulated seconds per wall second against fleet size, and the time of
tandem's ``Autoscaler.decide`` per tick at 200 replicas (issue 25: one hour at 100 requests/s on 100+
replicas in at most 120 s on one core; decide under 5 ms per tick).

    PYTHONSAFEPATH=1 .venv/bin/python bench/sim_scale.py [--duration 3600] [--rate 100] [--sizes 50,100,200]

The trace: ``tandem bench trace diurnal`` at ``--rate`` requests/s (amplitude 0.3), median prompt 1024 and
output 128 tokens, log-normal sigma 0.5, with 64 prefix groups mapped to 512-token hash_ids blocks so
that the prefix cache and the router's prefix affinity do their work; the calibration is the derived
Llama-3-8B H200 one. Each fleet size N runs a static fleet of N/2 prefill and N/2 decode replicas
(the policy's own cost is measured apart), one process, one core. CPU s is the process's CPU time
(time.process_time), which other work on a shared machine does not inflate; wall s is beside it.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate.baselines import Static
from tandem.operator.simulate.fleet import Fleet
from tandem.worker.api.calibration import Calibration
from tandem.worker.bench.trace import generate

CAL = Path(__file__).resolve().parent / "calibrations" / "llama3-8b-h200.yaml"


def trace(duration: float, rate: float, seed: int = 0) -> list[dict]:
    _, recs = generate("diurnal", duration=duration, rate=rate, prompt_tokens=1024, output_tokens=128, sigma=0.5,
                       amplitude=0.3, seed=seed, prefix_groups=64)
    for i, r in enumerate(recs):
        # the group's 2 shared blocks, then the request's own (ids above every group's)
        g = r.pop("prefix_group")
        blocks = math.ceil(r["prompt_tokens"] / 512)
        r["hash_ids"] = [2 * g, 2 * g + 1][:blocks] + [10**6 + 64 * i + k for k in range(max(0, blocks - 2))]
    return recs


def time_decide(cal: Calibration, replicas: int = 200, ticks: int = 200) -> tuple[float, float]:
    """(CPU, wall) mean seconds of one ``Autoscaler.decide`` on a pool of ``replicas`` (half per role) at
    steady load."""
    from tandem.operator.autoscaler.policy import Autoscaler
    from tandem.operator.autoscaler.snapshot import PoolSnapshot, RoleSnapshot
    from tandem.operator.simulate import scenarios as S
    from tandem.operator.spec import load_manifest
    perf = PerfModel.of(cal)
    sc = S.Scenario("bench", [], {}, *S.slo(perf, 1024, 128), 1.0, [])
    spec = load_manifest(S.manifest(sc, max_replicas=replicas)).spec
    pol = Autoscaler(spec, cal)
    half = replicas // 2
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(ticks):
        pre = RoleSnapshot("prefill", "ok", 30.0, 100.0, 100.0 * 1024, 0.0, 20.0, 5.0, 0.0, sc.ttft_target * 0.8,
                           half, 0, 0)
        dec = RoleSnapshot("decode", "ok", 30.0, 100.0, 0.0, 100.0 * 127, 1200.0, 0.0, 0.0, sc.tpot_target * 0.9,
                           half, 0, 0)
        pol.decide(PoolSnapshot(15.0 * (k + 1), pre, dec, 0, False))
    return (time.process_time() - c0) / ticks, (time.perf_counter() - t0) / ticks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--sizes", default="50,100,200")
    args = ap.parse_args()
    cal = Calibration.load(CAL)
    perf = PerfModel.of(cal)
    recs = trace(args.duration, args.rate)
    print(f"trace: {len(recs)} requests over {args.duration:g} s ({args.rate:g} req/s mean), calibration {CAL.name}")
    print("| replicas (P+D) | CPU s | wall s | simulated s / CPU s | requests / CPU s | p90 TTFT s | p90 TPOT s | "
          "cache hit share |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",") if x):
        t0, c0 = time.perf_counter(), time.process_time()
        f = Fleet(perf, Static(n // 2, n - n // 2), recs, {"prefill": n // 2, "decode": n - n // 2},
                  duration=args.duration, block_tokens=512).run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        import numpy as np
        ttft = np.nanpercentile([r.ttft for r in f.requests], 90)
        tpot = np.nanpercentile([r.tpot for r in f.requests], 90)
        hit = sum(r.cached for r in f.requests) / sum(r.prompt for r in f.requests)
        print(f"| {n // 2}+{n - n // 2} | {cpu:.1f} | {wall:.1f} | {args.duration / cpu:.0f} | {len(recs) / cpu:.0f} | "
              f"{ttft:.3f} | {tpot:.4f} | {hit:.1%} |", flush=True)
    cpu, wall = time_decide(cal)
    print(f"\nAutoscaler.decide at 200 replicas (100 per role): {cpu * 1e3:.2f} ms CPU, {wall * 1e3:.2f} ms wall "
          "per tick (mean of 200)")


if __name__ == "__main__":
    main()
