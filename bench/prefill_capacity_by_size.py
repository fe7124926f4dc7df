"""How far the prefill model's capacity is from the simulator's, by pool size and calibration (issue 25:
the capacity factor prefill's probe has to learn; docs/autoscaler.md, "Prefill's model ignores step
batching").

    PYTHONSAFEPATH=1 .venv/bin/python bench/prefill_capacity_by_size.py \
        [--calibration bench/calibrations/smollm2-cpu-scenarios.yaml] [--counts 2,3,4,6,8,11,16] \
        [--duration 3600] [--seed 3]

For each prefill count c, a static fleet (c prefill replicas, decode ample at 3c + 8 so that TPOT and
the decode replicas' KV never hold a prompt back) serves steady Poisson load with the scenarios' length
distributions and SLOs (operator/simulate/scenarios.py). The table gives the most load (prompts/s, by
bisection) at which the p90 TTFT meets its target in at least 95% of minutes, the most that
``PerfModel.prefill_replicas`` sizes c replicas for (the M/G/c queue of the mean prompt's remote-prefill
service; capacity factor 1, no headroom), their ratio (the capacity factor that would be right at that
size), and both loads as utilization (erlangs per replica in that one-prompt service). A simulated
replica, like the engine, prefills every prompt waiting at a step together up to its token budget,
paying the step's fixed cost and the KV transfer's tail once, so its utilization can pass 1 where the
model's cannot. The simulator is deterministic, so the figures repeat on any machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate import baselines as B
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.worker.api.calibration import Calibration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_capacity_by_size import AIM, CAL, most, steady  # noqa: E402


def attainment(perf, targets, records, c: int, duration: float) -> float:
    """The share of minutes whose p90 TTFT meets the target, c prefill replicas."""
    counts = {"prefill": c, "decode": 3 * c + 8}
    fleet = R.simulate(B.Static(**counts), records, perf, targets, counts, duration)
    return R.summarize(fleet, targets, [], duration)["attainment_ttft"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=str(CAL))
    ap.add_argument("--counts", default="2,3,4,6,8,11,16")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    perf = PerfModel.of(Calibration.load(args.calibration))
    targets = S.build("step", perf, 1).targets
    print(f"calibration {args.calibration}; TTFT target {targets['prefill']:.4f} s; {args.duration:.0f} s of "
          f"steady load per point, seed {args.seed}\n")
    print("| prefill replicas | simulated: most prompts/s at >= 95% of minutes | model: most prompts/s | "
          "simulated / model | utilization: simulated, model |")
    print("|---|---|---|---|---|")
    for c in (int(x) for x in args.counts.split(",")):
        sim = most(lambda r: attainment(perf, targets, steady(r, args.duration, args.seed), c, args.duration)
                   >= AIM, hi=0.5 * c, iters=10)
        recs = steady(max(sim, 0.05), args.duration, args.seed)
        s = perf.remote_prefill_seconds(sum(r["prompt_tokens"] for r in recs) / len(recs))
        model = most(lambda r: perf.prefill_replicas(r * s, s, targets["prefill"], 10 ** 5) <= c,
                     hi=0.5 * c, iters=30)
        print(f"| {c} | {sim:.3f} | {model:.3f} | {sim / model:.2f} | {sim * s / c:.2f}, {model * s / c:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
