"""The pods metric source: real exposition text from the project's own metric classes (the router's and a
worker's), read through prometheus_client's parser, differenced over a window.

The scrape function here reads the text of in-process ``Metrics`` registries instead of an HTTP GET
(a stand-in for the network, named as such); the HTTP path is covered by the local-fleet test."""
from __future__ import annotations

import math

import pytest

from exposition import gauges, older_router
from tandem.operator.autoscaler.pods_source import PodsSource, Targets, Worker
from tandem.operator.autoscaler.scrape import histogram_quantile, parse
from tandem.worker.api import metrics as M
from tandem.worker.api.metrics import TPOT_BUCKETS, TTFT_BUCKETS, Metrics


def test_histogram_quantile_interpolates_inside_the_bucket():
    # 10 observations: 4 in (0, 0.1], 6 in (0.1, 0.2]
    b = {0.1: 4, 0.2: 10, math.inf: 10}
    assert histogram_quantile(0.5, b) == pytest.approx(0.1 + 0.1 * (5 - 4) / 6)
    assert histogram_quantile(0.2, b) == pytest.approx(0.05)
    assert histogram_quantile(0.9, {0.1: 0, math.inf: 5}) == 0.1   # +Inf bucket: highest finite edge
    assert histogram_quantile(0.9, {0.1: 0, math.inf: 0}) is None
    with pytest.raises(ValueError):
        histogram_quantile(90, b)


def test_buckets_straddle_plausible_targets():
    """Where SLO targets sit, consecutive edges are at most 25 % apart (see metrics.py)."""
    for buckets, lo, hi in ((TTFT_BUCKETS, 0.02, 2.0), (TPOT_BUCKETS, 0.01, 0.3)):
        inside = [b for b in buckets if lo <= b <= hi]
        assert all(b / a <= 1.25 + 1e-9 for a, b in zip(inside, inside[1:])), inside


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _fleet():
    router = Metrics("router", "p")
    prefill = Metrics("prefill", "p")
    decode = Metrics("decode", "p")
    return router, prefill, decode


def _source(regs: dict, clock, window=10.0):
    def fetch(url, timeout):   # stand-in for GET url/metrics
        if regs.get(url) is None:
            raise ConnectionRefusedError(url)
        return regs[url].render().decode()
    return PodsSource(window, {"prefill": 90, "decode": 90}, fetch=fetch, clock=clock)


def test_rates_and_percentiles_come_from_the_window():
    router, prefill, decode = _fleet()
    regs = {"r": router, "p": prefill, "d": decode}
    clock = Clock()
    src = _source(regs, clock)
    t = Targets(routers=["r"], prefill=[Worker("p")], decode=[Worker("d", "ready"), Worker("d2", "starting")])
    # history before the window: a slow request that must not count
    router.observe_request(5.0, 60.0, 10, prefill="remote")
    snap = src.observe(t)
    assert snap.decode.signal == "no_data"         # one scrape: no difference yet
    clock.t += 10
    for i in range(10):
        router.request_received(100)
        router.routing.labels(**router.labels, decision="remote").inc()
        router.observe_request(0.1 if i < 5 else 0.3, 0.1 + 20 * 0.05, 21, prefill="remote")
    router.request_received(20)
    router.observe_request(9.0, 10.0, 2, prefill="local")   # a local prefill: not the prefill pool's TTFT
    router.routing.labels(**router.labels, decision="short_prompt").inc()
    for _ in range(4):   # arrived, still queued for prefill: no decision yet (it is counted at the first token)
        router.request_received(500)
    snap = src.observe(t)
    assert snap.decode.signal == "ok" and snap.prefill.signal == "ok"
    assert snap.decode.window_s == pytest.approx(10)
    # prefill's demand is every prompt that arrived, wherever it is prefilled and whether or not it got
    # through; decode's arrivals are the requests that reached their first token
    assert snap.prefill.arrivals_per_s == pytest.approx(1.5)
    assert snap.prefill.prompt_tokens_per_s == pytest.approx((10 * 100 + 20 + 4 * 500) / 10)
    assert snap.decode.arrivals_per_s == pytest.approx(1.1)
    # p90 TTFT of the 10 remote requests: 5 at 0.1 and 5 at 0.3 -> in the (0.25, 0.3] bucket
    assert 0.25 < snap.prefill.latency <= 0.3
    # TPOT (e2e - ttft) / 20 = 0.05 (remote ones) and ~0.5 (the local one): p90 rank 9.9 of 11
    assert 0.04 < snap.decode.latency <= 0.05
    assert (snap.decode.ready, snap.decode.starting) == (1, 1)
    assert snap.router_queued == 0


