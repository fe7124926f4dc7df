"""Tune the baselines' knobs on seed 1 and write operator/simulate/tuned.json (tuned-<stem>.json for another
calibration than the scenarios' own); print the table of every policy on every scenario (seed 0) and the
issue's aims.

    python -m tandem.operator.simulate.tune [--calibration FILE] [--jobs 2] [--table-only] [--markdown OUT]
    python -m tandem.operator.simulate.tune --policies apa,kpa   # re-tune these, keep the rest of tuned.json
    python -m tandem.operator.simulate.tune --tandem-grid [--seed 1]   # tandem's own defaults (run.TANDEM_GRID)

The table is followed by the reactive oracle at every setting of its grid (plain, and held to the pool's
scaling behavior), on seed 0 and on the tuning seed, and, for each aim tandem misses, whether any of those
settings reaches it, and whether one that tuning on seed 1 could choose does (``run.reach``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.worker.api.calibration import Calibration

#: issue 10's scenarios are defined on this calibration (docs/autoscaler.md: "The scenarios' calibration")
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[2] / "bench/calibrations/smollm2-cpu-scenarios.yaml"


def tuned_key(cal_path):
    """The calibration argument of :func:`run.tuned_file` / :func:`run.load_tuned` for a calibration file:
    None for the scenarios' own (:data:`DEFAULT_CALIBRATION`, whose knobs are run.TUNED_FILE), else the path."""
    return None if Path(cal_path).resolve() == DEFAULT_CALIBRATION.resolve() else cal_path


def _tune_one(args) -> tuple[str, dict]:
    cal_path, name, policies = args
    cal = Calibration.load(cal_path)
    perf = PerfModel.of(cal)
    sc = S.build(name, perf, 1)
    return name, {p: R.tune(p, sc, perf, cal) for p in policies}


def _scenario_one(args) -> dict:
    """One scenario at one seed of :func:`table_all` (``tuned`` given) or of :func:`frontier_all`
    (``frontier``: the yardstick's policy name)."""
    cal_path, name, seed, tuned, frontier = args
    cal = Calibration.load(cal_path)
    if frontier is not None:
        return R.reactive_frontier(PerfModel.of(cal), cal, seed, [name], policy=frontier)
    return R.table(PerfModel.of(cal), cal, tuned, seed, [name])


def _by_seed(cal_path, tuned, jobs: int, seeds=(0,), frontier=None) -> dict:
    """{seed: {scenario: ...}}, every (seed, scenario) pair spread over ``jobs`` processes."""
    pairs = [(s, n) for s in seeds for n in S.NAMES]
    out: dict = {s: {} for s in seeds}
    with ProcessPoolExecutor(jobs) as ex:
        for (s, _), d in zip(pairs, ex.map(_scenario_one, [(str(cal_path), n, s, tuned, frontier)
                                                           for s, n in pairs])):
            out[s].update(d)
    return out


def _tandem_one(args) -> dict:
    cal_path, knobs, name, seed = args
    cal = Calibration.load(cal_path)
    perf = PerfModel.of(cal)
    return R.run_one("tandem", S.build(name, perf, seed), perf, cal, knobs)[0]


def tandem_grid(cal_path, seed: int = 1, jobs: int = 2) -> list[dict]:
    """tandem's policy at every setting of :data:`run.TANDEM_GRID` on every scenario: one row per setting,
    {knobs, scenario: metrics, ..., gpu_hours: total}, and the pick: the cheapest setting whose attainment
    reaches the aim on every scenario where any setting reaches it (the baselines' rule, across scenarios);
    when none does, the cheapest of those reaching it on the most such scenarios."""
    jobs_args = [(str(cal_path), k, n, seed) for k in R.TANDEM_GRID for n in S.NAMES]
    with ProcessPoolExecutor(jobs) as ex:
        ms = list(ex.map(_tandem_one, jobs_args))
    rows = []
    for i, k in enumerate(R.TANDEM_GRID):
        row = {"knobs": k, **{n: ms[i * len(S.NAMES) + j] for j, n in enumerate(S.NAMES)}}
        row["gpu_hours"] = round(sum(row[n]["gpu_hours"] for n in S.NAMES), 2)
        rows.append(row)
    reachable = [n for n in S.NAMES if any(R.meets(r[n]) for r in rows)]
    # the most scenarios meeting the SLO, then the fewest GPU-hours: where no setting meets every
    # scenario some setting meets, a policy still ships one setting
    best = min(rows, key=lambda x: (-sum(R.meets(x[n]) for n in reachable), x["gpu_hours"]))
    for r in rows:
        r["pick"] = r is best
    return rows


