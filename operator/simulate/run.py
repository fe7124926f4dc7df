"""One simulation run end to end (trace + pool + calibration + policy -> metrics), the baselines' tuning,
and the table of every policy on every scenario.

Metrics (docs/autoscaler.md, "The simulator"):
- attainment (TTFT, TPOT): the share of 60-s windows of the run (with requests in them) whose p90 meets
  the target, the SLO being a p90; ``request_share`` gives the share of single requests under target.
- goodput: requests/s meeting both targets (DistServe's definition).
- GPU-hours: every replica from creation (start-up included) to gone, times its GPUs.
- actions: decisions that changed a role's count; direction changes: up after down or down after up;
  ``flaps_per_10min``: the most direction changes of a role within any 10 simulated minutes inside the
  scenario's steady spans (``n/a`` in the table where a run has none: diurnal, bursts, plain traces).
- windows: the run's duration in 60-s windows; what completes after the last one (streams still
  running when the trace ends) counts in the last.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.policy import Autoscaler
from tandem.operator.simulate import baselines as B
from tandem.operator.simulate import scenarios as S
from tandem.operator.simulate.fleet import ROLES, Fleet

POLICIES = ("tandem", "static", "hpa-queue", "hpa-slo", "apa", "kpa", "dynamo", "apa-variant", "dynamo-variant",
            "oracle", "oracle-reactive")
#: Policies that measure the others and are not peers to beat.
YARDSTICKS = ("oracle", "oracle-reactive")
#: The earlier stand-ins for AIBrix APA and Dynamo (baselines module docs): in the table, not peers.
VARIANTS = ("apa-variant", "dynamo-variant")
#: Per-role SLO fractions of the latency-driven baselines (prefill TTFT x decode TPOT): a p90 TPOT under
#: 0.67x its SLO is out of reach (a lone sequence's step is SLO / 1.5), so decode's fractions start above it.
_FRACTIONS = [{"prefill_fraction": p, "decode_fraction": d} for p in (0.5, 0.7, 0.9) for d in (0.75, 0.85, 0.95)]
#: Each baseline's knob grid (tuned on seed 1, per scenario): 9 settings each, tandem's budget
#: (:data:`TANDEM_GRID`), per role where upstream configures each role apart.
GRIDS = {
    "hpa-queue": [{"prefill_q": p, "decode_q": d} for p in (0.5, 1.0, 2.0) for d in (0.25, 0.5, 1.0)],
    "hpa-slo": _FRACTIONS,
    "apa": _FRACTIONS,
    "kpa": [{"prefill_c": p, "decode_c": d} for p in (0.5, 1.0, 2.0) for d in (0.5, 1.0, 1.5)],
    # Dynamo configures the planner once, by its --itl (--ttft does not enter the count,
    # baselines.DynamoPlanner); below 0.67x the TPOT SLO (a lone sequence's step) the planner plans one
    # sequence per replica whatever the setting, so three settings span the knob's range (each run fits
    # auto-ARIMA 45 times: 1-2 minutes on a loaded 2-core machine)
    "dynamo": [{"itl_fraction": f} for f in (0.7, 0.85, 1.0)],
    "dynamo-variant": [{"scale": s} for s in (0.15, 0.2, 0.3, 0.5, 0.7)],
    "apa-variant": [{"fraction": f} for f in (0.5, 0.6, 0.7, 0.85)],
    "oracle": [{"utilization": u} for u in (1.0, 1.25, 1.5, 2.0)],
    "oracle-reactive": [{"utilization": u} for u in (0.6, 0.8, 1.0, 1.25, 1.5, 2.0)],
}
#: The reactive oracle held to the pool's scaling behavior (baselines.BehavedReactiveOracle): a second
#: judge in :func:`reach`, not in the table; it runs on the plain reactive oracle's grid.
BEHAVED = "oracle-reactive-behaved"
GRIDS[BEHAVED] = GRIDS["oracle-reactive"]
#: The aims :func:`reach` judges (by their opening words): attainment, cost and the comparisons.
REACH_AIMS = ("attainment", "GPU-hours", "beats")
#: The two aims every other aim is weighed against in :func:`reach`.
COST_AIM = "GPU-hours <= 1.1x reactive oracle"
CORE_AIMS = ("attainment >= 95% (TTFT and TPOT)", COST_AIM)
#: The opening of :func:`reach`'s verdict on an aim only the oracle held to the pool's behavior reaches.
HELD_REACHABLE = "reachable held to the pool's behavior"
#: The opening of :func:`reach`'s verdict on an aim that only a setting chosen on the evaluation seed reaches.
TUNED_ONLY = "reachable only by a setting chosen on this seed"
#: The seed every baseline's knobs and tandem's defaults are tuned on (issue 25: nothing else may be).
TUNING_SEED = 1
#: issue 25's cost aim: at most this times the reactive oracle's GPU-hours at its best setting with the
#: same attainment (:func:`reactive_yardstick`)
COST_FACTOR = 1.1
#: tandem's own knobs (``Autoscaler``'s headroom and catch_up_s): one setting for every scenario, since a
#: policy ships with one set of defaults; the committed defaults are this grid's pick on seed 1.
TANDEM_GRID = [{"headroom": h, "catch_up_s": c} for h in (0.8, 0.9, 1.0) for c in (60.0, 120.0, 240.0)]
TUNED_FILE = Path(__file__).with_name("tuned.json")
ATTAINMENT_AIM = 0.95


def replica_bounds(spec) -> dict:
    """{role: (minReplicas, maxReplicas)} of a pool spec (a role without autoscaling: its fixed count)."""
    from tandem.operator.autoscaler.policy import RoleLimits
    out = {}
    for role in ROLES:
        lim = RoleLimits.of(getattr(spec, role), 1.0)
        out[role] = (lim.min, lim.max)
    return out


def make_policy(name: str, spec, perf: PerfModel, calibration, targets: dict, minutes: list,
                knobs: Optional[dict] = None, max_replicas: Optional[int] = None, startup_s: float = S.STARTUP_S):
    """A policy object by name; the baselines' own bound is the spec's largest maxReplicas (the
    simulator holds each role to its own, :func:`replica_bounds`). Raises ValueError for an unknown name."""
    k = dict(knobs or {})
    if max_replicas is None:
        max_replicas = max(hi for _, hi in replica_bounds(spec).values())
    if name == "tandem":
        return Autoscaler(spec, calibration, startup_s=startup_s, **k)
    if name == "static":
        return B.Static(**(k or {"prefill": 6, "decode": 6}))
    if name == "hpa-queue":
        return B.HPAQueue(**{"prefill_q": 1.0, "decode_q": 0.5, **k}, max_replicas=max_replicas)
    if name == "hpa-slo":
        return B.HPASLO(targets, **k, max_replicas=max_replicas)
    if name == "apa":
        return B.APA(targets, **k, max_replicas=max_replicas)
    if name == "kpa":
        return B.KPA(**k, max_replicas=max_replicas)
    if name == "dynamo":
        return B.DynamoPlanner(perf, targets, **k, max_replicas=max_replicas,
                               gpu_budget=sum(hi for _, hi in replica_bounds(spec).values()))
    if name == "apa-variant":
        return B.APAVariant(targets, **k, max_replicas=max_replicas)
    if name == "dynamo-variant":
        return B.DynamoVariant(perf, targets, **k, max_replicas=max_replicas)
    if name == "oracle":
        return B.Oracle(perf, targets, minutes, **k, max_replicas=max_replicas)
    if name == "oracle-reactive":
        return B.ReactiveOracle(perf, targets, minutes, **k, max_replicas=max_replicas)
    if name == BEHAVED:
        from tandem.operator.autoscaler.policy import RoleLimits
        behavior = {r: RoleLimits.of(getattr(spec, r), 1.0) for r in ROLES}
        return B.BehavedReactiveOracle(perf, targets, minutes, behavior, **k, max_replicas=max_replicas)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")


def simulate(policy, records: list, perf: PerfModel, targets: dict, initial: dict, duration: float,
             startup_s: float = S.STARTUP_S, gpus: Optional[dict] = None, tick_s: float = 15.0,
             bounds: Optional[dict] = None, block_tokens: int = 512) -> Fleet:
    return Fleet(perf, policy, records, initial, startup_s=startup_s, tick_s=tick_s, targets=targets,
                 gpus=gpus, duration=duration, bounds=bounds, block_tokens=block_tokens).run()


def _windows(t: np.ndarray, v: np.ndarray, end: float, width: float = 60.0) -> np.ndarray:
    """p90 of v per window of completion time t, ``end / width`` windows, the last one taking whatever
    completes after it (NaN where a window is empty)."""
    n = int(math.ceil(end / width))
    out = np.full(n, np.nan)
    idx = np.minimum((t // width).astype(int), n - 1)
    for w in range(n):
        sel = v[idx == w]
        if sel.size:
            out[w] = np.percentile(sel, 90)
    return out


def _direction_changes(deltas: list[tuple[float, int]]) -> list[float]:
    """Times at which a role's scaling direction flipped."""
    out, last = [], 0
    for t, d in deltas:
        s = (d > 0) - (d < 0)
        if s and last and s != last:
            out.append(t)
        if s:
            last = s
    return out


