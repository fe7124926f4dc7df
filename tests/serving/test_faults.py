"""Faults the router must ride out (issue 29), on a real local fleet (router, 1 prefill, 2 decode
workers of examples/smollm2.yaml): a worker stopped with SIGSTOP (a hung peer) before a request's
first token, and a decode worker killed with SIGKILL mid-stream. The chaos soak
(tests/bench/test_chaos.py, worker/bench/chaos.py) runs them together under load."""
import contextlib
import json
import os
import signal
import time

import pytest
import requests

from fleet_utils import MODEL, metric, start_fleet, wait_for
from tandem.worker.router.app import DECODE_WORKER_HEADER, PREFILL_WORKER_HEADER

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet():
    f = start_fleet({"spec.decode.replicas": 2}, name="faults")
    yield f
    for p in f.procs:   # a test that failed half-way may leave a worker stopped
        # (the fleet's supervisor may reap a killed worker between the poll and the kill: a run under
        # the CPU burner failed its teardown so, the tests all passed)
        with contextlib.suppress(ProcessLookupError):
            if p.popen.poll() is None:
                os.kill(p.popen.pid, signal.SIGCONT)
    f.stop(grace=10)


def _proc(fleet, url):
    return next(p for p in fleet.procs if p.url == url)


def _router_view(fleet, url) -> bool:
    return requests.get(fleet.endpoint + "/health", timeout=10).json()["workers"][url]["ready"]


def _tied(fleet, urls) -> bool:
    view = requests.get(fleet.endpoint + "/health", timeout=10).json()["workers"]
    return all(view[u]["ready"] and view[u]["in_flight"] == 0 for u in urls) and \
        len({view[u]["free_blocks"] for u in urls}) == 1


def _idle(url) -> bool:
    h = requests.get(url + "/health", timeout=10).json()
    return h["num_requests"] == 0 and h["in_flight"] == 0 and h["kv_cache_usage"] == 0


def _complete(fleet, max_tokens=8, prompt="Once upon a time", timeout=120):
    return requests.post(fleet.endpoint + "/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})


def _stopped(fleet, p):
    """SIGSTOP ``p`` now; the returned function continues it (once)."""
    os.kill(p.popen.pid, signal.SIGSTOP)
    done = []

    def cont():
        if not done:
            done.append(1)
            os.kill(p.popen.pid, signal.SIGCONT)
    return cont


def _retries(fleet, reason):
    return metric(fleet.endpoint, "tandem:router_retries_total", reason=reason)


def test_request_on_a_stopped_decode_worker_is_sent_to_another(fleet):
    """A decode worker stopped (SIGSTOP) just before a request reaches it: the router sends the request
    to the other decode worker once the stopped one misses its health polls (seconds, not the stop's
    length), takes it out of routing, and puts it back when it answers again; it holds nothing after.
    Before the fix the request waited for the worker to be continued."""
    decodes = sorted(p.url for p in fleet.procs if p.role == "decode")
    assert _complete(fleet).status_code == 200                # warm, and every worker polled ready
    # the router breaks a tie between idle decode workers (as many free blocks, by its last poll) by the
    # lower URL: that is where the request goes
    assert wait_for(lambda: _tied(fleet, decodes), timeout=20)
    victim = _proc(fleet, decodes[0])
    before = _retries(fleet, "hung")
    cont = _stopped(fleet, victim)
    try:
        t0 = time.monotonic()
        r = _complete(fleet)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert r.headers[DECODE_WORKER_HEADER] == decodes[1]
        # HUNG_POLLS (2) polls of 2 s each, plus the other worker's answer; stopped for 60 s below
        assert took < 30, took
        assert _retries(fleet, "hung") == before + 1
        assert not _router_view(fleet, victim.url)           # out of routing while stopped
        for _ in range(3):                                    # and new requests go elsewhere at once
            r = _complete(fleet, max_tokens=2, timeout=30)
            assert r.status_code == 200 and r.headers[DECODE_WORKER_HEADER] == decodes[1]
    finally:
        cont()
    assert wait_for(lambda: _router_view(fleet, victim.url), timeout=20), "the continued worker is not back"
    assert wait_for(lambda: _idle(victim.url), timeout=60), requests.get(victim.url + "/health").json()


def test_request_on_a_stopped_prefill_worker_is_prefilled_elsewhere(fleet):
    """The prefill worker stopped just before a request's remote prefill: the router gives up on it
    once it misses its health polls and sends the request again (the decode worker prefills it: no
    other prefill worker is ready). Before the fix the decode worker waited 30 s for the first KV frame."""
    prefill = next(p for p in fleet.procs if p.role == "prefill")
    assert _complete(fleet).status_code == 200
    before = _retries(fleet, "hung")
    cont = _stopped(fleet, prefill)
    try:
        t0 = time.monotonic()
        r = _complete(fleet, prompt="The history of the city of Rome begins")
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert r.headers[PREFILL_WORKER_HEADER] == "local"
        assert took < 20, took
        assert _retries(fleet, "hung") == before + 1
    finally:
        cont()
    assert wait_for(lambda: _router_view(fleet, prefill.url), timeout=20)
    for p in fleet.procs:
        if p.role != "router":
            assert wait_for(lambda: _idle(p.url), timeout=60), (p.name, requests.get(p.url + "/health").json())


def test_stream_on_a_killed_decode_worker_ends_with_an_error_event(fleet):
    """kill -9 of the decode worker while it streams: the client gets an SSE error event in OpenAI's
    format (and no hang), counted in tandem:router_stream_errors_total by reason. Before the fix the
    stream just stopped, without [DONE] or an error. (Last in this file: the worker restarts.)"""
    before = metric(fleet.endpoint, "tandem:router_stream_errors_total", reason="decode_worker_lost")
    r = requests.post(fleet.endpoint + "/v1/completions", stream=True, timeout=60, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    victim = _proc(fleet, r.headers[DECODE_WORKER_HEADER])
    events, killed = [], False
    t0 = time.monotonic()
    for line in r.iter_lines():
        if not line or line.startswith(b"id: "):   # event ids (stream resumption)
            continue
        assert line.startswith(b"data: "), line
        events.append(line[6:])
        if not killed and b'"text"' in line:
            os.kill(victim.popen.pid, signal.SIGKILL)
            killed = True
    assert killed and time.monotonic() - t0 < 60
    last = json.loads(events[-1])
    assert last["error"]["type"] == "server_error" and last["error"]["code"] == 502, last
    assert last["error"]["reason"] == "decode_worker_lost"
    assert b"[DONE]" not in events
    assert metric(fleet.endpoint, "tandem:router_stream_errors_total", reason="decode_worker_lost") == before + 1
