"""A sweep over request rates that stops by itself once the server saturates.

Saturation (either ends the sweep after the rate that shows it): throughput rises less than 5% from
one rate to the next, or p90 TTFT exceeds 10 times its value at the lowest rate. The answer is the
highest rate whose SLO attainment reaches ``attainment`` (default 0.9). A closed loop has no rate
and is never swept.
"""
from __future__ import annotations

import dataclasses

from tandem.worker.bench.metrics import summarize
from tandem.worker.bench.runner import LoadShape, RunResult

MIN_GAIN = 0.05
TTFT_BLOWUP = 10.0


def saturated(prev: dict, cur: dict, first: dict) -> str | None:
    """Why the sweep stops at ``cur`` (the summary after ``prev``), or None to go on."""
    if prev is not None and cur["request_throughput"] < prev["request_throughput"] * (1 + MIN_GAIN):
        return (f"throughput rose {cur['request_throughput'] / max(prev['request_throughput'], 1e-12) - 1:+.1%} "
                f"(< {MIN_GAIN:.0%})")
    if cur["ttft_ms"]["p90"] > TTFT_BLOWUP * first["ttft_ms"]["p90"]:
        return f"p90 TTFT {cur['ttft_ms']['p90']:.0f} ms > {TTFT_BLOWUP:g} x {first['ttft_ms']['p90']:.0f} ms"
    return None


async def sweep(run_one, rates: list[float], load: LoadShape, slo: dict, attainment: float = 0.9,
                percentiles=(50, 90, 99), on_point=None) -> dict:
    """Run ``run_one(load) -> RunResult`` at each rate in increasing order until saturation.

    Returns ``{"points": [summary...], "stopped": reason|None, "max_rate_meeting_slo": rate|None}``.
    Raises ValueError for a closed-loop load or an empty rate list."""
    if load.closed:
        raise ValueError("a fixed concurrency is a closed loop: it has no request rate to sweep")
    if not rates:
        raise ValueError("a sweep needs at least one rate")
    points, stopped, best = [], None, None
    for rate in sorted(rates):
        result: RunResult = await run_one(dataclasses.replace(load, rate=rate))
        s = summarize(result, slo, percentiles)
        points.append(s)
        if on_point:
            on_point(s, result)
        if slo and s["slo_attainment"] is not None and s["slo_attainment"] >= attainment:
            best = rate
        stopped = saturated(points[-2] if len(points) > 1 else None, s, points[0])
        if stopped:
            stopped = f"at {rate}/s: {stopped}"
            break
    return {"points": points, "stopped": stopped, "max_rate_meeting_slo": best, "slo": slo,
            "attainment_target": attainment}