def format_tandem_grid(rows: list[dict]) -> str:
    head = "| headroom | catch_up_s | " + " | ".join(S.NAMES) + " | GPU-h total | pick |"
    lines = [head, "|" + "---|" * (len(S.NAMES) + 4),
             "| | | " + " | ".join("TTFT / TPOT att., GPU-h" for _ in S.NAMES) + " | | |"]
    for r in rows:
        cells = [f"{r[n]['attainment_ttft']:.1%} / {r[n]['attainment_tpot']:.1%}, {r[n]['gpu_hours']:.2f}"
                 for n in S.NAMES]
        lines.append(f"| {r['knobs']['headroom']} | {r['knobs']['catch_up_s']:.0f} | " + " | ".join(cells) +
                     f" | {r['gpu_hours']:.2f} | {'**yes**' if r['pick'] else ''} |")
    return "\n".join(lines)


def tune_all(cal_path, jobs: int = 2, policies=None) -> dict:
    """{scenario: {baseline: knobs}} tuned on seed 1 (every baseline, or those named), scenario and
    baseline pairs spread over ``jobs`` processes."""
    policies = [p for p in (policies or R.POLICIES) if p != "tandem"]
    out = {n: {} for n in S.NAMES}
    with ProcessPoolExecutor(jobs) as ex:
        for n, knobs in ex.map(_tune_one, [(str(cal_path), n, [p]) for p in policies for n in S.NAMES]):
            out[n].update(knobs)
    return out


def table_all(cal_path, tuned: dict, jobs: int = 2, seed: int = 0) -> dict:
    """{scenario: {policy: metrics}} on ``seed`` (0, the evaluation seed) with the tuned knobs."""
    return table_by_seed(cal_path, tuned, (seed,), jobs)[seed]


def table_by_seed(cal_path, tuned: dict, seeds, jobs: int = 2) -> dict:
    """{seed: {scenario: {policy: metrics}}}: :func:`table_all` on each of ``seeds``."""
    return _by_seed(cal_path, tuned, jobs, tuple(seeds))


def frontier_all(cal_path, jobs: int = 2, policy: str = "oracle-reactive", seed: int = 0) -> dict:
    """{scenario: [metrics]}: :func:`run.reactive_frontier` on ``seed`` (0, the evaluation seed; of
    ``policy``: the reactive oracle, or :data:`run.BEHAVED`), scenarios spread over ``jobs``."""
    return _by_seed(cal_path, None, jobs, (seed,), frontier=policy)[seed]


def at_least_one(text: str) -> int:
    """argparse type of a count that must be >= 1 (``--jobs``)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {n})")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.operator.simulate.tune", description=__doc__)
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    ap.add_argument("--jobs", type=at_least_one, default=2, help="processes (default 2)")
    ap.add_argument("--table-only", action="store_true",
                    help="use the committed knobs (tuned.json, or tuned-<stem>.json for another calibration)")
    ap.add_argument("--policies", help="tune only these baselines (comma-separated), keeping the others' "
                                       "knobs from tuned.json")
    ap.add_argument("--markdown", help="also write the table and the aims here (Markdown)")
    ap.add_argument("--tandem-grid", action="store_true",
                    help="instead: tandem's own knobs on the grid run.TANDEM_GRID, one setting for all scenarios")
    ap.add_argument("--seed", type=int, default=1, help="the scenarios' seed for --tandem-grid (tuning: 1)")
    args = ap.parse_args(argv)
    if not Path(args.calibration).is_file():
        ap.error(f"--calibration {args.calibration}: no such file")
    key = tuned_key(args.calibration)
    tuned_path = R.tuned_file(key)
    if args.table_only and not tuned_path.is_file():
        print(f"note: no baseline was tuned on {args.calibration} ({tuned_path.name} is missing): the table "
              "has tandem, and the aims the reactive oracle's settings; run without --table-only to tune "
              "the baselines on it", file=sys.stderr)
    t0 = time.time()
    if args.tandem_grid:
        text = format_tandem_grid(tandem_grid(args.calibration, args.seed, args.jobs))
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
        print(f"done in {time.time() - t0:.0f} s", file=sys.stderr)
        return 0
    if args.table_only:
        tuned = R.load_tuned(key)
    else:
        names = args.policies.split(",") if args.policies else None
        unknown = [p for p in names or [] if p not in R.POLICIES or p == "tandem"]
        if unknown:
            ap.error(f"--policies: unknown baseline(s) {', '.join(unknown)} (one of {', '.join(R.POLICIES[1:])})")
        fresh = tune_all(args.calibration, args.jobs, names)
        tuned = R.load_tuned(key) if names else {}
        for n, knobs in fresh.items():
            tuned.setdefault(n, {}).update(knobs)
        tuned_path.write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")
        print(f"tuned in {time.time() - t0:.0f} s -> {tuned_path}", file=sys.stderr)
    tab = table_all(args.calibration, tuned, args.jobs)
    front = frontier_all(args.calibration, args.jobs)
    held = frontier_all(args.calibration, args.jobs, R.BEHAVED)
    tuning = (frontier_all(args.calibration, args.jobs, seed=R.TUNING_SEED),
              frontier_all(args.calibration, args.jobs, R.BEHAVED, seed=R.TUNING_SEED))
    text = R.format_judgement(tab, front, held, " (seed 0)", tuning)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print(f"done in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