def minute_p90s(first_token: np.ndarray, ttft: np.ndarray, finish: np.ndarray, tpot: np.ndarray,
                duration: float) -> tuple[np.ndarray, np.ndarray]:
    """(p90 TTFT, p90 TPOT) per 60-s window of a run (s; NaN where a window has none), from per-request
    arrays (s, NaN where a request has none): TTFT by first-token time, TPOT by finish time, what
    completes after the last window counting in it. The attainment's minutes (:func:`summarize`) and
    ``tandem simulate --minutes`` / ``--plot``."""
    has_ft, has_tpot = ~np.isnan(first_token), ~np.isnan(tpot)
    return (_windows(first_token[has_ft], ttft[has_ft], duration),
            _windows(finish[has_tpot], tpot[has_tpot], duration))


def summarize(fleet: Fleet, targets: dict, steady: list, duration: float) -> dict:
    """The run's metrics (see module docs)."""
    reqs = fleet.requests
    ft = np.array([r.first_token for r in reqs])
    ttft = np.array([r.ttft for r in reqs])
    fin = np.array([r.finish for r in reqs])
    tpot = np.array([r.tpot for r in reqs])
    done = ~np.isnan(fin)
    # the run's windows: what completes after the last one (the streams still running when the trace
    # ends) counts in it, not in a window of its own that holds a handful of requests
    w_ttft, w_tpot = minute_p90s(ft, ttft, fin, tpot, duration)
    has_tpot = ~np.isnan(tpot)
    att_ttft = float(np.mean(w_ttft[~np.isnan(w_ttft)] <= targets["prefill"] + 1e-12))
    att_tpot = float(np.mean(w_tpot[~np.isnan(w_tpot)] <= targets["decode"] + 1e-12))
    ok = (ttft <= targets["prefill"]) & (np.isnan(tpot) | (tpot <= targets["decode"]))
    gpu_s = sum((min(r.gone_at, fleet.end) - r.created) * fleet.gpus[r.role] for r in fleet.replicas)
    out = {"requests": len(reqs), "finished": int(done.sum()),
           "attainment_ttft": round(att_ttft, 4), "attainment_tpot": round(att_tpot, 4),
           "request_share_ttft": round(float(np.mean(ttft <= targets["prefill"])), 4),
           "request_share_tpot": round(float(np.mean(tpot[has_tpot] <= targets["decode"])), 4),
           "p90_ttft": round(float(np.nanpercentile(ttft, 90)), 4),
           "p90_tpot": round(float(np.nanpercentile(tpot, 90)), 4),
           "goodput_rps": round(float(ok.sum()) / duration, 4),
           "gpu_hours": round(gpu_s / 3600.0, 4),
           "local_prefills": int(sum(r.local for r in reqs)), "steady_spans": len(steady)}
    for role in ROLES:
        deltas = [(d.at, d.role(role).delta) for d in fleet.decisions if d.role(role).delta != 0]
        flips = _direction_changes(deltas)
        worst = 0
        for a, b in steady:
            for t0 in np.arange(a, max(a, b - 600.0) + 1e-9, 15.0):
                worst = max(worst, sum(1 for t in flips if t0 <= t < t0 + 600.0 and t < b))
        # a trace shorter than the first tick has no timeline: the fleet it started with
        counts = [x[role] for x in fleet.timeline] or [fleet.initial[role]]
        out[role] = {"actions": len(deltas), "direction_changes": len(flips), "flaps_per_10min": worst,
                     "mean_replicas": round(float(np.mean(counts)), 3), "max_replicas": int(max(counts))}
    return out


