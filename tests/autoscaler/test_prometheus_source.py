"""The Prometheus metric source reads a pool as the pods source does (issue 25: the paths the
thirty-fourth session added had no direct test). A real Prometheus scrapes, over real loopback HTTP,
three stand-in pods: servers that answer ``/metrics`` with the project's own ``Metrics`` registries'
exposition (a router's) and with fixed worker gauges (stand-ins for workers held in these states, which
real workers cannot be held in on demand; the real gauges are checked on real workers in
tests/serving/test_abuse.py and the fleet tests). The pods source reads the same servers directly."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from exposition import gauges, older_router
from prometheus_utils import Prometheus
from tandem.operator.autoscaler.pods_source import PodsSource, Targets, Worker
from tandem.operator.autoscaler.prometheus_source import PrometheusSource
from tandem.operator.local import free_port
from tandem.worker.api.metrics import Metrics

pytestmark = pytest.mark.timeout(180)
WINDOW = 10.0


class Exporters:
    """One HTTP server per stand-in pod on loopback: ``/metrics`` answers ``texts[name]()``."""

    def __init__(self, texts: dict):
        import asyncio

        from aiohttp import web
        self.texts, self.urls = texts, {n: f"http://127.0.0.1:{free_port()}" for n in texts}
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start():
            self.runners = []
            for name, url in self.urls.items():
                async def handle(request, name=name):
                    return web.Response(text=self.texts[name](), content_type="text/plain")
                app = web.Application()
                app.router.add_get("/metrics", handle)
                runner = web.AppRunner(app)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", int(url.rsplit(":", 1)[1])).start()
                self.runners.append(runner)
            ready.set()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def stop(self):
        import asyncio

        async def cleanup():
            for r in self.runners:
                await r.cleanup()
        asyncio.run_coroutine_threadsafe(cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def pool(tmp_path):
    """A router counting 4 arrivals of 250 prompt tokens a second, and one worker of each role. A
    second router (an older image, without the arrival counters) counts 3 remote routings a second."""
    new, old = Metrics("router", "p"), Metrics("router", "p")
    texts = {
        "router": lambda: new.render().decode(),
        "old-router": lambda: older_router(old),
        "decode": lambda: gauges("decode", RUNNING=4, PREFILLING=1, WAITING=5, AWAITING_KV=3),
        "prefill": lambda: gauges("prefill", RUNNING=2, PREFILLING=2, WAITING=3),
    }
    stop = threading.Event()

    def traffic():
        while not stop.wait(0.25):
            new.request_received(250)
            new.routing.labels(**new.labels, decision="remote").inc()

    def old_traffic():
        while not stop.wait(1 / 3):
            old.routing.labels(**old.labels, decision="remote").inc()
    threads = [threading.Thread(target=traffic, daemon=True), threading.Thread(target=old_traffic, daemon=True)]
    ex = Exporters(texts)
    prom = Prometheus(tmp_path / "prometheus")
    for t in threads:
        t.start()
    try:
        yield ex, prom
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        prom.stop()
        ex.stop()


def _targets(ex, router: str) -> Targets:
    return Targets(routers=[ex.urls[router]], prefill=[Worker(ex.urls["prefill"])],
                   decode=[Worker(ex.urls["decode"])])


def _scraped(prom, ex, names, seconds: float) -> None:
    """Prometheus scrapes exactly these servers, and has for ``seconds``."""
    prom.targets([ex.urls[n] for n in names])
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:
        r = requests.get(prom.url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        if len(r) == len(names) and all(t["health"] == "up" for t in r):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"Prometheus never scraped {names}")
    time.sleep(seconds)


def test_prometheus_reads_the_pool_as_the_pods_source_does(pool):
    ex, prom = pool
    _scraped(prom, ex, ["router", "decode", "prefill"], WINDOW + 3)
    via_prom = PrometheusSource(prom.url, "p", WINDOW, {"prefill": 90, "decode": 90}).observe(_targets(ex, "router"))
    pods = PodsSource(WINDOW, {"prefill": 90, "decode": 90})
    t = _targets(ex, "router")
    pods.observe(t)
    time.sleep(WINDOW * 0.8)   # the base scrape within one window of the newest
    direct = pods.observe(t)
    for snap in (via_prom, direct):
        assert snap.prefill.signal == snap.decode.signal == "ok", snap
        # decode's queue as the simulator counts it: the 3 awaiting KV are prefill's, the 1 prefilling waits
        assert (snap.decode.running, snap.decode.waiting) == (3, 3)
        assert (snap.prefill.running, snap.prefill.waiting) == (2, 3)
        # prefill's demand on arrival, from the router's counters: 4 a second of 250 tokens
        assert snap.prefill.arrivals_per_s == pytest.approx(4, rel=0.2), snap.prefill
        assert snap.prefill.prompt_tokens_per_s == pytest.approx(1000, rel=0.2), snap.prefill
    assert via_prom.prefill.prompt_tokens_per_s / via_prom.prefill.arrivals_per_s == pytest.approx(250, rel=0.05)


def test_prometheus_falls_back_to_remote_routings_for_a_router_without_the_counters(pool):
    ex, prom = pool
    _scraped(prom, ex, ["old-router", "decode", "prefill"], WINDOW + 3)
    snap = PrometheusSource(prom.url, "p", WINDOW, {"prefill": 90, "decode": 90}).observe(_targets(ex, "old-router"))
    assert snap.prefill.signal == "ok", snap
    assert snap.prefill.arrivals_per_s == pytest.approx(3, rel=0.2), snap.prefill   # not 0
    assert snap.prefill.prompt_tokens_per_s == 0   # the prefill worker here computed nothing


def test_prometheus_counts_old_and_new_routers_side_by_side(pool):
    """A rollout of the routers: both are scraped. The older one's 3 remote routings a second count
    beside the newer one's 4 arrivals, at the newer one's 250-token mean prompt."""
    ex, prom = pool
    _scraped(prom, ex, ["router", "old-router", "decode", "prefill"], WINDOW + 3)
    t = Targets(routers=[ex.urls["router"], ex.urls["old-router"]], prefill=[Worker(ex.urls["prefill"])],
                decode=[Worker(ex.urls["decode"])])
    snap = PrometheusSource(prom.url, "p", WINDOW, {"prefill": 90, "decode": 90}).observe(t)
    assert snap.prefill.arrivals_per_s == pytest.approx(7, rel=0.2), snap.prefill
    assert snap.prefill.prompt_tokens_per_s / snap.prefill.arrivals_per_s == pytest.approx(250, rel=0.05)
