"""Reading Prometheus text exposition: one scrape as numbers, differences of counters and histograms
between two scrapes, and a percentile from histogram buckets.

The parser is prometheus_client's. The percentile is Prometheus' ``histogram_quantile`` rule
(:mod:`.histogram`): find the bucket holding the rank, interpolate linearly between its lower and upper
edge (0 below the first edge); a rank in the +Inf bucket answers the highest finite edge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from prometheus_client.parser import text_string_to_metric_families

from .histogram import percentile

LabelSet = frozenset  # of (name, value) pairs


@dataclass
class Scrape:
    """One /metrics read.

    Attributes:
        at: when it was read (seconds, the caller's clock).
        ok: whether the target answered with parseable text.
        samples: sample name -> {label set -> value}.
        error: why it failed, when it did.
    """
    at: float
    ok: bool
    samples: dict[str, dict[LabelSet, float]] = field(default_factory=dict)
    error: Optional[str] = None

    def series(self, name: str, **match: str) -> Iterable[tuple[dict, float]]:
        """(labels, value) of each series of ``name`` whose labels include ``match``."""
        for labels, v in self.samples.get(name, {}).items():
            d = dict(labels)
            if all(d.get(k) == want for k, want in match.items()):
                yield d, v

    def sum(self, name: str, **match: str) -> float:
        """Sum of the matching series (0 when none)."""
        return sum(v for _, v in self.series(name, **match))

    def buckets(self, name: str, **match: str) -> dict[float, float]:
        """Cumulative bucket counts of histogram ``name`` (without ``_bucket``), summed over the
        matching series, by upper edge (``math.inf`` for +Inf)."""
        out: dict[float, float] = {}
        for labels, v in self.series(name + "_bucket", **match):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + v
        return out


def parse(text: str, at: float) -> Scrape:
    """Parse exposition text. Raises ValueError on text that is not Prometheus exposition."""
    samples: dict[str, dict[LabelSet, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, {})[frozenset(s.labels.items())] = float(s.value)
    return Scrape(at=at, ok=True, samples=samples)


def counter_delta(new: Scrape, old: Optional[Scrape], name: str, **match: str) -> float:
    """Increase of a counter between two scrapes of one target, series by series; a series that went
    down was reset (the process restarted) and counts from 0, as Prometheus' ``increase`` does.
    Without ``old`` the increase is 0 (one scrape says nothing about a rate)."""
    if old is None:
        return 0.0
    before = old.samples.get(name, {})
    total = 0.0
    for labels, v in new.samples.get(name, {}).items():
        d = dict(labels)
        if not all(d.get(k) == want for k, want in match.items()):
            continue
        prev = before.get(labels, 0.0)
        total += v - prev if v >= prev else v
    return total


def buckets_delta(new: Scrape, old: Optional[Scrape], name: str, **match: str) -> dict[float, float]:
    """Per-edge increase of a histogram's cumulative buckets between two scrapes of one target."""
    if old is None:
        return {}
    out: dict[float, float] = {}
    before = old.samples.get(name + "_bucket", {})
    for labels, v in new.samples.get(name + "_bucket", {}).items():
        d = dict(labels)
        if not all(d.get(k) == want for k, want in match.items()):
            continue
        prev = before.get(labels, 0.0)
        le = float(d["le"])
        out[le] = out.get(le, 0.0) + (v - prev if v >= prev else v)
    return out


def add_buckets(a: dict[float, float], b: dict[float, float]) -> dict[float, float]:
    """Bucket counts of two targets together (same edges: same binary)."""
    out = dict(a)
    for le, v in b.items():
        out[le] = out.get(le, 0.0) + v
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> Optional[float]:
    """The q-quantile (0 < q < 1) of cumulative bucket counts {upper edge: count}; None when the
    histogram holds no observation. :func:`.histogram.percentile` (histogram_quantile's rule) does it.

    Raises ValueError for q outside (0, 1)."""
    if not 0 < q < 1:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    if math.inf not in buckets:
        return None
    return percentile(buckets.items(), q * 100.0)