def test_idle_and_no_data_are_told_apart():
    router, prefill, decode = _fleet()
    regs = {"r": router, "p": prefill, "d": decode}
    clock = Clock()
    src = _source(regs, clock)
    t = Targets(routers=["r"], prefill=[Worker("p")], decode=[Worker("d")])
    src.observe(t)
    clock.t += 10
    snap = src.observe(t)
    assert (snap.prefill.signal, snap.decode.signal) == ("idle", "idle")
    assert snap.decode.latency is None
    regs["r"] = None            # the router stops answering: no data, however idle it was
    clock.t += 2
    snap = src.observe(t)
    # the last good scrape is 2 s old, still fresh within the window
    assert snap.decode.signal == "idle"
    clock.t += 11
    snap = src.observe(t)
    assert (snap.prefill.signal, snap.decode.signal) == ("no_data", "no_data")


def test_queued_requests_and_counter_resets():
    router, prefill, decode = _fleet()
    regs = {"r": router}
    clock = Clock()
    src = _source(regs, clock)
    t = Targets(routers=["r"])
    for _ in range(3):
        router.request_received(10)
    src.observe(t)
    clock.t += 10
    fresh = Metrics("router", "p")          # the router restarted: its counters start again at 0
    fresh.request_received(10)
    fresh.router_queued.set(2)
    regs["r"] = fresh
    snap = src.observe(t)
    assert snap.prefill.arrivals_per_s == pytest.approx(0.1)   # counted from 0, not -2
    assert snap.router_queued == 2
    assert (snap.decode.ready, snap.decode.starting) == (0, 0)


def _two_scrapes(texts: dict, t: Targets, between=lambda: None):
    clock = Clock()
    src = PodsSource(10.0, {}, fetch=lambda url, timeout: texts[url](), clock=clock)
    src.observe(t)
    between()
    clock.t += 10
    return src.observe(t)


def test_decode_s_queue_is_the_simulator_s():
    """A decode worker's waiting gauge counts the sequences awaiting their KV from a prefill worker (as
    vLLM's does), and its running gauge the local prefills it is computing. Decode's queue in the
    snapshot is the simulator's (operator/simulate/fleet.py): the first wait on prefill, whose queue
    holds them; the second wait for decode, not yet decoding. A prefill worker's gauges stay as they
    are."""
    router = Metrics("router", "p")
    texts = {"r": lambda: router.render().decode(),
             "d": lambda: gauges("decode", RUNNING=4, PREFILLING=1, WAITING=5, AWAITING_KV=3),
             "p": lambda: gauges("prefill", RUNNING=2, PREFILLING=2, WAITING=3)}
    snap = _two_scrapes(texts, Targets(routers=["r"], prefill=[Worker("p")], decode=[Worker("d")]))
    assert (snap.decode.running, snap.decode.waiting) == (3, 3)
    assert (snap.prefill.running, snap.prefill.waiting) == (2, 3)
    # a scrape racing the engine never reads a negative queue
    texts["d"] = lambda: gauges("decode", RUNNING=0, WAITING=1, AWAITING_KV=2)
    snap = _two_scrapes(texts, Targets(routers=["r"], decode=[Worker("d")]))
    assert (snap.decode.running, snap.decode.waiting) == (0, 0)


def test_a_pool_whose_requests_all_await_prefill_is_not_idle():
    """Requests arrived in the window and every one waits for prefill: decode's own gauges read 0 and no
    request has reached its first token, but the pool is busy (the simulator's idleness is the pool's
    arrivals, for both roles)."""
    router = Metrics("router", "p")
    texts = {"r": lambda: router.render().decode(), "d": lambda: gauges("decode", WAITING=3, AWAITING_KV=3)}

    def arrive():
        for _ in range(3):
            router.request_received(400)
    snap = _two_scrapes(texts, Targets(routers=["r"], decode=[Worker("d")]), arrive)
    assert snap.decode.signal == "ok" and snap.decode.waiting == 0 and snap.decode.arrivals_per_s == 0
    assert snap.prefill.signal == "ok" and snap.prefill.arrivals_per_s == pytest.approx(0.3)