def run_one(name: str, sc: S.Scenario, perf: PerfModel, calibration, knobs: Optional[dict] = None,
            spec=None) -> tuple[dict, Fleet]:
    """(metrics, fleet) of one policy on one scenario."""
    from tandem.operator.spec import load_manifest
    spec = spec or load_manifest(S.manifest(sc)).spec
    minutes = S.minute_loads(sc.records, perf=perf)
    pol = make_policy(name, spec, perf, calibration, sc.targets, minutes, knobs)
    if name == "static":
        initial = dict(pol.counts)
    else:
        # every autoscaled policy starts from the fleet the first minute's load needs, as if it had been
        # running before the trace began (else a cold start would dominate the first minutes of every
        # scenario)
        initial = B.Oracle(perf, sc.targets, minutes).need(minutes[0])
    fleet = simulate(pol, sc.records, perf, sc.targets, initial, S.DURATION, bounds=replica_bounds(spec))
    m = summarize(fleet, sc.targets, sc.steady, S.DURATION)
    m["policy"], m["knobs"] = name, knobs or {}
    if sc.name in ("prompt-shift", "output-shift"):
        m["steady_change"] = steady_change(fleet)
    return m, fleet


def meets(m: dict) -> bool:
    return m["attainment_ttft"] >= ATTAINMENT_AIM and m["attainment_tpot"] >= ATTAINMENT_AIM


