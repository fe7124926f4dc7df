"""Kill the prefill worker process mid-load: every request still completes, with an unbroken stream,
through the decode worker's local prefill fallback; no KV block leaks."""
import concurrent.futures as cf

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from fleet_utils import MODEL, metric, read_stream, start_fleet, wait_for

pytestmark = pytest.mark.timeout(900)


def stream_chat(url, i):
    body = {"model": MODEL, "stream": True, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {i}. " + "Tell me about the history of Paris. " * 25}]}
    r = requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600)
    r.raise_for_status()
    return read_stream(r)


def decisions(router: str) -> dict[str, float]:
    """The router's count of each routing decision."""
    text = requests.get(router + "/metrics", timeout=10).text
    return {s.labels["decision"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "tandem:router_routing_decisions_total"}


def test_prefill_worker_killed_mid_load():
    fleet = start_fleet(name="e2e-kill")
    try:
        prefill = next(p for p in fleet.procs if p.role == "prefill")
        decode = next(p for p in fleet.procs if p.role == "decode").url
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(stream_chat, fleet.endpoint, i) for i in range(8)]
            # kill while transfers are open on the prefill worker (each takes seconds of prefill on the CPU)
            assert wait_for(lambda: requests.get(prefill.url + "/health", timeout=5).json()["in_flight"] >= 3,
                            120, 0.05)
            killed = prefill.popen.pid
            prefill.popen.kill()
            prefill.popen.wait()
            results = [f.result() for f in futs]      # raises if any stream broke
            fallbacks = metric(decode, "tandem:local_prefill_fallbacks_total")
            assert fallbacks > 0
            before = decisions(fleet.endpoint)
            # and requests after the death still work: the router routes around the dead worker, or to
            # the one the fleet's supervisor started in its place (1 s backoff plus start-up, which
            # a fast CPU finishes before the first eight are done)
            more = [ex.submit(stream_chat, fleet.endpoint, 100 + i) for i in range(3)]
            results += [f.result() for f in more]
        assert len(results) == 11
        for text, chunks in results:
            assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"
        # none of the later three was sent to the dead worker (each would have fallen back again)
        assert metric(decode, "tandem:local_prefill_fallbacks_total") == fallbacks
        after = decisions(fleet.endpoint)
        delta = {d: after[d] - before.get(d, 0.0) for d in after if after[d] != before.get(d, 0.0)}
        assert sum(delta.values()) == 3, (before, after)
        # a worker restarting on the dead one's address is not a worker of another model (the router
        # once took it as ready before its first health poll, with no model fingerprint yet)
        assert "model_mismatch" not in delta, delta
        if delta.get("remote"):
            assert prefill.popen.pid != killed and prefill.state == "ready", "remote prefill with no live worker"
        assert wait_for(lambda: metric(decode, "tandem:kv_cache_usage_perc") == 0.0, 30)
    finally:
        fleet.stop(grace=10)