def test_a_router_without_the_arrival_counters_reads_as_before_them():
    """An older router image (no ``tandem:router_requests_received_total``; the router runs the pool's
    image, which may lag the operator's): prefill's demand comes from the remote routing decisions and
    the prefill workers' computed prompt tokens, as before those counters, not 0."""
    router = Metrics("router", "p")
    computed = {"n": 0}

    texts = {"r": lambda: older_router(router),
             "p": lambda: f'{M.PROMPT_TOKENS_COMPUTED}_total{{role="prefill",pool="p"}} {computed["n"]}\n'}

    def serve():
        for _ in range(4):
            router.routing.labels(**router.labels, decision="remote").inc()
        computed["n"] += 4 * 250
    snap = _two_scrapes(texts, Targets(routers=["r"], prefill=[Worker("p")]), serve)
    assert snap.prefill.arrivals_per_s == pytest.approx(0.4)
    assert snap.prefill.prompt_tokens_per_s == pytest.approx(100)


def test_old_and_new_routers_side_by_side_both_count():
    """A rollout of the routers: an older router (no arrival counters) beside a newer one. Both count:
    the older one's remote decisions as arrivals, at the mean prompt the newer one counted (before the
    thirty-fifth session the older one's arrivals were dropped while any router had the counters)."""
    new, old = Metrics("router", "p"), Metrics("router", "p")

    texts = {"new": lambda: new.render().decode(), "old": lambda: older_router(old),
             "p": lambda: f'{M.PROMPT_TOKENS_COMPUTED}_total{{role="prefill",pool="p"}} 0\n'}

    def serve():
        for _ in range(2):
            new.request_received(300)
        for _ in range(3):
            old.routing.labels(**old.labels, decision="remote").inc()
    snap = _two_scrapes(texts, Targets(routers=["new", "old"], prefill=[Worker("p")]), serve)
    assert snap.prefill.arrivals_per_s == pytest.approx(0.5)
    assert snap.prefill.prompt_tokens_per_s == pytest.approx(150)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse("this is {not exposition", 0.0)


def test_a_queued_request_is_not_idleness():
    router = Metrics("router", "p")
    clock = Clock()
    src = _source({"r": router}, clock)
    t = Targets(routers=["r"], decode=[Worker("d", "starting")])
    src.observe(t)
    router.router_queued.set(1)
    clock.t += 10
    snap = src.observe(t)
    assert snap.decode.signal == "ok" and snap.decode.latency is None and snap.router_queued == 1


def test_a_router_scrape_without_router_series_is_no_data():
    router = Metrics("router", "p")
    worker = Metrics("decode", "p")
    clock = Clock()
    regs = {"r": router}
    src = _source(regs, clock)
    t = Targets(routers=["r"])
    src.observe(t)
    clock.t += 10
    regs["r"] = worker         # answers, but not as a router: nothing to read the pool's latency from
    assert src.observe(t).decode.signal == "no_data"


def test_a_worker_that_stops_answering_is_not_capacity():
    """Two failed scrapes in a row make a ready worker (or a not-ready one that has answered before:
    a pod whose probe turned it not-ready) ``unresponsive``, not ready or starting; one failure is
    not enough (a slow scrape on a loaded machine), a pod that never answered is still starting, and
    a worker counts again at its first answer. (A dead or SIGSTOPped process, tests/autoscaler/
    test_fleet_autoscaling.py has the real one.)"""
    router, prefill, decode = _fleet()
    regs = {"r": router, "p": prefill, "d": decode, "d2": Metrics("decode", "p")}
    clock = Clock()
    src = _source(regs, clock)
    t = Targets(routers=["r"], prefill=[Worker("p")],
                decode=[Worker("d"), Worker("d2", "starting"), Worker("d3", "starting")])
    src.observe(t)
    clock.t += 5
    regs["d"] = None                         # hung: its scrape times out
    snap = src.observe(t)
    assert (snap.decode.ready, snap.decode.starting, snap.decode.unresponsive) == (1, 2, 0)   # once: not yet
    clock.t += 5
    regs["d2"] = None                        # answered once, then its probe failed and so did its scrapes
    snap = src.observe(t)
    assert (snap.decode.ready, snap.decode.starting, snap.decode.unresponsive) == (0, 2, 1)
    assert snap.decode.replicas == 2
    clock.t += 5
    snap = src.observe(t)
    assert (snap.decode.ready, snap.decode.starting, snap.decode.unresponsive) == (0, 1, 2)
    assert snap.decode.signal == "idle"      # the router answers: its signal is not no_data
    clock.t += 5
    regs["d"] = decode                       # SIGCONT: it answers again
    snap = src.observe(t)
    assert (snap.decode.ready, snap.decode.starting, snap.decode.unresponsive) == (1, 1, 1)
    assert (snap.prefill.ready, snap.prefill.unresponsive) == (1, 0)
