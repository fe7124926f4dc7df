"""Percentiles from histogram buckets (operator/autoscaler/histogram.py), checked against numpy on
samples drawn into the router's TPOT buckets."""
import math

import numpy as np
import pytest

from tandem.operator.autoscaler.histogram import percentile, window_buckets

pytestmark = pytest.mark.timeout(30)
EDGES = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, math.inf]


def cumulative(samples, edges=EDGES):
    s = np.asarray(samples)
    return [(le, float((s <= le).sum())) for le in edges]


def test_interpolates_inside_a_bucket():
    # 100 observations spread evenly over (0.075, 0.1]: p90 is 90% of the way through that bucket
    b = cumulative(np.linspace(0.07501, 0.1, 100))
    assert percentile(b, 90) == pytest.approx(0.075 + 0.9 * 0.025, abs=1e-3)
    # reading the upper edge instead would say 0.1 whatever the spread


def test_close_to_numpy_on_uniform_samples():
    rng = np.random.default_rng(0)
    s = rng.uniform(0.05, 0.15, 20000)   # even within every bucket it touches: the assumption holds
    assert percentile(cumulative(s), 90) == pytest.approx(np.percentile(s, 90), rel=0.03)


def test_empty_and_inf_and_errors():
    assert percentile(cumulative([]), 90) is None            # idle: no observation in the window
    assert percentile(cumulative([5.0, 6.0]), 90) == 1.0      # beyond the last finite edge
    with pytest.raises(ValueError):
        percentile(cumulative([0.1]), 100)
    with pytest.raises(ValueError):
        percentile([(0.1, 5), (0.2, 3)], 50)


def test_window_of_two_scrapes_and_reset():
    before = cumulative([0.08] * 10)
    after = cumulative([0.08] * 10 + [0.3] * 10)
    w = window_buckets(before, after)
    assert w[-1][1] == 10 and percentile(w, 50) == pytest.approx(0.25, abs=0.051)
    restarted = cumulative([0.3] * 2)
    assert window_buckets(after, restarted) == restarted
    with pytest.raises(ValueError):
        window_buckets(before, [(0.5, 1.0), (math.inf, 1.0)])
