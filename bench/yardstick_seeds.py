"""The cost yardstick's settings on many seeds: the reactive oracle (held to the pool's behavior, or plain)
at chosen utilizations, and tandem's policy at its defaults, on one scenario at each seed. It asks
whether a setting that is the cost aim's yardstick on one seed (its best setting there, chosen in
hindsight of that seed) meets the SLOs on the others, as a setting tuned on seed 1 has to
(docs/autoscaler-issue25.md, "The yardstick tuned where tandem is").

    PYTHONSAFEPATH=1 .venv/bin/python bench/yardstick_seeds.py step --seeds 0-9,15-20 \
        --settings 1.25,1.375,1.5 [--plain] [--calibration FILE] [--jobs 2]

Prints, per seed, each run's TTFT / TPOT attainment and GPU-hours (simulated, so any machine gives the
same), then per setting: on how many seeds it meets both SLOs (>= 95%), and tandem's GPU-hours over
its own on the seeds where both meet them (the cost aim allows 1.1x).
"""
from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.tune import DEFAULT_CALIBRATION, at_least_one
from tandem.worker.api.calibration import Calibration


def _one(job) -> dict:
    cal_path, name, seed, policy, u = job
    cal = Calibration.load(cal_path)
    perf = PerfModel.of(cal)
    return R.run_one(policy, S.build(name, perf, seed), perf, cal, None if u is None else {"utilization": u})[0]


def _seeds(text: str) -> list[int]:
    """``0-9,15-20`` -> [0, ..., 9, 15, ..., 20]."""
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=S.NAMES)
    ap.add_argument("--seeds", default="0-9,15-20", help="seeds, with ranges: 0-9,15-20")
    ap.add_argument("--settings", default="1.25,1.5", help="the oracle's utilizations, comma-separated")
    ap.add_argument("--plain", action="store_true", help="the plain reactive oracle, not the one held to the "
                                                         "pool's behavior")
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    ap.add_argument("--jobs", type=at_least_one, default=2, help="processes (default 2)")
    args = ap.parse_args()
    try:
        seeds, us = _seeds(args.seeds), [float(x) for x in args.settings.split(",")]
    except ValueError:
        ap.error("--seeds: integers and ranges (0-9,15-20); --settings: numbers (1.25,1.5)")
    policy = "oracle-reactive" if args.plain else R.BEHAVED
    runs = [("tandem", None)] + [(policy, u) for u in us]
    jobs = [(args.calibration, args.scenario, s, p, u) for s in seeds for p, u in runs]
    with ProcessPoolExecutor(args.jobs) as ex:
        ms = list(ex.map(_one, jobs))
    by = {(j[2], j[4]): m for j, m in zip(jobs, ms)}
    label = "held" if policy == R.BEHAVED else "plain"
    print(f"{args.scenario}, {args.calibration}; TTFT / TPOT attainment, GPU-hours\n")
    print("| seed | tandem | " + " | ".join(f"{label} u={u:g}" for u in us) + " |")
    print("|---" * (len(us) + 2) + "|")
    for s in seeds:
        cells = [f"{m['attainment_ttft']:.1%} / {m['attainment_tpot']:.1%}, {m['gpu_hours']:.2f}"
                 + (" *" if R.meets(m) else "") for m in (by[(s, None)], *(by[(s, u)] for u in us))]
        print(f"| {s} | " + " | ".join(cells) + " |")
    print("\n(* both SLOs met)\n")
    print("| run | seeds meeting both SLOs | tandem / it, where both meet them |")
    print("|---|---|---|")
    print(f"| tandem | {sum(R.meets(by[(s, None)]) for s in seeds)} of {len(seeds)} | |")
    for u in us:
        both = [s for s in seeds if R.meets(by[(s, u)]) and R.meets(by[(s, None)])]
        ratios = [by[(s, None)]["gpu_hours"] / by[(s, u)]["gpu_hours"] for s in both]
        span = f"x{min(ratios):.2f}-{max(ratios):.2f} (seeds {', '.join(map(str, both))})" if ratios else "none"
        print(f"| {label} u={u:g} | {sum(R.meets(by[(s, u)]) for s in seeds)} of {len(seeds)} | {span} |")


if __name__ == "__main__":
    main()
