"""``tandem simulate``: replay a trace against a pool's policy and the baselines on a simulated clock.

    tandem simulate --trace TRACE [--pool MANIFEST] --calibration FILE [--policy NAME|all] [--tuned K.json]
    tandem simulate --scenario step [--seed 0] [--write-trace T.jsonl] [--write-pool POOL.yaml] ...
    tandem simulate ... --aims   # and issue 25's aims, judged as `python -m tandem.operator.simulate.tune` does
    tandem simulate ... --minutes   # and each run minute by minute (which minutes miss, on what replicas)

The SLOs are the manifest's targets (prefill TTFT, decode TPOT); without --pool, a pool is made for the
trace (scenarios.trace_scenario: 3x the single-request TTFT at the trace's p90 prompt, 1.5x the
single-request TPOT at its p90 context; --write-pool writes it). Baselines' knobs: those tuned for the
scenario a trace names in its header, as committed for the calibration it runs on
(operator/simulate/tuned.json for the scenarios' calibration, tuned-<calibration stem>.json for another,
written by ``python -m tandem.operator.simulate.tune --calibration FILE``); otherwise each baseline is
tuned here on the same grid and rule as the table (run.GRIDS,
the cheapest setting meeting the SLOs), on seed 1 for a scenario and on the trace's first half for any
other trace (the tuning rule of issue 25), and the knobs are kept in --tuned FILE when given (read from
it when it exists). The static fleet is the best one in hindsight on the tuning input.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

#: the committed calibration of the SmolLM2 CPU fleet (`tandem bench calibrate`)
SERVING_CALIBRATION = Path(__file__).resolve().parents[2] / "bench/calibrations/smollm2-cpu.yaml"


def _minute_p90s(fleet) -> tuple[np.ndarray, np.ndarray]:
    """(p90 TTFT, p90 TPOT) per simulated minute of a run (run.minute_p90s, as the attainment counts them)."""
    from tandem.operator.simulate.run import minute_p90s
    reqs = fleet.requests
    return minute_p90s(np.array([r.first_token for r in reqs]), np.array([r.ttft for r in reqs]),
                       np.array([r.finish for r in reqs]), np.array([r.tpot for r in reqs]), fleet.duration)


def minute_table(fleet, targets: dict) -> list[dict]:
    """One row per simulated minute of a run: {minute, arrivals, ttft_p90, tpot_p90 (s, None where the
    minute has none), ttft_met, tpot_met, prefill, decode} where ``prefill`` and ``decode`` list the
    replica counts (ready and starting, not draining) after each of the minute's ticks. What ``--minutes``
    prints: which minutes miss the SLO, and what the policy ran in them."""
    w1, w2 = _minute_p90s(fleet)
    arrivals = np.bincount(np.minimum((np.array([r.arrival for r in fleet.requests]) // 60).astype(int),
                                      len(w1) - 1), minlength=len(w1))
    by_minute: dict = {}
    for x in fleet.timeline:
        by_minute.setdefault(int(x["t"] // 60), []).append(x)
    rows = []
    for m in range(len(w1)):
        ticks = by_minute.get(m, [])
        p1 = None if np.isnan(w1[m]) else float(w1[m])
        p2 = None if np.isnan(w2[m]) else float(w2[m])
        rows.append({"minute": m, "arrivals": int(arrivals[m]), "ttft_p90": p1, "tpot_p90": p2,
                     "ttft_met": p1 is None or p1 <= targets["prefill"] + 1e-12,
                     "tpot_met": p2 is None or p2 <= targets["decode"] + 1e-12,
                     "prefill": [x["prefill"] for x in ticks], "decode": [x["decode"] for x in ticks]})
    return rows


def format_minutes(name: str, rows: list[dict], targets: dict) -> str:
    """``minute_table``'s rows as Markdown: the p90s as multiples of their targets, a miss marked *."""
    def ratio(v, target, met):
        return "-" if v is None else f"{v / target:.2f}{'' if met else '*'}"
    lines = [f"{name}: p90 per minute over its target (* misses), replicas after each tick",
             "", "| minute | arrivals | TTFT | TPOT | prefill | decode |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['minute']} | {r['arrivals']} | {ratio(r['ttft_p90'], targets['prefill'], r['ttft_met'])} | "
                     f"{ratio(r['tpot_p90'], targets['decode'], r['tpot_met'])} | "
                     f"{'/'.join(map(str, r['prefill']))} | {'/'.join(map(str, r['decode']))} |")
    return "\n".join(lines)