def _best(results: list[dict]) -> dict:
    """The cheapest setting meeting the SLOs; when none does, the one with the best attainment."""
    good = [m for m in results if meets(m)]
    if good:
        return min(good, key=lambda m: m["gpu_hours"])
    return max(results, key=lambda m: (min(m["attainment_ttft"], m["attainment_tpot"]), -m["gpu_hours"]))


def tune_static(sc: S.Scenario, perf: PerfModel, calibration, most: Optional[int] = None) -> dict:
    """The fewest replicas per role meeting the SLOs (each role bisected with the other role ample, up to
    ``most``: the scenario's maxReplicas by default)."""
    most = most or sc.max_replicas
    def ok(p, d, role):
        m, _ = run_one("static", sc, perf, calibration, {"prefill": p, "decode": d})
        key = "attainment_ttft" if role == "prefill" else "attainment_tpot"
        return m[key] >= ATTAINMENT_AIM

    def least(role):
        lo, hi = 1, most
        if not ok(*((hi, most) if role == "prefill" else (most, hi)), role):
            return most
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(*((mid, most) if role == "prefill" else (most, mid)), role):
                hi = mid
            else:
                lo = mid + 1
        return lo
    return {"prefill": least("prefill"), "decode": least("decode")}


def tune(name: str, sc: S.Scenario, perf: PerfModel, calibration) -> dict:
    """A baseline's knobs for a scenario (pass the tuning seed's scenario)."""
    if name == "static":
        return tune_static(sc, perf, calibration)
    if name not in GRIDS:
        return {}
    results = [run_one(name, sc, perf, calibration, k)[0] for k in GRIDS[name]]
    return _best(results)["knobs"]


def tune_all(perf: PerfModel, calibration, seed: int = 1, names=S.NAMES) -> dict:
    """{scenario: {policy: knobs}} on the tuning seed."""
    out = {}
    for n in names:
        sc = S.build(n, perf, seed)
        out[n] = {p: tune(p, sc, perf, calibration) for p in POLICIES if p != "tandem"}
    return out


def tuned_file(calibration=None) -> Path:
    """Where the knobs tuned on a calibration are committed: :data:`TUNED_FILE` for the scenarios'
    calibration (``None``), ``tuned-<calibration file's stem>.json`` beside it for another one."""
    return TUNED_FILE if calibration is None else TUNED_FILE.with_name(f"tuned-{Path(calibration).stem}.json")


def load_tuned(calibration=None) -> dict:
    """{scenario: {baseline: knobs}} tuned on a calibration (see :func:`tuned_file`); {} if none was."""
    f = tuned_file(calibration)
    return json.loads(f.read_text()) if f.exists() else {}


def table(perf: PerfModel, calibration, tuned: dict, seed: int = 0, names=S.NAMES) -> dict:
    """{scenario: {policy: metrics}} on the evaluation seed with the tuned knobs: tandem and every policy
    tuned for the scenario (one left out of ``tuned`` is left out of the table, not run untuned)."""
    out = {}
    for n in names:
        sc = S.build(n, perf, seed)
        out[n] = {}
        for p in POLICIES:
            if p == "tandem" or p in tuned.get(n, {}):
                out[n][p] = run_one(p, sc, perf, calibration, tuned[n][p] if p != "tandem" else None)[0]
    return out


def format_table(tab: dict) -> str:
    """A Markdown table: one row per scenario and policy."""
    head = ("| scenario | policy | TTFT att. | TPOT att. | p90 TTFT s | p90 TPOT s | goodput req/s | GPU-h | "
            "prefill mean/max | decode mean/max | actions P/D | dir. changes P/D | flaps/10min P/D |")
    lines = [head, "|" + "---|" * 13]
    for n, pols in tab.items():
        for p, m in pols.items():
            lines.append(f"| {n} | {p} | {m['attainment_ttft']:.1%} | {m['attainment_tpot']:.1%} | "
                         f"{m['p90_ttft']:.2f} | {m['p90_tpot']:.3f} | {m['goodput_rps']:.3f} | {m['gpu_hours']:.2f} | "
                         f"{m['prefill']['mean_replicas']:.1f}/{m['prefill']['max_replicas']} | "
                         f"{m['decode']['mean_replicas']:.1f}/{m['decode']['max_replicas']} | "
                         f"{m['prefill']['actions']}/{m['decode']['actions']} | "
                         f"{m['prefill']['direction_changes']}/{m['decode']['direction_changes']} | "
                         + (f"{m['prefill']['flaps_per_10min']}/{m['decode']['flaps_per_10min']} |"
                            if m.get("steady_spans") else "n/a |"))
    return "\n".join(lines)


