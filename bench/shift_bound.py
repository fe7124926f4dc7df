"""The room before a shift that the fastest reaction still needs (issue 25: the shifts' attainment).

In prompt-shift and output-shift the requests change in kind at 1,200 s (4x the prompt or the output).
A policy that sees only the present learns of it at the first tick whose metrics window holds any of
the new requests (1,215 s). This script replaces the policy by the fastest reaction there is: hold P0
prefill and D0 decode replicas until that tick, then ask for the pool's maximum in both roles and
never scale down. Two forms of that jump:

- ``limited``: at the scenario manifest's scale-up step (+4 replicas per 30 s), as every policy is held;
- ``at once``: the whole jump at 1,215 s, more than the pool's behavior lets any policy do.

It then prints what a policy has to go on at that tick: the window's demand over its smoothed level
(tandem's ``demand`` and ``level`` inputs) for each role, beside the highest the same ratio reads in
the diurnal and bursts scenarios of the seed, where no shift comes. A rule that jumps on the first
tick's reading would jump there too.

For each (P0, D0) it prints the TTFT / TPOT attainment (the share of minutes meeting the SLO) and the
GPU-hours (a jump never scales down, so only the attainment is a bound). Which rows reach 95% shows
how much room before the shift the minutes after it need, whatever a policy does once it knows;
the counts tandem enters the shift with are printed above them.

    PYTHONSAFEPATH=1 .venv/bin/python bench/shift_bound.py [--scenario prompt-shift] [--seeds 1,0]
        [--calibration FILE] [--prefill 3,4,6,8,10] [--decode 2,4,6,8]

About 1 s a run on the 2-core VM for the CPU calibration; the simulator is deterministic.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.snapshot import Decision, PoolSnapshot
from tandem.operator.simulate import baselines as B
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.tune import DEFAULT_CALIBRATION
from tandem.worker.api.calibration import Calibration
from tandem.worker.api.names import WORKER_ROLES as ROLES

#: the scenario manifest's scale-up behavior (scenarios.manifest): at most this many replicas per period
STEP, PERIOD_S = 4, 30.0


class Jump:
    """Hold the initial fleet until ``known_at``, then go to ``most`` replicas in each role: at once, or
    ``STEP`` replicas per ``PERIOD_S`` (``limited``). Never scales down."""
    name = "jump"

    def __init__(self, counts: dict, known_at: float, most: int, limited: bool):
        self.counts, self.known_at, self.most, self.limited = dict(counts), known_at, most, limited
        self.last_up = {r: -1e9 for r in ROLES}

    def decide(self, snap: PoolSnapshot) -> Decision:
        if snap.at >= self.known_at:
            for r in ROLES:
                cur = self.counts[r]
                if not self.limited:
                    self.counts[r] = self.most
                elif cur < self.most and snap.at - self.last_up[r] >= PERIOD_S:
                    self.counts[r], self.last_up[r] = min(self.most, cur + STEP), snap.at
        return B._decision(snap, self.counts, {r: "scripted jump" for r in ROLES})


def one(sc: S.Scenario, perf: PerfModel, counts: dict, limited: bool) -> dict:
    """One run of :class:`Jump` from ``counts`` (metrics as ``run.summarize``)."""
    known_at = S.SHIFT_AT + 15.0   # the first tick (every 15 s) whose window holds a shifted request
    pol = Jump(counts, known_at, sc.max_replicas, limited)
    fleet = R.simulate(pol, sc.records, perf, sc.targets, counts, S.DURATION)
    return R.summarize(fleet, sc.targets, sc.steady, S.DURATION)


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (got {text!r})") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 (got {text!r})")
    return out


def _seeds(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (got {text!r})") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="prompt-shift", choices=("prompt-shift", "output-shift"))
    ap.add_argument("--seeds", type=_seeds, default=[1, 0], help="comma-separated (default 1,0)")
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    ap.add_argument("--prefill", type=_ints, default=[3, 4, 6, 8, 10], help="P0 values (default 3,4,6,8,10)")
    ap.add_argument("--decode", type=_ints, default=[2, 4, 6, 8], help="D0 values (default 2,4,6,8)")
    args = ap.parse_args()
    if not Path(args.calibration).is_file():
        ap.error(f"--calibration {args.calibration}: no such file")
    cal = Calibration.load(args.calibration)
    perf = PerfModel.of(cal)
    print(f"calibration {args.calibration}, scenario {args.scenario}\n")
    for seed in args.seeds:
        sc = S.build(args.scenario, perf, seed)
        m, fleet = R.run_one("tandem", sc, perf, cal)
        before = [x for x in fleet.timeline if x["t"] < S.SHIFT_AT]
        held = before[-1] if before else {}
        print(f"seed {seed}: tandem enters the shift with {held.get('prefill')} prefill / {held.get('decode')} "
              f"decode replicas and meets {m['attainment_ttft']:.1%} / {m['attainment_tpot']:.1%} at {m['gpu_hours']:.2f} "
              f"GPU-h\n")
        print("| P0 | D0 | limited (+4 / 30 s): TTFT / TPOT, GPU-h | at once: TTFT / TPOT, GPU-h |")
        print("|---|---|---|---|")
        for p0 in args.prefill:
            for d0 in args.decode:
                counts = {"prefill": min(p0, sc.max_replicas), "decode": min(d0, sc.max_replicas)}
                cells = []
                for limited in (True, False):
                    r = one(sc, perf, counts, limited)
                    ok = "**" if R.meets(r) else ""
                    cells.append(f"{ok}{r['attainment_ttft']:.1%} / {r['attainment_tpot']:.1%}{ok}, "
                                 f"{r['gpu_hours']:.2f}")
                print(f"| {counts['prefill']} | {counts['decode']} | {cells[0]} | {cells[1]} |")
        print(_evidence(sc, perf, cal, fleet, seed))
        print()
    return 0


def _ratios(fleet, role: str) -> list[tuple[float, float]]:
    """[(demand / level, at)] of tandem's decisions for ``role``."""
    return [(i["demand"] / i["level"], d.at) for d in fleet.decisions
            if (i := d.role(role).inputs).get("level")]


def _evidence(sc: S.Scenario, perf: PerfModel, cal, fleet, seed: int) -> str:
    known_at = S.SHIFT_AT + 15.0
    lines = ["| role | demand / level at the first tick that can know | highest in diurnal | highest in bursts |",
             "|---|---|---|---|"]
    others = {n: R.run_one("tandem", S.build(n, perf, seed), perf, cal)[1] for n in ("diurnal", "bursts")}
    for role in ROLES:
        first = [r for r, at in _ratios(fleet, role) if at == known_at]
        cells = [f"{max(_ratios(f, role))[0]:.2f} (at {max(_ratios(f, role))[1]:.0f} s)" for f in others.values()]
        lines.append(f"| {role} | {first[0]:.2f} | " + " | ".join(cells) + " |" if first else f"| {role} | - | |")
    return "\n" + "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
