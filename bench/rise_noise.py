"""How large prefill's burst room (``Autoscaler._rise`` through ``_beyond_noise``) reads at a steady load.

A steady Poisson stream has no bursts, so the room a reactive policy keeps for it should be about 1. This
draws such streams, measures the policy's rises on them as ``_rise`` does (the highest window demand of
the start-up after each tick over the level ``_forecast`` gives at it, and their ``--quantile``), and
prints the raw rise, the ``z`` it amounts to in relative standard deviations of a window's count, the
``z`` that ``_beyond_noise`` subtracts, and the room that is left. Demand is the window's arrivals/s
(one prompt's service, the same for all, cancels in the ratio).

    PYTHONSAFEPATH=1 .venv/bin/python bench/rise_noise.py [--rates 0.3,1.5,5] [--tick 15] [--draws 12]

Seeded and deterministic; a few seconds.
"""
from __future__ import annotations

import argparse
import math
from collections import deque
from statistics import NormalDist

import numpy as np

from tandem.operator.autoscaler.policy import Autoscaler


def rise_quantile(rng, rate: float, window: float, tick: float, startup: float, forecast_window: float,
                  quantile: float, minutes: float = 30.0, warm: float = 600.0) -> float:
    """The ``quantile`` of the rises over ``minutes`` of one steady Poisson stream at ``rate`` /s."""
    span = warm + minutes * 60 + startup
    arr = np.sort(rng.uniform(0, span, rng.poisson(rate * span)))
    ts = np.arange(window, span, tick)
    dem = (np.searchsorted(arr, ts, side="right") - np.searchsorted(arr, ts - window, side="right")) / window
    hist, levels = deque(), []
    for t, d in zip(ts, dem):
        hist.append((t, d))
        while hist and hist[0][0] < t - forecast_window:
            hist.popleft()
        levels.append(Autoscaler._forecast(hist, t + startup, d, 1.5)[0])
    m = int(round(startup / tick))
    rises = [dem[i + 1:i + 1 + m].max() / levels[i] for i in range(len(ts) - m)
             if ts[i] >= warm and levels[i] > 0]
    return float(np.quantile(rises, quantile))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.3,1.5,5", help="prompts/s (comma-separated)")
    ap.add_argument("--window", type=float, default=30.0, help="metrics window (s)")
    ap.add_argument("--tick", type=float, default=15.0, help="the policy's period (s)")
    ap.add_argument("--draws", type=int, default=12)
    args = ap.parse_args()
    defaults = Autoscaler.__init__.__kwdefaults__
    startup, fw, q = defaults["startup_s"], defaults["forecast_window_s"], defaults["burst_quantile"]
    z_policy = NormalDist().inv_cdf(q ** (1 / max(1.0, startup / args.window)))
    rng = np.random.default_rng(0)
    print(f"window {args.window:g} s, tick {args.tick:g} s, start-up {startup:g} s, forecast window {fw:g} s, "
          f"quantile {q:g}, {args.draws} draws of 30 min\n")
    print("| prompts/s | raw rise (median of draws) | its z | z _beyond_noise removes | room left |")
    print("|---|---|---|---|---|")
    for rate in (float(x) for x in args.rates.split(",")):
        qs = [rise_quantile(rng, rate, args.window, args.tick, startup, fw, q) for _ in range(args.draws)]
        raw = float(np.median(qs))
        sd = math.sqrt(1 / (rate * args.window))
        left = 1 + math.sqrt(max(0.0, (raw - 1) ** 2 - (z_policy * sd) ** 2))
        print(f"| {rate:g} | {raw:.3f} ({min(qs):.3f}-{max(qs):.3f}) | {(raw - 1) / sd:.2f} | {z_policy:.2f} | "
              f"{left:.3f} |")


if __name__ == "__main__":
    main()
