"""The HTTP listener before authentication (docs/security.md, "Connections" and "API keys"), against a
real router process (`tandem serve --role router`, static discovery with no worker, API keys and no pool
secret) on loopback, its file descriptors limited to 1024 as a pod's often are:

- 2,000 idle connections neither exhaust its file descriptors nor slow its /health;
- an idle connection is closed after the keepalive timeout;
- a credential that is not UTF-8 is a counted 401, not a 500;
- /absorb-bursts on a router with API keys but no pool secret takes no request at all.
"""
import asyncio
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

from fleet_utils import ROOT, metric, wait_for
from tandem.operator.local import free_port
from tandem.operator.spec import load_manifest, worker_config
from tandem.worker.api import auth

pytestmark = pytest.mark.timeout(180)
KEY = "sk-hardening-0123456789"
FD_LIMIT = 1024
KEEPALIVE = 2.0


def _limit_fds():
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.fixture(scope="module")
def router():
    pool = load_manifest(ROOT / "examples" / "smollm2.yaml")
    pool.metadata.name = "hardening"
    cfg = Path(tempfile.mkdtemp()) / "router.yaml"
    cfg.write_text(worker_config(pool, "router", {"mode": "static", "prefill": [], "decode": []}).to_yaml())
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1", auth.API_KEYS_ENV: KEY}
    env.pop(auth.POOL_SECRET_ENV, None)
    env.pop(auth.POOL_SECRET_FILE_ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "router", "--config",
                             str(cfg), "--port", str(port), "--keepalive-timeout", str(KEEPALIVE)],
                            env=env, start_new_session=True, preexec_fn=_limit_fds)
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return proc.poll() is None and requests.get(url + "/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False
    try:
        assert wait_for(lambda: proc.poll() is not None or up(), 120) and proc.poll() is None, \
            "the router did not start"
        yield proc, url, port
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def refusals(url: str, endpoint: str) -> float:
    try:
        return metric(url, "tandem:auth_failures_total", endpoint=endpoint)
    except LookupError:   # no refusal counted yet
        return 0.0


def raw_request(port: int, head: bytes) -> bytes:
    """Send a request's bytes as given (headers that are not UTF-8) and return the status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        return s.recv(65536).split(b"\r\n", 1)[0]


def test_idle_connections_neither_exhaust_fds_nor_slow_health(router):
    """2,000 connections that send nothing: the router holds at most what fits its 1024 descriptors
    (the oldest idle ones are closed for new ones), and /health, each time on a new connection, answers:
    the median of 10 probes within 0.5 s (normally ~20 ms on 2 loaded cores), each within 5 s. Before
    the fix every connection was kept (for an hour): accept() hit EMFILE and /health could not connect
    (the 10 s timeout). The 5 s is not the router's speed: while the burst's connects whose SYN the full
    listen backlog dropped come back (the kernel resends a SYN after 1 s, then 3 s), a probe's own SYN
    can be dropped too and wait for its resend; one clean-clone run measured 1.017 s that way."""
    proc, url, port = router
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2300:
        if hard != resource.RLIM_INFINITY and hard < 2300:
            pytest.skip(f"this test process may open only {hard} files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard) if hard != resource.RLIM_INFINITY else 4096, hard))
    socks = []
    try:
        for _ in range(2000):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        # the first probe waits behind the burst in the accept queue (about 1 s here on 2 loaded cores),
        # and may be reset while the router sheds it: accepted in one batch with the burst, a connection
        # that has not spoken yet can be taken for an old idle one (a client retries a reset connect)
        t_end, first = time.monotonic() + 20, None
        while first is None:
            try:
                first = requests.get(url + "/health", timeout=10, headers={"Connection": "close"})
            except requests.ConnectionError:
                if time.monotonic() > t_end:
                    raise
                time.sleep(0.2)
        assert first.status_code == 200
        took = []
        for _ in range(10):   # then, with the 2,000 still open, ~20 ms each on 2 loaded cores
            t0 = time.monotonic()
            r = requests.get(url + "/health", timeout=10, headers={"Connection": "close"})
            took.append(time.monotonic() - t0)
            assert r.status_code == 200
        assert statistics.median(took) < 0.5 and max(took) < 5.0, \
            f"/health took {sorted(took)} s with 2,000 idle connections open"
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert fds < FD_LIMIT, fds
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()


def test_an_idle_connection_is_closed_after_the_keepalive_timeout(router):
    proc, url, port = router
    with socket.create_connection(("127.0.0.1", port), timeout=KEEPALIVE * 4) as s:
        t0 = time.monotonic()
        assert s.recv(1) == b""    # closed by the router, not by our timeout
        assert time.monotonic() - t0 < KEEPALIVE * 3


def test_a_credential_that_is_not_utf8_is_a_counted_401(router):
    proc, url, port = router
    before = refusals(url, "/v1/completions")
    status = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xfd\r\n"
                               b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert b" 401 " in status, status
    assert refusals(url, "/v1/completions") == before + 1


def test_the_pool_token_that_is_not_utf8_is_a_counted_401():
    """The pool-token path of the same middleware (a worker's), served by aiohttp on loopback."""
    from aiohttp import web
    refused = []

    async def main():
        async def ok(request):
            return web.json_response({"ok": True})
        app = web.Application()
        app.router.add_post("/v1/completions", ok)
        auth.install(app, None, b"p" * 32, refused.append)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await asyncio.to_thread(raw_request, port, (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Tandem-Pool-Token: \xff\xfe\r\n"
                b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"))
        finally:
            await runner.cleanup()
    status = asyncio.run(main())
    assert b" 401 " in status, status
    assert refused == ["/v1/completions"]


def test_absorb_bursts_without_a_pool_secret_takes_nothing(router):
    """A router with API keys and no pool secret: nobody can prove to be the pool, so /absorb-bursts
    refuses everyone (before the fix it took a request with no credential at all)."""
    proc, url, port = router
    before = refusals(url, "/absorb-bursts")
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
        r = requests.post(url + "/absorb-bursts", json={"seconds": 60}, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
    assert refusals(url, "/absorb-bursts") == before + 2


def test_a_pool_token_is_accepted_once_and_only_while_fresh():
    """The worker middleware on loopback: a fresh token passes once; the same token again (a capture
    replayed), one two minutes old, and one made with another secret are counted 401s. Before the fix
    the token was one fixed value per pool, good forever."""
    import aiohttp
    from aiohttp import web
    secret, refused = b"q" * 32, []

    async def main():
        async def ok(request):
            return web.json_response({"ok": True})
        app = web.Application()
        app.router.add_post("/v1/completions", ok)
        auth.install(app, None, secret, refused.append)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions"
        try:
            async with aiohttp.ClientSession() as s:
                async def post(headers):
                    async with s.post(url, json={}, headers=headers) as r:
                        return r.status
                captured = auth.pool_headers(secret)
                return [await post(captured), await post(captured),
                        await post({auth.POOL_TOKEN_HEADER: auth.pool_token(secret, now=time.time() - 120)}),
                        await post(auth.pool_headers(b"o" * 32)), await post(auth.pool_headers(secret))]
        finally:
            await runner.cleanup()
    assert asyncio.run(main()) == [200, 401, 401, 401, 200]
    assert refused == ["/v1/completions"] * 3


def test_a_client_key_cannot_name_a_prefill_peer(monkeypatch):
    """A decode worker with API keys and a pool secret, called with a client's key and a prefill-peer
    header that points at a listening socket of ours: the worker never connects there (only the router,
    with a pool token, names peers; before the fix it fetched that URL's /health and spoke KV to it)
    and answers the request by prefilling locally."""
    from fleet_utils import MODEL, start_worker
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.5)
    monkeypatch.setenv(auth.API_KEYS_ENV, KEY)
    monkeypatch.setenv(auth.POOL_SECRET_ENV, "s" * 32)
    proc, url = start_worker("decode", name="peer-check")
    try:
        r = requests.post(url + "/v1/chat/completions", timeout=300, headers={
            "Authorization": f"Bearer {KEY}",
            "X-Tandem-Prefill-Peer": f"http://127.0.0.1:{trap.getsockname()[1]}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        with pytest.raises(socket.timeout):
            trap.accept()
    finally:
        proc.terminate()
        proc.wait(30)
        trap.close()
