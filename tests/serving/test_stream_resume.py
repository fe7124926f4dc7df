"""Stream resumption (issue 29; tandem.worker.server.resumable, docs/serving.md "Stream resumption"), on a
real local fleet with a pool secret (router, 1 prefill, 1 decode worker of examples/smollm2.yaml): a
stream whose router is killed with SIGKILL is resumed through the restarted router with the SSE
``Last-Event-ID`` header and ends with exactly the tokens of an uninterrupted greedy run; a client that
leaves through the router frees its blocks at once (the router's explicit cancel), and a stream nobody
resumes is aborted and freed after the grace."""
import json
import os
import signal
import time
import uuid

import pytest
import requests

from fleet_utils import MODEL, start_fleet, wait_for
from tandem.worker.api.http import STREAM_GRACE_HEADER, STREAM_ID_HEADER, STREAM_OWNER_HEADER, worker_key

pytestmark = pytest.mark.timeout(300)

#: long enough for a killed router's restart on a loaded 2-core machine, and far longer than the
#: explicit cancel needs (the cancel test asserts a free within a third of it)
GRACE = 45


@pytest.fixture(scope="module")
def fleet():
    f = start_fleet({"spec.router.streamResumeGraceSeconds": GRACE}, name="resume", pool_secret=True)
    yield f
    f.stop(grace=10)


def _decode(fleet) -> str:
    (w,) = fleet.workers("decode")
    return w.url


def _health(url) -> dict:
    return requests.get(url + "/health", timeout=10).json()


def _idle(url) -> bool:
    h = _health(url)
    return h["num_requests"] == 0 and h["kv_cache_usage"] == 0 and h["resumable_streams"] == 0


def _body(n: int, stream: bool = True) -> dict:
    # with usage: the router relays every event of the worker (without, it drops the usage event it
    # asked for, and the client sees a gap in the indices there)
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True,
            "temperature": 0, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def _events(r, out: list, stop_after: int | None = None, on_stop=None):
    """Read ``(id, data)`` events of an SSE response into ``out`` until it ends or breaks; after
    ``stop_after`` token events call ``on_stop()`` (once) and read on."""
    eid, tokens = None, 0
    try:
        for line in r.iter_lines():
            if line.startswith(b"id: "):
                eid = line[4:].decode()
            elif line.startswith(b"data: "):
                out.append((eid, line[6:]))
                eid = None
                if b'"text"' in line and _text([(None, line[6:])]):
                    tokens += 1
                    if tokens == stop_after and on_stop is not None:
                        on_stop()
    except requests.exceptions.RequestException:
        pass   # the connection broke (the router was killed)


def _text(events) -> str:
    return "".join(json.loads(d)["choices"][0]["text"] for _, d in events
                   if d != b"[DONE]" and json.loads(d).get("choices"))


def test_a_stream_survives_its_router_killed_mid_stream(fleet):
    """kill -9 of the router after 3 tokens; the client reconnects to the restarted router with the last
    event id it got and receives the rest: the whole text equals an uninterrupted greedy run's, the
    event indices run on without a repeat or a gap, and the decode worker ends idle. Before resumption
    the stream just broke (the chaos soak's ``router_killed_mid_stream``)."""
    decode = _decode(fleet)
    want = requests.post(fleet.endpoint + "/v1/completions", json=_body(64, stream=False), timeout=120)
    assert want.status_code == 200, want.text
    want = want.json()["choices"][0]["text"]
    router = next(p for p in fleet.procs if p.role == "router")

    first: list = []
    r = requests.post(fleet.endpoint + "/v1/completions", json=_body(64), stream=True, timeout=60)
    assert r.status_code == 200
    _events(r, first, stop_after=3, on_stop=lambda: os.kill(router.popen.pid, signal.SIGKILL))
    assert first and first[-1][1] != b"[DONE]", "the stream was not cut by the kill"
    last_id = [e for e, _ in first if e][-1]
    sid, _, index = last_id.rpartition(":")
    assert sid.split(".")[0] == worker_key(decode)

    # the fleet restarts the router (its supervisor's round, run here)
    assert wait_for(lambda: router.popen.poll() is not None, timeout=10)
    # the whole answer made and held unread: the worker still counts it in flight, so a drain waits for
    # it (the thirteenth session's soak: a decode worker drained and exited with such a stream unread)
    assert wait_for(lambda: (lambda h: h["num_requests"] == 0 and h["resumable_streams"] == 1)(_health(decode)),
                    timeout=30)
    assert _health(decode)["in_flight"] >= 1
    assert wait_for(lambda: fleet.refresh() is not None and router.state == "ready", timeout=120)
    rest: list = []
    r2 = requests.post(fleet.endpoint + "/v1/completions", json=_body(64), stream=True, timeout=60,
                       headers={"Last-Event-ID": last_id})
    assert r2.status_code == 200, r2.text
    _events(r2, rest)
    assert rest[-1][1] == b"[DONE]"
    ids = [int(e.rpartition(":")[2]) for e, _ in first + rest if e]
    assert ids == list(range(ids[0], ids[0] + len(ids))), ids   # no repeat, no gap
    assert {e.rpartition(":")[0] for e, _ in rest if e} == {sid}
    assert _text(first) + _text(rest) == want
    assert wait_for(lambda: _idle(decode), timeout=30)
    # once whole, the stream is gone: a second resume finds nothing
    r3 = requests.post(fleet.endpoint + "/v1/completions", json=_body(64), timeout=30,
                       headers={"Last-Event-ID": last_id})
    assert r3.status_code == 404, r3.text


