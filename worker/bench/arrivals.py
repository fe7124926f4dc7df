"""Send schedules drawn up front from a seed (an open loop: the server's speed never moves them).

Gamma inter-arrival times with a burstiness factor follow vLLM's ``vllm bench serve --burstiness``:
shape = burstiness, scale = 1 / (rate * burstiness), so the mean rate is ``rate`` whatever the
burstiness, 1 is Poisson, below 1 is burstier and above 1 is smoother.
"""
from __future__ import annotations

import numpy as np

KINDS = ("poisson", "gamma", "constant", "ramp", "trace")


def schedule(kind: str, n: int, rate: float = 1.0, seed: int = 0, burstiness: float = 1.0,
             ramp_end_rate: float | None = None, timestamps: list[float] | None = None) -> np.ndarray:
    """Intended send offsets (seconds from the start, non-decreasing) of ``n`` requests.

    Args:
        kind: ``poisson``, ``gamma`` (with ``burstiness``), ``constant`` (every 1/rate s), ``ramp``
            (Poisson whose rate rises linearly from ``rate`` to ``ramp_end_rate`` over the n
            requests, as vLLM's ``--ramp-up-strategy linear``) or ``trace`` (``timestamps`` as given,
            shifted so the first is 0).
        rate: requests per second (``inf`` sends everything at once).
    Raises:
        ValueError: an unknown kind, a rate or burstiness <= 0, or a trace without timestamps.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown arrival kind {kind!r} (one of {', '.join(KINDS)})")
    if kind == "trace":
        if timestamps is None or len(timestamps) < n:
            raise ValueError("a trace schedule needs a timestamp for every request")
        t = np.asarray(timestamps[:n], dtype=float)
        return np.maximum.accumulate(t - t.min()) if n else t
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if n == 0 or np.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    if kind == "constant":
        gaps = np.full(n, 1.0 / rate)
    elif kind == "ramp":
        end = rate if ramp_end_rate is None else ramp_end_rate
        if end <= 0:
            raise ValueError("ramp_end_rate must be > 0")
        rates = np.linspace(rate, end, n)
        gaps = rng.exponential(1.0 / rates)
    else:
        shape = 1.0 if kind == "poisson" else burstiness
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    # the first request goes at t=0, as vLLM's does
    gaps[0] = 0.0
    return np.cumsum(gaps)
