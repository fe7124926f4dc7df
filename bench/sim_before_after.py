"""The simulator's fleet at another commit against the one checked out: every policy on the CPU scenarios
(seed 0, the committed tuned knobs) and the CPU time of a 100-requests/s trace, both fleets in one process.

    PYTHONSAFEPATH=1 .venv/bin/python bench/sim_before_after.py --before 15bfd05 [--table] [--speed]

The old operator/simulate/fleet.py is read with ``git show COMMIT:operator/simulate/fleet.py`` and loaded
as a module beside the current one; run.run_one drives both (the old Fleet takes no block_tokens).
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_old(commit: str):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:operator/simulate/fleet.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "fleet_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("tandem.operator.simulate.fleet_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def table(old) -> None:
    from tandem.operator.autoscaler.capacity import PerfModel
    from tandem.operator.simulate import fleet as new
    from tandem.operator.simulate import run as R
    from tandem.operator.simulate import scenarios as S
    from tandem.operator.simulate.tune import DEFAULT_CALIBRATION
    from tandem.worker.api.calibration import Calibration
    cal = Calibration.load(DEFAULT_CALIBRATION)
    perf = PerfModel.of(cal)
    tuned = R.load_tuned()
    print("| scenario | policy | before: TTFT / TPOT att., GPU-h | after |\n|---|---|---|---|")
    for name in S.NAMES:
        sc = S.build(name, perf, 0)
        for p in R.POLICIES:
            row = []
            for fleet in (lambda *a, block_tokens=512, **k: old.Fleet(*a, **k), new.Fleet):
                R.Fleet = fleet
                m, _ = R.run_one(p, sc, perf, cal, tuned.get(name, {}).get(p))
                row.append(f"{m['attainment_ttft']:.1%} / {m['attainment_tpot']:.1%}, {m['gpu_hours']:.2f}")
            print(f"| {name} | {p} | {row[0]} | {row[1]} |", flush=True)
    R.Fleet = new.Fleet


def speed(old, seconds: float = 300.0) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sim_scale as B

    from tandem.operator.autoscaler.capacity import PerfModel
    from tandem.operator.simulate import fleet as new
    from tandem.operator.simulate.baselines import Static
    from tandem.worker.api.calibration import Calibration
    perf = PerfModel.of(Calibration.load(B.CAL))
    recs = B.trace(seconds, 100)
    print(f"{len(recs)} requests, {seconds:g} s at 100 req/s; CPU seconds\n| replicas | before | after |\n|---|---|---|")
    for n in (50, 200):
        got = []
        for mod in (old, new):
            c0 = time.process_time()
            mod.Fleet(perf, Static(n // 2, n // 2), recs, {"prefill": n // 2, "decode": n // 2}, duration=seconds).run()
            got.append(time.process_time() - c0)
        print(f"| {n // 2}+{n // 2} | {got[0]:.2f} | {got[1]:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit whose fleet.py is 'before'")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--speed", action="store_true")
    args = ap.parse_args()
    old = load_old(args.before)
    if args.speed or not args.table:
        speed(old)
    if args.table or not args.speed:
        table(old)


if __name__ == "__main__":
    main()
