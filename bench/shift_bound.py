"""What the minutes after a shift need: a scripted jump from a given fleet (issue 25, the shifts' misses).

In prompt-shift and output-shift the requests change in kind at 1,200 s (4x the prompt or the output).
A policy that sees only the present learns of it at the first tick after the shift begins (1,215 s:
ticks fall every 15 s, and the one at 1,200 s closes a window that ends as the shift begins). This
script replaces the policy by a scripted jump: hold P0 prefill and D0 decode replicas until that tick,
then ask for the pool's maximum in both roles and never scale down. The jump is made:

- ``limited``: at the scenario manifest's scale-up step (+4 replicas per 30 s), as a policy held to
  the pool's behavior is;
- ``at once``: the whole jump at 1,215 s, which no policy held to the pool's behavior may do;
- with ``--absorb``, also turning on burst absorption from that tick (``Decision.absorb_bursts``: the
  router prefills new prompts on decode replicas with KV headroom), which tandem's policy gates on
  decode's TPOT slack.

For each (P0, D0) it prints the TTFT / TPOT attainment (the share of minutes meeting the SLO) and the
GPU-hours (a jump never scales down, so they are far above any policy's). Rows reaching 95% show
what the minutes after the shift need of the fleet before it, given this reaction; the fleet tandem's
policy enters the shift with (serving, and starting) is printed above them.

It then prints what a policy has to go on at 1,215 s: the window's demand over its smoothed level
(tandem's ``demand`` and ``level`` inputs) for each role, beside the highest the same ratio reads in
the diurnal and bursts scenarios of the seed, where no shift comes.

    PYTHONSAFEPATH=1 .venv/bin/python bench/shift_bound.py [--scenario prompt-shift] [--seeds 1,0]
        [--calibration FILE] [--prefill 3,4,6,8] [--decode 2,4,6,8] [--absorb]

About 1 s a run on the 2-core VM for the CPU calibration; the simulator is deterministic.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from tandem.operator.autoscaler.behavior import step_room
from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.snapshot import Decision, PoolSnapshot, RoleDecision
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.tune import DEFAULT_CALIBRATION
from tandem.worker.api.calibration import Calibration
from tandem.worker.api.names import WORKER_ROLES as ROLES

#: the policy's period in the simulator (``fleet.Fleet``'s ``tick_s``)
TICK_S = 15.0
#: the first tick whose metrics window holds requests of the shift
KNOWN_AT = S.SHIFT_AT + TICK_S


class Jump:
    """Hold the initial fleet until ``KNOWN_AT``, then go to ``most`` replicas in each role: at once, or
    ``step`` replicas per ``period_s`` seconds (``limited``); ``absorb`` turns burst absorption on from
    then. Never scales down."""

    def __init__(self, counts: dict, most: int, limited: bool, absorb: bool, step: int, period_s: float):
        self.counts, self.most, self.limited, self.absorb = dict(counts), most, limited, absorb
        self.step, self.period_s = step, period_s
        self.ups: dict = {r: [] for r in ROLES}   # (time, replicas added)

    def decide(self, snap: PoolSnapshot) -> Decision:
        known = snap.at >= KNOWN_AT
        if known:
            for r in ROLES:
                cur = self.counts[r]
                room = step_room(self.ups[r], snap.at, self.period_s, self.step, up=True) if self.limited \
                    else self.most
                want = min(self.most, cur + room)
                if want > cur:
                    self.counts[r] = want
                    self.ups[r].append((snap.at, want - cur))
        ds = {r: RoleDecision(r, snap.role(r).replicas, self.counts[r], self.counts[r], snap.role(r).signal,
                              "scripted jump", None, {}) for r in ROLES}
        return Decision(snap.at, ds["prefill"], ds["decode"], absorb_bursts=known and self.absorb)


def one(sc: S.Scenario, perf: PerfModel, counts: dict, limited: bool, absorb: bool) -> dict:
    """One run of :class:`Jump` from ``counts`` (metrics as ``run.summarize``)."""
    up = S.manifest(sc)["spec"]["prefill"]["autoscaling"]["behavior"]["scaleUp"]
    pol = Jump(counts, sc.max_replicas, limited, absorb, int(up["maxStep"]), float(up["periodSeconds"]))
    fleet = R.simulate(pol, sc.records, perf, sc.targets, counts, S.DURATION)
    return R.summarize(fleet, sc.targets, sc.steady, S.DURATION)


def _ints(text: str, least: int) -> list[int]:
    """argparse type: comma-separated integers, at least one, each >= ``least``, duplicates dropped."""
    try:
        out = list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (got {text!r})") from None
    if not out or min(out) < least:
        raise argparse.ArgumentTypeError(f"expected one or more integers >= {least} (got {text!r})")
    return out


def _ratios(fleet, role: str) -> list[tuple[float, float]]:
    """[(demand / level, at)] of tandem's decisions for ``role``."""
    return [(i["demand"] / i["level"], d.at) for d in fleet.decisions if (i := d.role(role).inputs).get("level")]