def steady_change(fleet: Fleet, at: float = S.SHIFT_AT, settle: float = 600.0) -> dict:
    """Per role: the median count over the ``settle`` seconds before the shift and after it has settled
    (from ``at + settle`` to the end), and the difference."""
    out = {}
    for r in ROLES:
        before = [x[r] for x in fleet.timeline if at - settle <= x["t"] < at]
        after = [x[r] for x in fleet.timeline if x["t"] >= at + settle]
        b, a = float(np.median(before)), float(np.median(after))
        out[r] = {"before": b, "after": a, "change": a - b}
    return out


def _att(m: dict) -> float:
    return min(m["attainment_ttft"], m["attainment_tpot"])


def yardsticks(frontier: dict, behaved: Optional[dict] = None) -> dict:
    """{scenario: [metrics]}: the settings the cost aim (:data:`COST_AIM`) is judged against, the reactive
    oracle's (:func:`reactive_frontier`) and, given, those of the one held to the pool's behavior
    (:data:`BEHAVED`). Both see only the present, so the cheaper of the two at an attainment is what such
    a policy can do: held to the behavior the oracle keeps replicas through a scale-down window, and on
    the CPU calibration's step that meets 95% at utilization 1.5 for less than the plain oracle's
    cheapest setting at 95%."""
    return {sc: list(points) + list((behaved or {}).get(sc, [])) for sc, points in frontier.items()}


def reactive_yardstick(points: list[dict], attainment: float) -> Optional[dict]:
    """The reactive oracle at its best setting with the same attainment (issue 25's cost yardstick): of
    its settings (:func:`reactive_frontier`'s metrics for one scenario), the cheapest whose attainment
    (the lower of TTFT's and TPOT's) reaches ``attainment``, capped at the 95% aim (a policy above the
    aim is held to what meeting the aim costs); None when no setting reaches it."""
    need = min(attainment, ATTAINMENT_AIM) - 1e-9
    reaching = [m for m in points if _att(m) >= need]
    return min(reaching, key=lambda m: m["gpu_hours"]) if reaching else None


def _cost_ok(m: dict, points: list[dict]) -> tuple[bool, str]:
    """(ok, detail) of :data:`COST_AIM` for a run's metrics against the reactive oracle's settings."""
    y = reactive_yardstick(points, _att(m))
    if y is None:
        return True, (f"{m['gpu_hours']:.2f}; no setting of the reactive oracle reaches "
                      f"{min(_att(m), ATTAINMENT_AIM):.1%}")
    return (m["gpu_hours"] <= COST_FACTOR * y["gpu_hours"] + 1e-9,
            f"{m['gpu_hours']:.2f} vs {y['gpu_hours']:.2f} (x{m['gpu_hours'] / y['gpu_hours']:.2f}; the reactive "
            f"oracle{' held to the behavior' if y.get('policy') == BEHAVED else ''} at utilization "
            f"{y['knobs']['utilization']:g}, attainment {_att(y):.1%})")