def _plot(runs: dict, targets: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    for name, (_, fleet) in runs.items():
        # from t=0 with the fleet it started with (the timeline begins at the first tick)
        t = np.array([0.0] + [x["t"] for x in fleet.timeline]) / 60
        for ax, role in zip(axes[:2], ("prefill", "decode")):
            ax.step(t, [fleet.initial[role]] + [x[role] for x in fleet.timeline], where="post", label=name)
        w1, w2 = _minute_p90s(fleet)
        axes[2].plot(np.arange(w1.size) + 0.5, w1, marker=".", label=name)
        axes[3].plot(np.arange(w2.size) + 0.5, w2, marker=".", label=name)
    for ax, role in ((axes[2], "prefill"), (axes[3], "decode")):
        # log scale: one policy's queue of minutes must not flatten the others and the target
        ax.set_yscale("log")
        line = ax.axhline(targets[role], color="k", ls="--", lw=1, label=f"target {targets[role]:.3g} s")
        ax.legend(handles=[line], loc="upper right", fontsize=8)
    for ax, lab in zip(axes, ("prefill replicas", "decode replicas", "p90 TTFT per minute (s)",
                              "p90 TPOT per minute (s)")):
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    axes[0].legend(ncol=6, fontsize=8)
    axes[3].set_xlabel("simulated minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _check_args(args) -> None:
    """Raises ValueError for options that contradict each other or cannot be simulated."""
    if args.scenario and (args.pool or args.trace):
        raise ValueError("give --scenario, or --pool and --trace, not both")
    if not args.scenario:
        if not args.trace:
            raise ValueError("give --trace (and optionally --pool), or --scenario")
        given = [o for o, v in (("--seed", args.seed), ("--write-trace", args.write_trace),
                                ("--write-pool", args.write_pool if args.pool else None)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: {'these apply' if len(given) > 1 else 'it applies'} only "
                             "with --scenario")
    if args.decisions and not args.json:
        raise ValueError("--decisions only applies with --json")
    if args.aims and args.policy != "all":
        raise ValueError("--aims compares tandem with every peer: it needs --policy all")
    if not (math.isfinite(args.tick) and args.tick > 0):
        raise ValueError(f"--tick must be a finite number of seconds > 0 (got {args.tick:g})")
    if not (math.isfinite(args.startup) and args.startup >= 0):
        raise ValueError(f"--startup must be a finite number of seconds >= 0 (got {args.startup:g})")
    for opt, path in (("--pool", args.pool), ("--trace", args.trace), ("--calibration", args.calibration)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{opt} {path}: no such file")
    for opt, path in (("--tuned", args.tuned), ("--write-pool", args.write_pool), ("--write-trace", args.write_trace)):
        # checked before minutes of tuning, not when the result is written
        if path is not None and (Path(path).is_dir() or not Path(path).resolve().parent.is_dir()):
            raise ValueError(f"{opt} {path}: {'a directory' if Path(path).is_dir() else 'no such directory'}")
    if args.plot:
        import matplotlib.figure
        kinds = matplotlib.figure.Figure().canvas.get_supported_filetypes()
        suffix = Path(args.plot).suffix.lstrip(".").lower()
        if suffix not in kinds:
            raise ValueError(f"--plot {args.plot}: give a file ending in one of .{', .'.join(sorted(kinds))}")
        if not Path(args.plot).resolve().parent.is_dir():
            raise ValueError(f"--plot {args.plot}: no such directory")


def _floor_notes(perf, records: list, targets: dict) -> list[str]:
    """Sentences for SLO targets below what one request alone takes by the calibration (no policy can
    meet them, whatever it spends)."""
    from tandem.operator.simulate.scenarios import single_request
    ttft, tpot = single_request(perf, float(np.median([r["prompt_tokens"] for r in records])),
                                float(np.median([r["output_tokens"] for r in records])))
    notes = []
    if targets["prefill"] < ttft:
        notes.append(f"the TTFT target {targets['prefill']:.3g} s is below one median request's remote prefill "
                     f"({ttft:.3g} s by the calibration): no fleet meets it")
    if targets["decode"] < tpot:
        notes.append(f"the TPOT target {targets['decode']:.3g} s is below one decode step at batch 1 "
                     f"({tpot:.3g} s by the calibration): no fleet meets it")
    return notes


def _simulate(args) -> int:
    import yaml

    from tandem.operator.autoscaler.capacity import PerfModel
    from tandem.operator.autoscaler.policy import gpus_per_replica
    from tandem.operator.simulate import run as R
    from tandem.operator.simulate import scenarios as S
    from tandem.operator.simulate.tune import DEFAULT_CALIBRATION, tuned_key
    from tandem.operator.spec import SpecError, load_manifest
    from tandem.worker.api.calibration import Calibration
    from tandem.worker.bench.trace import read_trace, write_trace

    try:
        _check_args(args)
        if args.scenario:
            header, records = {"params": {"scenario": args.scenario}}, None
        else:
            pool = load_manifest(args.pool) if args.pool else None
            header, records = read_trace(args.trace)
        scenario = header.get("params", {}).get("scenario")
        scenario = scenario if scenario in S.NAMES else None
        # the scenarios (their peak, their SLOs) and the baselines' tuned knobs are defined on one
        # calibration; another gives other traces, on which those knobs mean nothing
        cal_path = Path(args.calibration or (DEFAULT_CALIBRATION if scenario else SERVING_CALIBRATION))
        cal = Calibration.load(cal_path)
        perf = PerfModel.of(cal)
        if args.scenario:
            sc = S.build(args.scenario, perf, args.seed or 0)
            header, records = {"params": sc.params}, sc.records
            pool = load_manifest(S.manifest(sc))
            if args.write_trace:
                write_trace(args.write_trace, args.scenario, sc.params, records)
            if args.write_pool:
                Path(args.write_pool).write_text(yaml.safe_dump(S.manifest(sc), sort_keys=False))
        if not records:
            raise ValueError("the trace has no requests")
        if pool is None:
            made = S.manifest(S.trace_scenario(perf, records, Path(args.trace).stem))
            pool = load_manifest(made)
            if args.write_pool:
                Path(args.write_pool).write_text(yaml.safe_dump(made, sort_keys=False))
        spec = pool.spec
        targets = {}
        for role, metric in (("prefill", "ttft"), ("decode", "tpot")):
            a = getattr(spec, role).autoscaling
            if a is None or a.target is None:
                raise ValueError(f"spec.{role}.autoscaling.target ({metric}) is needed: it is the SLO the "
                                 "simulation measures")
            targets[role] = a.target.seconds
        gpus = {r: gpus_per_replica(getattr(spec, r)) for r in ("prefill", "decode")}
        names = list(R.POLICIES) if args.policy == "all" else [args.policy]
        for n in names:
            if n not in R.POLICIES:
                raise ValueError(f"unknown policy {n!r} (one of {', '.join(R.POLICIES)}, all)")
    except (OSError, ValueError, SpecError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # a trace of requests at one instant still spans a second, so that it has a minute of load
    duration = max(1.0, float(header.get("params", {}).get("duration") or records[-1]["timestamp"]))
    steady = S.steady_spans(scenario) if scenario else []
    same = tuned_key(cal_path) is None
    block = int(header.get("params", {}).get("block_tokens") or 512)
    for note in _floor_notes(perf, records, targets):
        print(f"note: {note}", file=sys.stderr)
    minutes = S.minute_loads(records, duration, perf)
    bounds = R.replica_bounds(spec)

    def one(name, knobs, recs=records, dur=duration, mins=minutes):
        pol = R.make_policy(name, spec, perf, cal, targets, mins, knobs, startup_s=args.startup)
        if name == "static":
            initial = dict(pol.counts)
        else:
            from tandem.operator.simulate.baselines import Oracle
            initial = Oracle(perf, targets, mins).need(mins[0])
        fleet = R.simulate(pol, recs, perf, targets, initial, dur, startup_s=args.startup, gpus=gpus,
                           tick_s=args.tick, bounds=bounds, block_tokens=block)
        m = R.summarize(fleet, targets, steady if recs is records else [], dur)
        m["policy"], m["knobs"] = name, knobs or {}
        return m, fleet

    tuned = R.load_tuned(None if same else cal_path).get(scenario, {}) if scenario else {}
    source = "committed for this calibration" if tuned else None
    # what the knobs are tuned for: a file read for another calibration or other SLOs is named as such
    tuned_on = {"calibration": cal_path.name, "ttft_p90_s": targets["prefill"], "tpot_p90_s": targets["decode"]}
    if args.tuned and Path(args.tuned).is_file():
        try:
            got, was = _read_tuned(args.tuned, lambda n, k: R.make_policy(n, spec, perf, cal, targets, minutes, k))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        tuned = {**got, **tuned}
        source = f"read from {args.tuned}"
        if was is not None and _differs(was, tuned_on):
            print(f"note: --tuned {args.tuned} was tuned for {json.dumps(was)}; this run is "
                  f"{json.dumps(tuned_on)}: its knobs may not suit it", file=sys.stderr)
    missing = [n for n in names if n != "tandem" and n not in tuned]
    if missing and not (scenario and same):
        if scenario:   # another calibration: the scenario's tuning seed on it
            recs = S.build(scenario, perf, 1).records
            dur, what = S.DURATION, f"{scenario} seed 1"
        else:
            dur = duration / 2
            recs, what = [r for r in records if r["timestamp"] < dur], "the trace's first half"
        mins = S.minute_loads(recs, dur, perf)
        print(f"note: tuning the baselines on {what} ({len(recs)} requests; --tuned FILE keeps the knobs)",
              file=sys.stderr)
        tuned = {**_tune(lambda n, k: one(n, k, recs, dur, mins), missing, bounds), **tuned}
        source = f"tuned on {what}" + (f", kept in {args.tuned}" if args.tuned else "")
        if args.tuned:
            Path(args.tuned).write_text(json.dumps({TUNED_ON: {**tuned_on, "input": what}, **tuned}, indent=1) + "\n")

    runs = {}
    for n in names:
        knobs = tuned.get(n)
        if n == "static" and knobs is None:
            knobs = _best_static(one, bounds)
        runs[n] = one(n, knobs)
    out = {"trace": {"requests": len(records), "duration_s": duration, "scenario": scenario},
           "targets": {"ttft_p90_s": targets["prefill"], "tpot_p90_s": targets["decode"]},
           "startup_s": args.startup, "results": {n: m for n, (m, _) in runs.items()},
           "decisions": {n: [d.to_dict() for d in f.decisions] for n, (_, f) in runs.items()}
           if args.decisions else None}
    key = scenario or Path(args.trace or "trace").name
    tab = {key: out["results"]}
    out["knobs_source"] = source
    knobs = "" if names == ["tandem"] else f"; the baselines' knobs: {source or 'their defaults'}"
    text = (f"SLOs: p90 TTFT <= {targets['prefill']:.4g} s, p90 TPOT <= {targets['decode']:.4g} s (attainment: "
            f"the share of minutes whose p90 meets them); start-up {args.startup:g} s{knobs}\n\n"
            + R.format_table(tab))
    text += _yardstick_note(out["results"])
    if args.aims:
        # issue 25's aims, judged as `tune` judges the scenarios: the cost aim against the reactive oracle
        # at every setting of its grid, plain and held to the pool's behavior, and each miss checked
        front = {key: [one("oracle-reactive", k)[0] for k in R.GRIDS["oracle-reactive"]]}
        held = {key: [one(R.BEHAVED, k)[0] for k in R.GRIDS[R.BEHAVED]]}
        rows, verdicts = R.judge(tab, front, held)
        if (scenario and header.get("params", {}).get("seed", R.TUNING_SEED) != R.TUNING_SEED
                and any(not r["ok"] and R.is_own(verdicts.get((r["scenario"], r["aim"]), "")) for r in rows)):
            # another seed than the one tandem's defaults and the baselines' knobs were tuned on: a miss
            # that only a setting chosen on this seed reaches is not tandem's own (run.reach)
            recs1 = S.build(scenario, perf, R.TUNING_SEED).records
            mins1 = S.minute_loads(recs1, S.DURATION, perf)
            tuning = tuple({key: [one(p, k, recs1, S.DURATION, mins1)[0] for k in R.GRIDS[p]]}
                           for p in ("oracle-reactive", R.BEHAVED))
            rows, verdicts = R.judge(tab, front, held, tuning)
        out["aims"] = [{**r, "verdict": verdicts.get((r["scenario"], r["aim"]))} for r in rows]
        text += "\n\n" + R.format_aims(rows) + "\n\n" + R.format_reach(rows, verdicts)
    if args.minutes:
        minutes = {n: minute_table(f, targets) for n, (_, f) in runs.items()}
        out["minutes"] = minutes
        text += "".join("\n\n" + format_minutes(n, rows, targets) for n, rows in minutes.items())
    if args.json:
        print(json.dumps(out, indent=2, default=float))
    else:
        print(text)
    if args.plot:
        _plot(runs, targets, args.plot, f"{scenario or args.trace}: replicas and p90 latency")
    return 0


def _yardstick_note(results: dict) -> str:
    """A note for the text output when the plain oracles miss the SLOs where a peer meets them (else "")."""
    from tandem.operator.simulate import run as R
    weak = [n for n in R.YARDSTICKS if n in results and not R.meets(results[n])]
    met = [n for n in results if n not in R.YARDSTICKS and R.meets(results[n])]
    if not (weak and met):
        return ""
    return (f"\n\nnote: {' and '.join(weak)} miss the SLOs here where {', '.join(met)} meet them. They size "
            "each minute afresh from its load and keep no replica through a quiet minute, so on a bursty "
            "trace a backlog outlives the replicas they add; held to the pool's scaling behavior (--aims) "
            "they are the yardstick (docs/autoscaler-issue25.md, \"The trace's aims, judged\").")


#: the key of a --tuned file that records what its knobs were tuned for (calibration, SLOs, input)
TUNED_ON = "_tuned_on"


def _differs(was: dict, now: dict) -> bool:
    """Whether a --tuned file's record (``was``) names another calibration or other SLOs than ``now``."""
    if was.get("calibration") != now["calibration"]:
        return True
    return any(not isinstance(was.get(k), (int, float)) or abs(was[k] - now[k]) > 1e-9 * max(1.0, abs(now[k]))
               for k in ("ttft_p90_s", "tpot_p90_s"))


def _read_tuned(path: str, make) -> tuple[dict, dict | None]:
    """(the baselines' knobs, what they were tuned for or None) in ``path``: a JSON object of policy name
    -> its knobs, each checked by making the policy with ``make(name, knobs)``, and the record under
    :data:`TUNED_ON` that this command writes (files written before it have none). Raises ValueError
    ``FILE: ...`` naming what is wrong."""
    from tandem.operator.simulate import run as R
    try:
        got = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--tuned {path}: not a JSON file ({e})") from None
    if not isinstance(got, dict):
        raise ValueError(f"--tuned {path}: must be a JSON object of policy name -> knobs, not "
                         f"{type(got).__name__}")
    was = got.pop(TUNED_ON, None)
    if was is not None and not isinstance(was, dict):
        raise ValueError(f"--tuned {path}: {TUNED_ON}: must be a JSON object, not {json.dumps(was)}")
    for name, knobs in got.items():
        if name not in R.POLICIES:
            raise ValueError(f"--tuned {path}: {name}: unknown policy (one of {', '.join(R.POLICIES)})")
        if not isinstance(knobs, dict):
            raise ValueError(f"--tuned {path}: {name}: the knobs must be a JSON object, not {json.dumps(knobs)}")
        try:
            make(name, knobs)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"--tuned {path}: {name}: bad knobs {json.dumps(knobs)} ({e})") from None
    return got, was


def _tune(one, names: list, bounds: dict) -> dict:
    """{policy: knobs} for ``names``: each grid of run.GRIDS run through ``one(name, knobs)`` and the
    cheapest setting meeting the SLOs taken (run._best, the table's rule); the static fleet bisected."""
    from tandem.operator.simulate import run as R
    out = {}
    for n in names:
        if n == "static":
            out[n] = _best_static(one, bounds)
        elif n in R.GRIDS:
            out[n] = R._best([one(n, k)[0] for k in R.GRIDS[n]])["knobs"]
    return out


def _best_static(one, bounds: dict) -> dict:
    """The fewest replicas per role meeting the SLOs on this trace (hindsight), each role bisected within
    the pool's (min, max) per role (``bounds``; a static fleet has at least 1 of each)."""
    def least(role):
        def ok(k):
            counts = {r: bounds[r][1] for r in bounds}
            counts[role] = k
            m, _ = one("static", counts)
            return m["attainment_ttft" if role == "prefill" else "attainment_tpot"] >= 0.95
        lo, most = max(1, bounds[role][0]), max(1, bounds[role][1])
        hi = most
        if not ok(hi):
            return most
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        return lo
    return {"prefill": least("prefill"), "decode": least("decode")}


def add_simulate_command(sub) -> None:
    """Register ``tandem simulate`` on the top-level subparsers."""
    from tandem.operator.simulate.run import POLICIES
    from tandem.operator.simulate.scenarios import NAMES, STARTUP_S
    s = sub.add_parser("simulate", help="replay a trace against the autoscaling policy and its baselines "
                                        "on a simulated fleet")
    s.add_argument("--pool", help="the InferencePool manifest (its targets are the SLOs; default: made for the "
                                  "trace from its p90 lengths)")
    s.add_argument("--trace", help="a trace (JSON Lines, as `tandem bench trace` writes)")
    s.add_argument("--calibration",
                   help="the performance model (tandem bench calibrate); default: the committed SmolLM2 one, "
                        "or with --scenario the one the scenarios are defined on (the baselines' tuned knobs "
                        "hold for that one only)")
    s.add_argument("--scenario", choices=NAMES, help="one of the fixed scenarios instead of --pool/--trace")
    s.add_argument("--seed", type=int, default=None, help="--scenario: the trace's seed (default 0)")
    s.add_argument("--write-trace", help="--scenario: also write its trace here")
    s.add_argument("--write-pool", help="also write the pool manifest here: the scenario's, or the one made for "
                                        "the trace (not with --pool)")
    s.add_argument("--policy", default="all", help=f"one of {', '.join(POLICIES)}, or all (default)")
    s.add_argument("--startup", type=float, default=STARTUP_S, help="replica start-up time (s; default %(default)g)")
    s.add_argument("--tick", type=float, default=15.0, help="the policy's period (s; default %(default)g)")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    s.add_argument("--decisions", action="store_true", help="--json: include every decision")
    s.add_argument("--aims", action="store_true",
                   help="also judge issue 25's aims: tandem against each peer, and its GPU-hours against the "
                        "reactive oracle at every setting (plain and held to the pool's behavior), with each "
                        "miss checked for whether a reactive policy reaches it (12 more runs)")
    s.add_argument("--plot", help="write replicas and p90 latency over time to this PNG")
    s.add_argument("--minutes", action="store_true",
                   help="also print each run minute by minute: arrivals, p90 TTFT and TPOT over their targets "
                        "(misses marked), and the replica counts after each tick (with --json: under \"minutes\")")
    s.add_argument("--tuned", help="the baselines' tuned knobs (JSON): read when the file exists, else tuned "
                                   "(on the trace's first half, or a scenario's seed 1) and written there")
    s.set_defaults(func=_simulate)