def _evidence(perf: PerfModel, cal, fleet, seed: int) -> str:
    lines = ["| role | demand / level at 1,215 s | highest in diurnal | highest in bursts |", "|---|---|---|---|"]
    others = [R.run_one("tandem", S.build(n, perf, seed), perf, cal)[1] for n in ("diurnal", "bursts")]
    for role in ROLES:
        first = [f"{r:.2f}" for r, at in _ratios(fleet, role) if at == KNOWN_AT] or ["-"]
        cells = []
        for f in others:
            top, at = max(_ratios(f, role))
            cells.append(f"{top:.2f} (at {at:.0f} s)")
        lines.append(f"| {role} | {first[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="prompt-shift", choices=("prompt-shift", "output-shift"))
    ap.add_argument("--seeds", type=lambda t: _ints(t, 0), default=[1, 0], help="comma-separated (default 1,0)")
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    ap.add_argument("--prefill", type=lambda t: _ints(t, 1), default=[3, 4, 6, 8], help="P0 values (default 3,4,6,8)")
    ap.add_argument("--decode", type=lambda t: _ints(t, 1), default=[2, 4, 6, 8], help="D0 values (default 2,4,6,8)")
    ap.add_argument("--absorb", action="store_true", help="turn burst absorption on with the jump")
    args = ap.parse_args()
    if not Path(args.calibration).is_file():
        ap.error(f"--calibration {args.calibration}: no such file")
    try:
        cal = Calibration.load(args.calibration)
    except (OSError, ValueError, yaml.YAMLError) as e:   # one line, not a traceback
        first = (str(e).splitlines() or [""])[0]
        ap.error(f"--calibration {args.calibration}: not a calibration ({type(e).__name__}: {first})")
    perf = PerfModel.of(cal)
    print(f"calibration {args.calibration}, scenario {args.scenario}"
          f"{', absorption on with the jump' if args.absorb else ''}\n")
    for seed in args.seeds:
        sc = S.build(args.scenario, perf, seed)
        m, fleet = R.run_one("tandem", sc, perf, cal)
        serving = {r: sum(1 for x in fleet.replicas if x.role == r and x.ready_at <= S.SHIFT_AT < x.gone_at
                          and not x.cancelled) for r in ROLES}
        at_shift = [x for x in fleet.timeline if x["t"] <= S.SHIFT_AT][-1]
        print(f"seed {seed}: tandem enters the shift with {serving['prefill']} prefill / {serving['decode']} decode "
              f"replicas serving ({at_shift['prefill']} / {at_shift['decode']} with those starting) and meets "
              f"{m['attainment_ttft']:.1%} / {m['attainment_tpot']:.1%} at {m['gpu_hours']:.2f} GPU-h\n")
        print("| P0 | D0 | limited (+4 / 30 s): TTFT / TPOT, GPU-h | at once: TTFT / TPOT, GPU-h |")
        print("|---|---|---|---|")
        for p0 in args.prefill:
            for d0 in args.decode:
                counts = {"prefill": p0, "decode": d0}
                if max(counts.values()) > sc.max_replicas:
                    continue
                cells = []
                for limited in (True, False):
                    r = one(sc, perf, counts, limited, args.absorb)
                    ok = "**" if R.meets(r) else ""
                    cells.append(f"{ok}{r['attainment_ttft']:.1%} / {r['attainment_tpot']:.1%}{ok}, "
                                 f"{r['gpu_hours']:.2f}")
                print(f"| {p0} | {d0} | {cells[0]} | {cells[1]} |")
        print("\n(bold: both SLOs met in at least 95% of minutes)\n")
        print(_evidence(perf, cal, fleet, seed))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