def aims(tab: dict, frontier: Optional[dict] = None) -> list[dict]:
    """Issues 10's and 25's aims for tandem's policy, each {scenario, aim, ok, detail}, from a table (see
    table()); the cost aim (:data:`COST_AIM`) needs the reactive oracle's settings on each scenario
    (``frontier``: :func:`yardsticks`, or :func:`reactive_frontier` alone) and is left out without them."""
    out = []

    def add(sc, aim, ok, detail):
        out.append({"scenario": sc, "aim": aim, "ok": bool(ok), "detail": detail})
    failing = {p: [] for p in POLICIES if p != "tandem" and p not in YARDSTICKS and p not in VARIANTS}
    for sc, pols in tab.items():
        t, o = pols["tandem"], pols.get("oracle")
        points = (frontier or {}).get(sc)
        add(sc, "attainment >= 95% (TTFT and TPOT)", meets(t),
            f"TTFT {t['attainment_ttft']:.1%}, TPOT {t['attainment_tpot']:.1%}")
        if points:
            ok, detail = _cost_ok(t, points)
            add(sc, COST_AIM, ok, detail + (f"; the oracle with foresight {o['gpu_hours']:.2f}" if o else ""))
        if sc in ("diurnal", "bursts") and "static" in pols:
            st = pols["static"]
            add(sc, "GPU-hours <= 0.7x best static", t["gpu_hours"] <= 0.7 * st["gpu_hours"] + 1e-9,
                f"{t['gpu_hours']:.2f} vs {st['gpu_hours']:.2f} (x{t['gpu_hours'] / st['gpu_hours']:.2f}; static "
                f"{'meets' if meets(st) else 'misses'} the SLO)")
        if t.get("steady_spans"):   # diurnal and bursts never hold a steady load: the aim has nothing to judge
            flaps = max(t["prefill"]["flaps_per_10min"], t["decode"]["flaps_per_10min"])
            add(sc, "<= 2 direction changes per pool per 10 min at steady load", flaps <= 2,
                f"prefill {t['prefill']['flaps_per_10min']}, decode {t['decode']['flaps_per_10min']}")
        if "steady_change" in t:
            ch = t["steady_change"]
            grow, other = ("prefill", "decode") if sc == "prompt-shift" else ("decode", "prefill")
            oc = (o or {}).get("steady_change", {})
            add(sc, f"{grow} grows, {other} changes by <= 1", ch[grow]["change"] > 0 and abs(ch[other]["change"]) <= 1,
                f"{grow} {ch[grow]['before']:g} -> {ch[grow]['after']:g}, {other} {ch[other]['before']:g} -> "
                f"{ch[other]['after']:g} (medians; the oracle: {other} {oc[other]['before']:g} -> "
                f"{oc[other]['after']:g})" if oc else "")
        for p in failing:
            if p not in pols:
                continue
            b = pols[p]
            better = (_att(t) > _att(b) and t["gpu_hours"] <= b["gpu_hours"]) or \
                     (t["gpu_hours"] < b["gpu_hours"] and _att(t) >= _att(b))
            add(sc, f"beats {p}", better, f"attainment {_att(t):.1%} vs {_att(b):.1%}, GPU-h {t['gpu_hours']:.2f} vs "
                                          f"{b['gpu_hours']:.2f}")
            if not meets(b) or (points and not _cost_ok(b, points)[0]):
                failing[p].append(sc)
    for p, where in failing.items():
        if not any(p in pols for pols in tab.values()):
            continue
        add("all", f"{p} fails somewhere (SLO, or GPU-h > {COST_FACTOR:g}x reactive oracle)", bool(where),
            ", ".join(where) or "nowhere")
    return out


def reactive_frontier(perf: PerfModel, calibration, seed: int = 0, names=S.NAMES,
                      policy: str = "oracle-reactive") -> dict:
    """{scenario: [metrics]}: the reactive oracle (or ``policy``: :data:`BEHAVED`, the one held to the pool's
    behavior) at every setting of its grid, on the evaluation seed."""
    out = {}
    for n in names:
        sc = S.build(n, perf, seed)
        out[n] = [run_one(policy, sc, perf, calibration, k)[0] for k in GRIDS[policy]]
    return out


def reach(tab: dict, frontier: dict, behaved: Optional[dict] = None, tuning: Optional[tuple] = None) -> dict:
    """{(scenario, aim): verdict} for the aims of :func:`aims` on attainment, cost and the comparisons
    with the peers (:data:`REACH_AIMS`; not the "all" rows), asking whether a
    reactive policy can reach it: each setting of the reactive oracle (:func:`reactive_frontier`) is put
    in tandem's place and the aims evaluated (the cost aim's yardstick stays :func:`yardsticks`: both
    frontiers). Verdicts:

    - ``"out of reach"``: no setting meets the aim;
    - ``"only by missing <aim>"``: the settings that meet it all miss a core aim (:data:`CORE_AIMS`);
    - ``"reachable"``: some setting meets it and both core aims.

    With ``behaved`` (the same for :data:`BEHAVED`, the reactive oracle held to the pool's scaling
    behavior as tandem's policy is), an aim reachable above is judged again in a world where every
    reactive policy keeps that behavior: the behaved settings are the yardstick of the cost aim there,
    and the candidates in tandem's place. The cost aim itself is excused when tandem meets it against
    that yardstick; another aim when no behaved setting reaches it. The verdict is then ``"reachable
    only past the pool's behavior: <why>"``; otherwise it stays ``"reachable"``, tandem's own. The other
    way round, an aim no plain setting reaches may be reached held to the behavior (the scale-down window
    keeps replicas that the next rise then finds ready): ``"reachable held to the pool's behavior: <the
    cheapest such setting>"``, tandem's own too (:func:`is_own`).

    With ``tuning`` (``(frontier, behaved)``: both oracles' settings on :data:`TUNING_SEED`, for a table
    of another seed), a miss that is tandem's own is judged once more with only the settings that tuning
    on that seed could choose, as tandem's defaults and every baseline's knobs were: those meeting both
    core aims there (:func:`tuned_settings`). If it is no longer tandem's own, the verdict is
    ``"reachable only by a setting chosen on this seed: <why>"``. The aims table is unchanged: its cost
    yardstick is still the best setting on the evaluation seed itself, chosen in hindsight of it.

    Foresight (the oracle) or hindsight (the best static fleet) can do what no setting here does: an
    aim out of reach here is out of reach for any policy that sizes from the load it has seen."""
    out = {}
    kept = tuned_settings(*tuning) if tuning else None
    # only a re-judgement needs to know which aims tandem misses
    missed = {(r["scenario"], r["aim"]) for r in aims(tab, yardsticks(frontier, behaved)) if not r["ok"]} \
        if kept is not None else set()
    for sc, points in frontier.items():
        held_points = (behaved or {}).get(sc)
        verdicts = _reach_one(tab, sc, points, held_points, yardsticks({sc: points}, behaved)[sc])
        own = [aim for aim, v in verdicts.items() if is_own(v) and (sc, aim) in missed]
        if kept is not None and own and sc in kept[0] and (not held_points or sc in kept[1]):
            # the world where every reactive policy is tuned where tandem was: its candidates, and its
            # cost yardstick, are the settings tuning could choose
            plain_t = [m for m in points if _setting(m) in kept[0][sc]]
            held_t = [m for m in held_points or [] if _setting(m) in kept[1].get(sc, ())] or None
            tuned = _reach_one(tab, sc, plain_t, held_t, yardsticks({sc: plain_t}, {sc: held_t or []})[sc])
            for aim in own:   # only ever excused: a miss not tandem's own stays as it was judged
                if not is_own(tuned[aim]):
                    verdicts[aim] = (f"{TUNED_ONLY}: of the settings that tuning on seed {TUNING_SEED} could choose, "
                                     f"as tandem's were, {tuned[aim]}; of every setting, {verdicts[aim]}")
        out.update({(sc, aim): v for aim, v in verdicts.items()})
    return out


