"""What decode's capacity probe sees when it raises the capacity factor, against what the model predicts
(issue 25; docs/autoscaler-issue25.md, "The factor learned at the peak, used at the trough").

    PYTHONSAFEPATH=1 .venv/bin/python bench/decode_probe_evidence.py \
        [--calibration bench/calibrations/smollm2-cpu-scenarios.yaml] [--seeds 0,1] [--detail diurnal:0]

The probe (``Autoscaler._learn``) raises decode's factor by 2% in a steady window whose p90 TPOT is under
0.75x the target while the model says 25% more load would need more replicas. On the CPU calibration a
decode replica has one slot at the SLO (``PerfModel.decode_slots``: a batch of two misses the target), so
the p90 sits at the batch-of-one floor until about a tenth of the requests share a replica; a low p90
there says little about how near the model's limit the pool is.

The model does predict something the window can check: ``PerfModel.decode_replicas`` sizes the pool as an
M/G/c queue whose servers are the replicas' slots, so Erlang C gives the share of arrivals that find every
slot taken (at the present load, over the factor the probe is about to raise). Such a request shares a
replica's step and is slowed past the SLO batch's step, and it slows the one it joins, so the share of the
window's requests slowed past that step (here by more than 10%) should read between one and two times the
prediction if the model is right, and less if it underrates capacity. For each probe step the run records
both; the table counts the steps whose measured share is within twice the prediction (evidence that the
raise was safe) and gives the median ratio. The requests come from the simulator's own log (each one's
finish time and TPOT), not from the snapshot, which carries only the p90. The simulator is deterministic,
so every figure repeats on any machine.
"""
from __future__ import annotations

import argparse
import statistics

from tandem.operator.autoscaler import policy as P
from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate import run as R
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.tune import DEFAULT_CALIBRATION
from tandem.worker.api.calibration import Calibration

SLOWED = 1.1   # a TPOT this far past the SLO batch's step counts as slowed by sharing


def probe_steps(cal, perf: PerfModel, name: str, seed: int) -> tuple[dict, list[dict]]:
    """(run metrics, one row per decode probe step): tandem's policy on a scenario, its ``_learn``
    wrapped (bench instrumentation, not a mock) to record each raise of decode's factor with the model's
    prediction; the measured share is filled in from the fleet's request log after the run."""
    rows: list[dict] = []
    learn = P.Autoscaler._learn

    def recording(self, role, snap, *args):
        before = self.state[role].correction
        if learn(self, role, snap, *args) != "raised" or role != "decode":
            return   # not a probe step: a fade of a lowered factor back towards 1 rises too
        rs, lim = snap.decode, self.limits["decode"]
        inputs = self._demand("decode", snap)[2]   # the context and the hold the policy sized with
        ctx = inputs["context_tokens"]
        predicted = perf.decode_wait_share(rs.ready, rs.output_tokens_per_s / before, ctx, lim.target,
                                           inputs["hold_s_per_token"])
        rows.append({"at": snap.at, "window_s": rs.window_s, "ready": rs.ready, "factor": before,
                     "after": self.state[role].correction, "p90_ratio": rs.latency / lim.target,
                     "step": perf.decode_slots(lim.target, ctx)[1], "predicted": predicted})

    P.Autoscaler._learn = recording
    try:
        m, fleet = R.run_one("tandem", S.build(name, perf, seed), perf, cal)
    finally:
        P.Autoscaler._learn = learn
    done = [(r.finish, r.tpot) for r in fleet.requests if r.output > 1 and r.finish == r.finish]
    for row in rows:
        tpots = [t for f, t in done if row["at"] - row["window_s"] < f <= row["at"]]
        row["measured"] = sum(t > SLOWED * row["step"] for t in tpots) / len(tpots) if tpots else float("nan")
    return m, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--detail", help="SCENARIO:SEED whose probe steps are listed one by one")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.detail and args.detail not in {f"{n}:{s}" for n in S.NAMES for s in seeds}:
        ap.error(f"--detail must be SCENARIO:SEED with a scenario of {', '.join(S.NAMES)} and a seed of "
                 f"--seeds ({args.seeds}); got {args.detail!r}")
    cal = Calibration.load(args.calibration)
    perf = PerfModel.of(cal)
    print("| input | TPOT att. | probe steps | highest factor | within 2x the prediction | median measured / predicted |")
    print("|---|---|---|---|---|---|")
    detail = {}
    for seed in seeds:
        for name in S.NAMES:
            m, rows = probe_steps(cal, perf, name, seed)
            if args.detail == f"{name}:{seed}":
                detail = rows
            ratios = [r["measured"] / r["predicted"] if r["predicted"] > 0 else float("inf") for r in rows]
            within = sum(x <= 2 for x in ratios)
            top = max((r["after"] for r in rows), default=1.0)
            med = f"{statistics.median(ratios):.1f}" if rows else "-"
            print(f"| {name} seed {seed} | {m['attainment_tpot']:.1%} | {len(rows)} | {top:.2f} | "
                  f"{within} of {len(rows)} | {med} |")
    if detail:
        print(f"\n{args.detail}: each probe step")
        print("| at (s) | ready | factor | p90 / target | predicted share | measured share |")
        print("|---|---|---|---|---|---|")
        for r in detail:
            print(f"| {r['at']:.0f} | {r['ready']} | {r['factor']:.3f} | {r['p90_ratio']:.3f} | "
                  f"{r['predicted']:.3f} | {r['measured']:.3f} |")


if __name__ == "__main__":
    main()