def test_a_client_that_leaves_through_the_router_frees_its_blocks_at_once(fleet):
    """The router's client closes its connection mid-stream: the router cancels the stream at its decode
    worker, which frees the blocks at once, not after the grace (45 s here). Without the cancel the
    worker kept the sequence running for the whole grace."""
    decode = _decode(fleet)
    r = requests.post(fleet.endpoint + "/v1/completions", json=_body(1500), stream=True, timeout=60)
    lines = r.iter_lines()
    for _ in range(8):
        next(lines)
    assert _health(decode)["resumable_streams"] == 1
    t0 = time.monotonic()
    r.close()
    assert wait_for(lambda: _idle(decode), timeout=GRACE / 3), _health(decode)
    assert time.monotonic() - t0 < GRACE / 3
    assert _health(decode)["streams_expired"] == 0   # cancelled, not expired


def test_a_stream_nobody_resumes_is_freed_after_the_grace(fleet):
    """Playing the router at the decode worker: a stream opted in with a 3 s grace whose connection drops
    keeps its sequence (another credential cannot resume it: 404), and is aborted with its blocks freed
    once the grace passes. A request without the opt-in is freed at once when its client leaves."""
    decode = _decode(fleet)
    sid = f"{worker_key(decode)}.{uuid.uuid4().hex}"
    opt_in = {STREAM_ID_HEADER: sid, STREAM_GRACE_HEADER: "3", STREAM_OWNER_HEADER: "a" * 32}
    r = requests.post(decode + "/v1/completions", json=_body(1500), stream=True, timeout=60,
                      headers={**fleet.worker_headers, **opt_in})
    assert r.status_code == 200, r.text
    lines = r.iter_lines()
    for _ in range(8):
        next(lines)
    r.close()
    t0 = time.monotonic()
    time.sleep(1)
    h = _health(decode)
    assert h["resumable_streams"] == 1 and h["num_requests"] == 1, h   # kept for a resume
    stranger = requests.post(decode + "/v1/streams/resume", timeout=10, headers={
        **fleet.worker_headers, STREAM_ID_HEADER: sid, STREAM_OWNER_HEADER: "b" * 32, "Last-Event-ID": "0"})
    assert stranger.status_code == 404
    no_pool = requests.post(decode + "/v1/streams/resume", timeout=10, headers={
        STREAM_ID_HEADER: sid, STREAM_OWNER_HEADER: "a" * 32, "Last-Event-ID": "0"})
    assert no_pool.status_code == 401   # only the pool may resume at a worker
    assert wait_for(lambda: _idle(decode), timeout=30), _health(decode)
    assert time.monotonic() - t0 >= 2.5
    assert _health(decode)["streams_expired"] == 1

    r = requests.post(decode + "/v1/completions", json=_body(1500), stream=True, timeout=60,
                      headers=fleet.worker_headers)
    lines = r.iter_lines()
    for _ in range(8):
        next(lines)
    assert _health(decode)["resumable_streams"] == 0
    r.close()
    assert wait_for(lambda: _idle(decode), timeout=2.5), _health(decode)


def test_the_load_generator_resumes_a_stream_whose_router_was_killed(fleet):
    """The chaos soak's client (worker/bench/client.py): the router is killed after the first token and
    restarted by the fleet's supervisor; the client reconnects with Last-Event-ID (refused while the
    router is down, then resumed) and ends with the uninterrupted greedy text, counted in ``resumes``."""
    import asyncio
    import threading

    import aiohttp

    from tandem.worker.bench.client import RequestRecord, Target, send
    from tandem.worker.bench.datasets import BenchRequest

    want = requests.post(fleet.endpoint + "/v1/completions", json=_body(48, stream=False), timeout=120)
    want = want.json()["choices"][0]["text"]
    router = next(p for p in fleet.procs if p.role == "router")
    stop = threading.Event()

    def supervise():   # what `tandem up`'s supervisor thread does
        while not stop.is_set():
            fleet.refresh()
            time.sleep(0.3)

    async def run():
        req = BenchRequest("r0", [{"role": "user", "content": "Once upon a time"}], 4, 48)
        rec = RequestRecord("r0", None, 0, False, None)
        target = Target(fleet.endpoint, MODEL, "completions", timeout=120, temperature=0)
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(send(s, target, req, rec))
            while rec.first_token_mono is None and not task.done():
                await asyncio.sleep(0.01)
            os.kill(router.popen.pid, signal.SIGKILL)
            return await task
    sup = threading.Thread(target=supervise, daemon=True)
    sup.start()
    try:
        rec = asyncio.run(run())
    finally:
        stop.set()
        sup.join()
    assert rec.ok, (rec.error_kind, rec.error)
    assert rec.resumes >= 1 and rec.last_event_id
    assert rec.text == want
    assert rec.completion_tokens == 48
    assert wait_for(lambda: _idle(_decode(fleet)), timeout=30)
