"""Percentiles from Prometheus histogram buckets, for the metric sources that build a
:class:`~tandem.operator.autoscaler.snapshot.RoleSnapshot` (pods' /metrics and Prometheus alike).

A window's histogram is the difference of two scrapes' cumulative bucket counts. The percentile is
estimated the way PromQL's ``histogram_quantile`` does: find the bucket holding the rank, then
interpolate linearly between its lower and upper edge (the observations are assumed spread evenly in
it). A rank in the ``+Inf`` bucket returns the highest finite edge (the estimate cannot exceed what the
buckets resolve), and a window with no observations returns None: the caller reports ``idle`` when the
scrape answered, not a latency of 0.

Why interpolation matters here: the TPOT buckets are 0.075 and 0.1 s apart around a 0.09 s target, a
step wider than a 10% tolerance band; reading the upper edge would move the estimate in 25 ms jumps.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence


def window_buckets(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]
                   ) -> list[tuple[float, float]]:
    """Cumulative counts observed between two scrapes, per upper edge ``le`` (seconds; ``math.inf`` for
    ``+Inf``). A counter that went down (the process restarted) counts from zero.

    Raises ValueError when the two scrapes have different edges."""
    if [le for le, _ in before] != [le for le, _ in after]:
        raise ValueError("the two scrapes' histograms have different bucket edges")
    reset = any(a < b for (_, b), (_, a) in zip(before, after))
    return [(le, a if reset else a - b) for (le, b), (_, a) in zip(before, after)]


def percentile(buckets: Iterable[tuple[float, float]], q: float) -> Optional[float]:
    """The ``q``-th percentile (0 < q < 100) of cumulative ``(le, count)`` buckets, interpolated linearly
    within the bucket holding the rank; None when the buckets hold no observation.

    Raises ValueError for q outside (0, 100) or buckets whose counts decrease with ``le``."""
    if not 0 < q < 100:
        raise ValueError(f"percentile must be within (0, 100), got {q}")
    bs = sorted((float(le), float(c)) for le, c in buckets)
    if not bs or bs[-1][1] <= 0:
        return None
    if any(c2 < c1 for (_, c1), (_, c2) in zip(bs, bs[1:])):
        raise ValueError("bucket counts must not decrease with le (are they cumulative?)")
    total = bs[-1][1]
    rank = q / 100.0 * total
    lo_edge, lo_count = 0.0, 0.0
    for le, count in bs:
        if count >= rank:
            if math.isinf(le):
                return lo_edge if lo_edge > 0 or lo_count > 0 else None
            if count == lo_count:
                return le
            return lo_edge + (le - lo_edge) * (rank - lo_count) / (count - lo_count)
        lo_edge, lo_count = le, count
    return bs[-1][0]