def _setting(m: dict) -> float:
    return m["knobs"]["utilization"]


def tuned_settings(frontier: dict, behaved: Optional[dict] = None) -> tuple[dict, dict]:
    """({scenario: {utilization}}, the same held to the behavior): the reactive oracle's settings that tuning
    on :data:`TUNING_SEED` could choose, from both oracles' settings on that seed: those meeting both core
    aims there (attainment, and the cost aim against that seed's yardsticks: both oracles' settings for the
    plain one, the held oracle's own for the held one, as :func:`reach` judges each world). Where none
    does, the one :func:`tune` picks then (the best attainment), as a baseline's knobs would be."""
    def ok(points, yard):
        good = {_setting(m) for m in points if meets(m) and _cost_ok(m, yard)[0]}
        return good or ({_setting(_best(points))} if points else set())
    both = yardsticks(frontier, behaved)
    return ({sc: ok(points, both[sc]) for sc, points in frontier.items()},
            {sc: ok(points, points) for sc, points in (behaved or {}).items()})


def _reach_one(tab: dict, sc: str, points: list[dict], held_points: Optional[list[dict]], yard: list[dict]) -> dict:
    """:func:`reach`'s verdicts for one scenario: ``points`` the plain oracle's settings in tandem's place,
    ``held_points`` the held one's (None without), ``yard`` the aims' cost yardstick."""
    plain = _verdicts(tab, sc, points, yard)
    witness: dict = {}
    held = _verdicts(tab, sc, held_points, held_points, witness) if held_points else {}
    out = {}
    for aim, v in plain.items():
        if v != "reachable" and held.get(aim) == "reachable":
            w = witness[aim]
            v = (f"{HELD_REACHABLE}: the reactive oracle held to it at utilization {_setting(w):g}, "
                 f"TTFT / TPOT {w['attainment_ttft']:.1%} / {w['attainment_tpot']:.1%} at {w['gpu_hours']:.2f} "
                 f"GPU-h (plain: {v})")
        elif v == "reachable" and held:
            if aim == COST_AIM:
                ok, detail = _cost_ok(tab[sc]["tandem"], held_points)
                if ok:
                    v = (f"reachable only past the pool's behavior: against the reactive oracle held to it "
                         f"tandem meets it, {detail}")
            elif held[aim] != "reachable":
                v = f"reachable only past the pool's behavior: held to it, {held[aim]}"
        out[aim] = v
    return out


def is_own(verdict: str) -> bool:
    """Whether a :func:`reach` verdict makes the miss tandem's own: a reactive policy that keeps the pool's
    behavior, as tandem does, meets the aim and both core aims."""
    return verdict == "reachable" or verdict.startswith(HELD_REACHABLE)


