"""How far the decode model's capacity is from the simulator's, by pool size (issue 25: whether one
learned capacity factor per role can be right at every size; docs/autoscaler.md, "The factor learned
at the peak, used at the trough").

    PYTHONSAFEPATH=1 .venv/bin/python bench/decode_capacity_by_size.py \
        [--calibration bench/calibrations/smollm2-cpu-scenarios.yaml] [--counts 2,3,4,5,6,8,11,16] \
        [--duration 3600] [--seed 3]

For each decode count c, a static fleet (c decode replicas, prefill ample at 4c + 8 so that prefill
queues nowhere) serves steady Poisson load with the scenarios' length distributions and SLOs
(operator/simulate/scenarios.py). The table gives the most load (prompts/s, by bisection) at which the
p90 TPOT meets its target in at least 95% of minutes, the most that ``PerfModel.decode_replicas`` sizes
c replicas for (capacity factor 1, no headroom, the policy's decode hold at its default share of the
prefill service), and their ratio: the capacity factor that would be right at that size. The
simulator is deterministic, so the figures repeat on any machine.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.policy import Autoscaler
from tandem.operator.simulate import baselines as B
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.worker.api.calibration import Calibration
from tandem.worker.bench.trace import generate

CAL = Path(__file__).resolve().parent / "calibrations" / "smollm2-cpu-scenarios.yaml"
AIM = R.ATTAINMENT_AIM


def steady(rate: float, duration: float, seed: int) -> list[dict]:
    _, recs = generate("step", duration=duration, rate=rate, at=duration / 2, to_rate=rate,
                       prompt_tokens=S.PROMPT, output_tokens=S.OUTPUT, sigma=S.SIGMA, seed=seed)
    for r in recs:   # as scenarios.build clips them
        r["output_tokens"] = max(2, r["output_tokens"])
        r["prompt_tokens"] = min(r["prompt_tokens"], S.MAX_MODEL_LEN - r["output_tokens"])
    return recs


def attainment(perf, targets, records, c: int, duration: float) -> float:
    """The share of minutes whose p90 TPOT meets the target, c decode replicas."""
    counts = {"prefill": 4 * c + 8, "decode": c}
    fleet = R.simulate(B.Static(**counts), records, perf, targets, counts, duration)
    return R.summarize(fleet, targets, [], duration)["attainment_tpot"]


def most(ok, lo: float = 0.0, hi: float = 1.0, iters: int = 12) -> float:
    """The largest x in (lo, ...) with ok(x), by doubling ``hi`` then bisection (ok falls with x)."""
    while ok(hi):
        lo, hi = hi, 2 * hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=str(CAL))
    ap.add_argument("--counts", default="2,3,4,5,6,8,11,16")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    cal = Calibration.load(args.calibration)
    perf = PerfModel.of(cal)
    targets = S.build("step", perf, 1).targets
    share = Autoscaler.__init__.__kwdefaults__["hold_service_share"]
    print(f"calibration {args.calibration}; TPOT target {targets['decode']:.4f} s; {args.duration:.0f} s of "
          f"steady load per point, seed {args.seed}\n")
    print("| decode replicas | simulated: most prompts/s at >= 95% of minutes | model: most prompts/s | "
          "simulated / model |")
    print("|---|---|---|---|")
    for c in (int(x) for x in args.counts.split(",")):
        sim = most(lambda r: attainment(perf, targets, steady(r, args.duration, args.seed), c, args.duration)
                   >= AIM, hi=0.25 * c)
        recs = steady(max(sim, 0.05), args.duration, args.seed)
        prompt = sum(r["prompt_tokens"] for r in recs) / len(recs)
        output = sum(r["output_tokens"] for r in recs) / len(recs)
        ctx, hold = prompt + output / 2, share * perf.remote_prefill_seconds(prompt) / max(output, 1.0)
        model = most(lambda r: perf.decode_replicas(r * output, ctx, targets["decode"], 10 ** 5, hold) <= c,
                     hi=0.25 * c, iters=30)
        print(f"| {c} | {sim:.3f} | {model:.3f} | {sim / model:.2f} |", flush=True)


if __name__ == "__main__":
    main()
