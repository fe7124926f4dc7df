"""Every policy on an imported production trace in the simulator: the baselines tuned on the trace's first
half (the table's grids and rule), then every policy on the first half and, separately, the second half,
and issue 25's aims on each half, the cost aim judged and every miss checked against the reactive oracle
at every setting, plain and held to the pool's scaling behavior, as on the scenarios (``run.aims``,
``run.yardsticks``, ``run.reach``).

    PYTHONSAFEPATH=1 .venv/bin/python bench/trace_table.py --format azure ../shared/traces/azure2023_code.csv \
        --scale 40 --calibration bench/calibrations/llama3-8b-h200.yaml [--jobs 2] [--fit-medians 256,10]

The SLOs and maxReplicas come from the whole (scaled) trace (scenarios.trace_scenario: 3x the
single-request TTFT at the p90 prompt, 1.5x the single-request TPOT at the p90 context); each half runs
from 0 to its own end with the fleet the oracle's sizing gives its first minute, and a 120 s start-up.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.baselines import Oracle
from tandem.operator.simulate.tune import at_least_one
from tandem.operator.spec import load_manifest
from tandem.worker.api.calibration import Calibration
from tandem.worker.bench.trace_import import fit_lengths, import_trace

_STATE: dict = {}


def _setup(fmt, path, k, cal_path, medians=None):
    params, recs = import_trace(fmt, path, k=k)
    cal = Calibration.load(cal_path)
    if medians:
        # issue 25's mapping onto a calibration measured at shorter lengths (fit_lengths)
        lo, hi = cal.fits["prefill"].ranges()["n"]
        recs = fit_lengths(recs, *medians, prompt_range=(lo, hi),
                           max_len=float(cal.engine.get("max_model_len", math.inf)))
    perf = PerfModel.of(cal)
    sc = S.trace_scenario(perf, recs, "trace")
    half = params["duration"] / 2
    first = [r for r in recs if r["timestamp"] < half]
    second = [{**r, "timestamp": round(r["timestamp"] - half, 6)} for r in recs if r["timestamp"] >= half]
    _STATE.update(cal=cal, perf=perf, sc=sc, spec=load_manifest(S.manifest(sc)).spec,
                  halves={"first": (first, half), "second": (second, params["duration"] - half)},
                  block=params.get("block_tokens", 512))


def _run(job):
    name, knobs, half = job
    st = _STATE
    recs, dur = st["halves"][half]
    targets = st["sc"].targets
    minutes = S.minute_loads(recs, dur, st["perf"])
    pol = R.make_policy(name, st["spec"], st["perf"], st["cal"], targets, minutes, knobs)
    initial = dict(pol.counts) if name == "static" else Oracle(st["perf"], targets, minutes).need(minutes[0])
    fleet = R.simulate(pol, recs, st["perf"], targets, initial, dur, bounds=R.replica_bounds(st["spec"]),
                       block_tokens=st["block"])
    m = R.summarize(fleet, targets, [], dur)
    m["policy"], m["knobs"] = name, knobs or {}
    return m


def fit_medians(ap: argparse.ArgumentParser, text: Optional[str]) -> Optional[tuple]:
    """``--fit-medians PROMPT,OUTPUT`` as (prompt, output) median token counts, None when not given; an
    ``ap.error`` (exit 2) naming the option for anything but two numbers."""
    if not text:
        return None
    try:
        medians = tuple(float(x) for x in text.split(","))
    except ValueError:
        medians = ()
    if len(medians) != 2:
        ap.error(f"--fit-medians: PROMPT,OUTPUT token counts (got {text!r})")
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--format", required=True)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--jobs", type=at_least_one, default=2, help="processes (default 2)")
    ap.add_argument("--tuned-out", default=None, help="write the tuned knobs here (JSON)")
    ap.add_argument("--fit-medians", default=None, metavar="PROMPT,OUTPUT",
                    help="scale the trace's lengths to these median token counts, prompts clipped to the "
                         "calibration's measured range (issue 25's mapping onto the CPU calibration: 256,10)")
    args = ap.parse_args()
    t0 = time.time()
    medians = fit_medians(ap, args.fit_medians)
    init = (args.format, args.file, args.scale, args.calibration, medians)
    _setup(*init)
    sc = _STATE["sc"]
    if medians:
        print(f"lengths fitted to median prompt {medians[0]:g} and output {medians[1]:g} tokens", flush=True)
    print(f"{args.file} x{args.scale}: {sum(len(h[0]) for h in _STATE['halves'].values())} requests; SLO p90 TTFT "
          f"{sc.ttft_target:.3f} s, p90 TPOT {sc.tpot_target * 1e3:.2f} ms; maxReplicas {sc.max_replicas} per role",
          flush=True)
    bounds = R.replica_bounds(_STATE["spec"])
    with ProcessPoolExecutor(args.jobs, initializer=_setup, initargs=init) as ex:
        # tuning on the first half: every grid point, then the static fleet bisected per role
        names = [p for p in R.POLICIES if p in R.GRIDS]
        jobs = [(n, k, "first") for n in names for k in R.GRIDS[n]]
        res = list(ex.map(_run, jobs))
        tuned = {n: R._best([m for (p, _, _), m in zip(jobs, res) if p == n])["knobs"] for n in names}

        def least(role):
            lo, hi = max(1, bounds[role][0]), bounds[role][1]
            key = "attainment_ttft" if role == "prefill" else "attainment_tpot"

            def ok(c):
                counts = {r: bounds[r][1] for r in bounds}
                counts[role] = c
                return _run(("static", counts, "first"))[key] >= R.ATTAINMENT_AIM
            if not ok(hi):
                return hi
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
            return lo
        tuned["static"] = {r: least(r) for r in ("prefill", "decode")}
        print("tuned on the first half:", json.dumps(tuned), flush=True)
        if args.tuned_out:
            with open(args.tuned_out, "w") as f:
                json.dump(tuned, f, indent=1)
        jobs = [(p, tuned.get(p), h) for h in ("first", "second") for p in R.POLICIES]
        res = list(ex.map(_run, jobs))
        # the cost aim's yardsticks and run.reach's judges, as on the scenarios: the reactive oracle at
        # every setting of its grid, plain and held to the pool's scaling behavior, on each half
        judges = ("oracle-reactive", R.BEHAVED)
        fjobs = [(p, k, h) for h in ("first", "second") for p in judges for k in R.GRIDS[p]]
        fres = list(ex.map(_run, fjobs))
    tab = {}
    for (p, _, h), m in zip(jobs, res):
        tab.setdefault(f"{h} half", {})[p] = m
    front, held = {}, {}
    for (p, _, h), m in zip(fjobs, fres):
        (front if p == judges[0] else held).setdefault(f"{h} half", []).append(m)
    print(R.format_judgement(tab, front, held))
    print(f"\n({time.time() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