def _verdicts(tab: dict, sc: str, candidates: list[dict], yardstick: list[dict],
              witness: Optional[dict] = None) -> dict:
    """{aim: verdict} of :func:`reach` for one scenario, ``candidates`` in tandem's place; ``witness``, when
    given, gets {aim: the cheapest candidate meeting it and both core aims} for each reachable aim."""
    per_point = [{r["aim"]: r["ok"] for r in aims({sc: {**tab[sc], "tandem": m}}, {sc: yardstick})
                  if r["scenario"] == sc}
                 for m in candidates]
    # with no candidate, every aim is out of reach
    names = per_point[0] if per_point else [r["aim"] for r in aims({sc: tab[sc]}, {sc: yardstick})
                                             if r["scenario"] == sc]
    out = {}
    for aim in names:
        if not aim.startswith(REACH_AIMS):
            continue   # direction changes and the shifts' split depend on smoothing, not on reaching
        meeting = [ok for ok in per_point if ok[aim]]
        if not meeting:
            out[aim] = "out of reach"
        elif any(all(ok[c] for c in CORE_AIMS) for ok in meeting):
            out[aim] = "reachable"
            if witness is not None:
                witness[aim] = min((m for m, ok in zip(candidates, per_point)
                                    if ok[aim] and all(ok[c] for c in CORE_AIMS)), key=lambda m: m["gpu_hours"])
        else:
            missed = sorted({c for ok in meeting for c in CORE_AIMS if not ok[c]})
            out[aim] = "only by missing " + " or ".join(missed)
    return out


def format_frontier(frontier: dict) -> str:
    """A Markdown table of the reactive oracle's settings (or :data:`BEHAVED`'s): attainment and GPU-hours
    per scenario."""
    us = [k["utilization"] for k in GRIDS["oracle-reactive"]]
    lines = ["| scenario | " + " | ".join(f"u={u:g}" for u in us) + " |", "|" + "---|" * (len(us) + 1),
             "| | " + " | ".join("TTFT / TPOT att., GPU-h" for _ in us) + " |"]
    for sc, points in frontier.items():
        lines.append(f"| {sc} | " + " | ".join(f"{m['attainment_ttft']:.1%} / {m['attainment_tpot']:.1%}, "
                                                f"{m['gpu_hours']:.2f}" for m in points) + " |")
    return "\n".join(lines)


def judge(tab: dict, frontier: dict, behaved: Optional[dict] = None,
          tuning: Optional[tuple] = None) -> tuple[list[dict], dict]:
    """(rows, verdicts): :func:`aims` with the cost aim against :func:`yardsticks` of both frontiers, and
    :func:`reach`'s verdict on each miss (``frontier``: the reactive oracle's settings per scenario,
    ``behaved``: the same held to the pool's behavior, ``tuning``: both on :data:`TUNING_SEED` when the
    table is of another seed). What ``tune``, ``tandem simulate --aims`` and bench/trace_table.py print."""
    return aims(tab, yardsticks(frontier, behaved)), reach(tab, frontier, behaved, tuning)


def format_reach(rows: list[dict], verdicts: dict) -> str:
    """The missed aims with :func:`reach`'s verdict on each."""
    lines = ["| scenario | missed aim | can a reactive policy reach it? |", "|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['aim']} | {verdicts[(r['scenario'], r['aim'])]} |"
              for r in rows if not r["ok"] and (r["scenario"], r["aim"]) in verdicts]
    return "\n".join(lines)


def format_judgement(tab: dict, frontier: dict, behaved: dict, where: str = "",
                     tuning: Optional[tuple] = None) -> str:
    """The table, the aims (:func:`judge`), both frontiers and the verdicts on the misses, in Markdown;
    ``where`` follows the frontiers' headings (e.g. " (seed 0)"); ``tuning`` as for :func:`judge`, whose
    frontiers and the settings tuning picks from them follow."""
    rows, verdicts = judge(tab, frontier, behaved, tuning)
    text = (format_table(tab) + "\n\n" + format_aims(rows) + f"\n\nThe reactive oracle at every setting{where}:\n\n"
            + format_frontier(frontier) + f"\n\nThe same, held to the pool's scaling behavior{where}:\n\n"
            + format_frontier(behaved))
    if tuning:
        plain_ok, held_ok = tuned_settings(*tuning)
        text += (f"\n\nBoth on the tuning seed ({TUNING_SEED}), plain then held; the settings meeting both core aims "
                 "there, which tuning could choose: "
                 + "; ".join(f"{sc} {sorted(plain_ok[sc])} / {sorted(held_ok.get(sc, ()))}" for sc in plain_ok)
                 + "\n\n" + format_frontier(tuning[0]) + "\n\n" + format_frontier(tuning[1]))
    return text + "\n\n" + format_reach(rows, verdicts)


def format_aims(rows: list[dict]) -> str:
    lines = ["| scenario | aim | met | detail |", "|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['aim']} | {'yes' if r['ok'] else '**no**'} | {r['detail']} |" for r in rows]
    return "\n".join(lines)
