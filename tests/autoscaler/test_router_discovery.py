"""The router's side of autoscaling: workers found at run time from the local fleet's discovery file,
and burst absorption (local prefill on decode workers with headroom) when the autoscaler asks."""
from __future__ import annotations

import json
import os

from tandem.worker.router.discovery import FileDiscovery, make_discovery
from tandem.worker.router.policy import WorkerState, decide


def _write(path, d):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(d))
    os.replace(tmp, path)


def test_the_file_is_read_again_when_it_changes(tmp_path):
    f = tmp_path / "d.json"
    _write(f, {"prefill": ["http://p0"], "decode": []})
    d = make_discovery({"mode": "static", "file": str(f)})
    assert isinstance(d, FileDiscovery)
    assert d.prefill_urls() == ["http://p0"] and d.decode_urls() == []
    _write(f, {"prefill": ["http://p0"], "decode": ["http://d0", "http://d1"], "absorbBursts": True})
    assert d.decode_urls() == ["http://d0", "http://d1"] and d.absorb_bursts()
    f.write_text('{"prefill": [')            # half-written: the last good lists stay
    assert d.decode_urls() == ["http://d0", "http://d1"]
    f.unlink()                                # gone: the same
    assert d.prefill_urls() == ["http://p0"]


def test_a_draining_decode_worker_stays_resumable(tmp_path):
    """The local fleet takes a draining worker out of routing but lists it under ``resumable``: it still
    holds streams a client may resume through the router (the thirteenth session's chaos soak lost one
    when the router's resume looked in the routable list only). A file without the key (an older
    fleet's) resumes on the routable decode workers."""
    f = tmp_path / "d.json"
    _write(f, {"prefill": [], "decode": ["http://d0"], "resumable": ["http://d0", "http://d1"]})
    d = make_discovery({"mode": "static", "file": str(f)})
    assert d.decode_urls() == ["http://d0"] and d.resumable_urls() == ["http://d0", "http://d1"]
    _write(f, {"prefill": [], "decode": ["http://d2"]})
    assert d.resumable_urls() == ["http://d2"]


def test_burst_absorption_prefills_locally_only_with_headroom():
    prefill = [WorkerState("http://p", num_blocks=100, free_blocks=100)]
    roomy = WorkerState("http://d", num_blocks=100, free_blocks=80)
    full = WorkerState("http://d", num_blocks=100, free_blocks=20)
    hashes = [b"a", b"b"]
    assert decide([roomy], prefill, 64, hashes, 0).reason == "remote"
    assert decide([roomy], prefill, 64, hashes, 0, absorb_bursts=True).reason == "absorb_burst"
    assert decide([full], prefill, 64, hashes, 0, absorb_bursts=True).reason == "remote"


def test_a_finished_stream_stops_counting_at_its_last_event():
    """The router's own count of a worker's load drops at the stream's ``[DONE]`` (``release``), not when
    the handler ends: a client's next request, sent at ``[DONE]``, must see the worker free, or on a tie
    it joins another stream's worker and leaves this one idle (tests/e2e found the drain picking it)."""
    from tandem.worker.router.app import _Load
    from tandem.worker.router.policy import Decision, pick_decode
    a, b = WorkerState("http://a", num_blocks=100, free_blocks=90), WorkerState("http://b", num_blocks=100,
                                                                                free_blocks=50)
    with _Load(Decision(a, None, "remote")):                 # stream 1 on a
        with _Load(Decision(b, None, "remote")) as second:   # stream 2 on b
            assert (a.in_flight, b.in_flight) == (1, 1)
            second.release()                                 # b's stream sent [DONE]
            assert pick_decode([a, b]) is b                  # the next request goes to b, not to a's tie
        assert b.in_flight == 0                              # the handler's end does not count it twice
    assert a.in_flight == 0


def test_a_worker_that_drops_out_of_discovery_for_a_moment_keeps_its_count():
    """One slow readiness probe takes a pod out of its Endpoints for a few seconds. The router must not
    forget the streams it sent there: re-added at 0, the pod drew new requests onto its running ones
    and left a peer idle (the e2e story's drain then found that peer empty). An idle one is forgotten."""
    import asyncio
    from types import SimpleNamespace

    from tandem.worker.router.app import Router, _Load
    from tandem.worker.router.policy import Decision, pick_decode
    lists = {"decode": ["http://a", "http://b"]}
    r = object.__new__(Router)    # the router's state only: no tokenizer, no sockets
    r.discovery = SimpleNamespace(prefill_urls=lambda: [], decode_urls=lambda: list(lists["decode"]))
    r.workers = {}

    async def no_poll(w):         # stand-in for the /health poll (no workers run here): a 200
        w.free_blocks, w.num_blocks, w.ready = 50, 100, True
    r._poll = no_poll
    asyncio.run(r.poll_once())
    a, b = r.workers["http://a"], r.workers["http://b"]
    with _Load(Decision(a, None, "remote")):                  # a stream on a
        lists["decode"] = ["http://b"]                        # a's probe was slow: gone for a moment
        asyncio.run(r.poll_once())
        lists["decode"] = ["http://a", "http://b"]
        asyncio.run(r.poll_once())
        assert r.workers["http://a"] is a and a.in_flight == 1
        assert pick_decode(r._states(lists["decode"])) is b   # the next stream goes to the idle one
    lists["decode"] = ["http://b"]
    asyncio.run(r.poll_once())
    assert "http://a" not in r.workers                        # idle and gone: forgotten


def test_a_not_ready_endpoint_is_out_of_routing_but_resumable():
    """On Kubernetes a draining decode worker turns not-ready: it leaves routing, but a stream it holds
    can still be resumed on it (``KubernetesEndpointsDiscovery.resumable_urls``), from EndpointSlices or
    from core/v1 Endpoints."""
    from tandem.worker.router.discovery_k8s import ready_urls, slice_ready_urls
    slices = [{"ports": [{"port": 8000}], "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
        {"addresses": ["10.0.0.3"]}]}]
    assert slice_ready_urls(slices, 8000) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert slice_ready_urls(slices, 8000, not_ready=True) == [
        "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    endpoints = {"subsets": [{"ports": [{"port": 8000}], "addresses": [{"ip": "10.0.0.1"}],
                              "notReadyAddresses": [{"ip": "10.0.0.2"}]}]}
    assert ready_urls(endpoints, 8000) == ["http://10.0.0.1:8000"]
    assert ready_urls(endpoints, 8000, not_ready=True) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
