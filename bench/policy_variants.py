"""tandem's policy with some knobs changed, against its shipped defaults, in the same run: on the fixed
scenarios of a calibration (the tuning seed is 1) and on the halves of an imported trace. The tool that
the "tried and not landed" entries of bench/RESULTS.md use, so that each is reproducible from the repo.

    PYTHONSAFEPATH=1 .venv/bin/python bench/policy_variants.py \
        --calibration bench/calibrations/smollm2-cpu-scenarios.yaml --scenarios all --seeds 1 \
        [--trace ../shared/traces/azure2023_code.csv --format azure --scale 10 [--fit-medians 256,10]] \
        [--jobs 2] \
        '{"headroom": 0.7}' '{"recurring_windows": 2}'

Each argument is a JSON object of ``Autoscaler`` keyword arguments (operator/autoscaler/policy.py); the
shipped defaults (``{}``) always run first. The table gives TTFT and TPOT attainment (the share of
minutes whose p90 meets the SLO), GPU-hours, and GPU-hours over the defaults' on the same input (the
simulator is deterministic, so every figure repeats on any machine); a second table gives each variant's
count of inputs where both SLOs reach 95%, and its GPU-hours over all of them. Trace halves are run as
bench/trace_table.py runs them (SLOs from the whole trace's p90 lengths, each half from its own start).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_table as T  # noqa: E402  (bench/ is not a package)

from tandem.operator.autoscaler.capacity import PerfModel  # noqa: E402
from tandem.operator.simulate import run as R  # noqa: E402
from tandem.operator.simulate import scenarios as S  # noqa: E402
from tandem.operator.simulate.tune import at_least_one  # noqa: E402
from tandem.worker.api.calibration import Calibration  # noqa: E402


def _scenario(job):
    cal_path, name, seed, knobs = job
    cal = Calibration.load(cal_path)
    perf = PerfModel.of(cal)
    m, _ = R.run_one("tandem", S.build(name, perf, seed), perf, cal, knobs)
    return m


def _trace(job):
    half, knobs = job
    return T._run(("tandem", knobs, half))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="JSON objects of Autoscaler keyword arguments")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--scenarios", default="", help="'all', or comma-separated names (default: none)")
    ap.add_argument("--seeds", default="1", help="comma-separated seeds for --scenarios (tuning: 1)")
    ap.add_argument("--trace", help="an Azure or Mooncake trace file; both halves are run")
    ap.add_argument("--format", default="azure")
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--fit-medians", default=None, metavar="PROMPT,OUTPUT",
                    help="the trace's lengths scaled to these medians, as bench/trace_table.py does (256,10 maps "
                         "it onto the CPU calibration)")
    ap.add_argument("--jobs", type=at_least_one, default=2, help="processes (default 2)")
    args = ap.parse_args()
    try:
        variants = [{}] + [json.loads(v) for v in args.variants]
    except json.JSONDecodeError as e:
        ap.error(f"a variant is not a JSON object: {e}")
    if any(not isinstance(v, dict) for v in variants):
        ap.error("each variant must be a JSON object, e.g. '{\"headroom\": 0.7}'")
    if any(not v for v in variants[1:]) or len({json.dumps(v, sort_keys=True) for v in variants}) < len(variants):
        ap.error("the defaults always run first: give each variant once, each with at least one knob")
    if any("startup_s" in v for v in variants):
        ap.error("startup_s is the scenarios' start-up (120 s), not a knob to vary here")
    names = list(S.NAMES) if args.scenarios == "all" else [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in S.NAMES]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(S.NAMES)}")
    if not names and not args.trace:
        ap.error("nothing to run: give --scenarios and/or --trace")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds: comma-separated integers, not {args.seeds!r}")
    medians = T.fit_medians(ap, args.fit_medians)
    t0 = time.time()
    rows = []   # (input label, variant, metrics)
    jobs = [(args.calibration, n, s, v) for v in variants for s in seeds for n in names]
    if jobs:
        with ProcessPoolExecutor(args.jobs) as ex:
            rows += [(f"{j[1]} seed {j[2]}", j[3], m) for j, m in zip(jobs, ex.map(_scenario, jobs))]
    if args.trace:
        init = (args.format, args.trace, args.scale, args.calibration, medians)
        tjobs = [(h, v) for v in variants for h in ("first", "second")]
        with ProcessPoolExecutor(args.jobs, initializer=T._setup, initargs=init) as ex:
            rows += [(f"{Path(args.trace).name} x{args.scale} {h} half", v, m)
                     for (h, v), m in zip(tjobs, ex.map(_trace, tjobs))]
    base = {label: m["gpu_hours"] for label, v, m in rows if v == {}}
    print(f"calibration {args.calibration}\n")
    print("| input | variant | TTFT att. | TPOT att. | GPU-h | GPU-h / defaults' |")
    print("|---|---|---|---|---|---|")
    for label in dict.fromkeys(label for label, _, _ in rows):
        for lab, v, m in rows:
            if lab == label:
                ratio = m["gpu_hours"] / base[label] if base[label] else float("nan")
                print(f"| {label} | {json.dumps(v) if v else 'defaults'} | {100 * m['attainment_ttft']:.1f}% | "
                      f"{100 * m['attainment_tpot']:.1f}% | {m['gpu_hours']:.2f} | x{ratio:.3f} |")
    # per variant over every input: how often both SLOs are met, and the GPU-hours in all (the held-out
    # seeds' check of docs/autoscaler-issue25.md, "Decode's probe at the cliff")
    total = sum(base.values())
    print("\n| variant | both SLOs met | GPU-h in all | / defaults' |")
    print("|---|---|---|---|")
    for v in variants:
        ms = [m for _, w, m in rows if w == v]
        gpu_h = sum(m["gpu_hours"] for m in ms)
        print(f"| {json.dumps(v) if v else 'defaults'} | {sum(R.meets(m) for m in ms)}/{len(ms)} | {gpu_h:.2f} | "
              f"x{gpu_h / total if total else float('nan'):.3f} |")
    print(f"\n({time.time() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
