"""How far each role's capacity model is from the simulator's, by pool size and calibration (issue 25:
whether one learned capacity factor per role can be right at every size, and how far each role's probe
must take it; docs/autoscaler-issue25.md, "The factor learned at the peak, used at the trough" for decode and
"Prefill's factor is a different error on each calibration" for prefill).

    PYTHONSAFEPATH=1 .venv/bin/python bench/capacity_by_size.py [--role decode|prefill] \
        [--calibration bench/calibrations/smollm2-cpu-scenarios.yaml] [--counts 2,3,4,6,8,11,16] \
        [--duration 3600] [--seed 3[,4...]] [--write]

For each count c of the role measured, a static fleet (c replicas of it; the other role ample: prefill
at 4c + 8 so that it queues nowhere, or decode at 3c + 8 so that TPOT and the decode replicas' KV never
hold a prompt back) serves steady Poisson load with the scenarios' length distributions and SLOs
(operator/simulate/scenarios.py). The table gives the most load (prompts/s, by bisection) at which the
role's p90 (TPOT or TTFT) meets its target in at least 95% of minutes, the most that the model sizes c
replicas for (capacity factor 1, no headroom), and their ratio: the capacity factor that would be right
at that size.
- decode: ``PerfModel.decode_replicas``, with the policy's decode hold at its default share of the
  prefill service.
- prefill: ``PerfModel.prefill_replicas`` (the M/G/c queue of the mean prompt's remote-prefill service),
  and both loads as utilization (erlangs per replica in that one-prompt service). A simulated replica,
  like the engine, prefills every prompt waiting at a step together up to its token budget, paying the
  step's fixed cost and the KV transfer's tail once, so its utilization can pass 1 where the model's
  cannot.
The simulator is deterministic, so the figures repeat on any machine.

``--write`` (prefill only) stores the median of the ratios over every count and seed in the
calibration file as ``capacity.prefill_factor`` (replacing a ``capacity`` section, keeping the rest of
the file as written): the autoscaler's capacity probe raises prefill's factor no further
(``Autoscaler._probe_top``). Rerun it whenever the calibration's fits change.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Callable, NamedTuple

import yaml

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.policy import Autoscaler
from tandem.operator.simulate import baselines as B
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.tune import DEFAULT_CALIBRATION
from tandem.worker.api.calibration import Calibration
from tandem.worker.bench.trace import generate

AIM = R.ATTAINMENT_AIM


class Role(NamedTuple):
    counts: str                       # the counts measured by default
    fleet: Callable[[int], dict]      # the static fleet for c replicas of the role (the other one ample)
    attainment: str                   # the run summary's attainment of the role's SLO
    per_replica: float                # the bisection's first upper bound, prompts/s per replica
    iters: int                        # the simulated bisection's iterations


ROLES = {"decode": Role("2,3,4,5,6,8,11,16", lambda c: {"prefill": 4 * c + 8, "decode": c},
                        "attainment_tpot", 0.25, 12),
         "prefill": Role("2,3,4,6,8,11,16", lambda c: {"prefill": c, "decode": 3 * c + 8},
                         "attainment_ttft", 0.5, 10)}


def steady(rate: float, duration: float, seed: int) -> list[dict]:
    _, recs = generate("step", duration=duration, rate=rate, at=duration / 2, to_rate=rate,
                       prompt_tokens=S.PROMPT, output_tokens=S.OUTPUT, sigma=S.SIGMA, seed=seed)
    for r in recs:   # as scenarios.build clips them
        r["output_tokens"] = max(2, r["output_tokens"])
        r["prompt_tokens"] = min(r["prompt_tokens"], S.MAX_MODEL_LEN - r["output_tokens"])
    return recs


def attainment(role: str, perf, targets, records, c: int, duration: float) -> float:
    """The share of minutes whose p90 of ``role`` meets its target, c replicas of it."""
    counts = ROLES[role].fleet(c)
    fleet = R.simulate(B.Static(**counts), records, perf, targets, counts, duration)
    return R.summarize(fleet, targets, [], duration)[ROLES[role].attainment]


def most(ok, lo: float = 0.0, hi: float = 1.0, iters: int = 12) -> float:
    """The largest x in (lo, ...) with ok(x), by doubling ``hi`` then bisection (ok falls with x)."""
    while ok(hi):
        lo, hi = hi, 2 * hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def model_row(role: str, perf, targets, recs, c: int, sim: float) -> tuple[str, float]:
    """The model's most load for c replicas of ``role`` at the measured load's lengths: (the table's
    row, simulated / model)."""
    prompt = sum(r["prompt_tokens"] for r in recs) / len(recs)
    hi = ROLES[role].per_replica * c
    if role == "prefill":
        s = perf.remote_prefill_seconds(prompt)
        model = most(lambda r: perf.prefill_replicas(r * s, s, targets["prefill"], 10 ** 5) <= c, hi=hi, iters=30)
        return (f"| {c} | {sim:.3f} | {model:.3f} | {sim / model:.2f} | {sim * s / c:.2f}, {model * s / c:.2f} |",
                sim / model)
    output = sum(r["output_tokens"] for r in recs) / len(recs)
    share = Autoscaler.__init__.__kwdefaults__["hold_service_share"]
    ctx, hold = prompt + output / 2, share * perf.remote_prefill_seconds(prompt) / max(output, 1.0)
    model = most(lambda r: perf.decode_replicas(r * output, ctx, targets["decode"], 10 ** 5, hold) <= c,
                 hi=hi, iters=30)
    return f"| {c} | {sim:.3f} | {model:.3f} | {sim / model:.2f} |", sim / model


def write_factor(path: str, factor: float, how: str) -> None:
    """Replace (or append) the calibration file's top-level ``capacity`` section, leaving every other
    line, comments included, as it was. Raises ValueError, before writing, when the result would not
    load as a calibration (a factor that is not a positive finite number)."""
    text = Path(path).read_text()
    block = f"capacity:\n  prefill_factor: {float(f'{factor:.3g}')!r}\n  measured: {json.dumps(how)}\n"
    pattern = re.compile(r"^capacity:.*\n?(?:[ \t].*\n?)*", re.M)
    text = pattern.sub(block, text) if pattern.search(text) else text.rstrip("\n") + "\n" + block
    Calibration.from_dict(yaml.safe_load(text))
    Path(path).write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=sorted(ROLES), default="decode")
    ap.add_argument("--calibration", help=f"a calibration file (default {DEFAULT_CALIBRATION})")
    ap.add_argument("--counts", help="comma-separated replica counts (default: the role's)")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--seed", default="3", help="a seed, or comma-separated seeds")
    ap.add_argument("--write", action="store_true",
                    help="store the median ratio in the calibration as capacity.prefill_factor (prefill only)")
    args = ap.parse_args()
    if args.write and args.role != "prefill":
        ap.error("--write stores prefill's factor: use it with --role prefill")
    if args.write and args.calibration is None:
        ap.error("--write rewrites the calibration file: name it with --calibration")
    args.calibration = args.calibration or str(DEFAULT_CALIBRATION)
    seeds = [int(x) for x in args.seed.split(",")]
    role = args.role
    spec = ROLES[role]
    perf = PerfModel.of(Calibration.load(args.calibration))
    # the scenarios' SLOs at their median lengths (scenarios.slo), without building a scenario: a
    # calibration whose peak rule asks for more requests than a trace holds has no scenario to build
    targets = dict(zip(("prefill", "decode"), S.slo(perf, S.PROMPT, S.OUTPUT)))
    metric = "TPOT" if role == "decode" else "TTFT"
    extra = " utilization: simulated, model |" if role == "prefill" else ""
    ratios = []
    for seed in seeds:
        print(f"calibration {args.calibration}; {metric} target {targets[role]:.4f} s; {args.duration:.0f} s of "
              f"steady load per point, seed {seed}\n")
        print(f"| {role} replicas | simulated: most prompts/s at >= 95% of minutes | model: most prompts/s | "
              f"simulated / model |{extra}")
        print("|---|---|---|---|" + ("---|" if extra else ""))
        for c in (int(x) for x in (args.counts or spec.counts).split(",")):
            sim = most(lambda r: attainment(role, perf, targets, steady(r, args.duration, seed), c, args.duration)
                       >= AIM, hi=spec.per_replica * c, iters=spec.iters)
            row, ratio = model_row(role, perf, targets, steady(max(sim, 0.05), args.duration, seed), c, sim)
            ratios.append(ratio)
            print(row, flush=True)
        print()
    median = statistics.median(ratios)
    print(f"median simulated / model over {len(ratios)} points: {median:.3f}")
    if args.write:
        how = (f"bench/capacity_by_size.py --role prefill --counts {args.counts or spec.counts} --duration "
               f"{args.duration:g} --seed {args.seed}: the median of {len(ratios)} ratios, "
               f"{min(ratios):.2f}-{max(ratios):.2f}")
        write_factor(args.calibration, median, how)
        print(f"wrote capacity.prefill_factor {median:.3g} to {args.calibration}")


if __name__ == "__main__":
    main()
