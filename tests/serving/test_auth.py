"""Who may talk to what (docs/security.md), with real processes on loopback and the real SmolLM2 model:
API keys at the router, the pool token between router and workers, the pool secret in the KV transfer
handshake, and a second pool on the same machine that cannot use the first one's workers.

"No engine work" is read from the workers' own counters (prompt tokens received and computed, KV
usage, requests held): a refusal must leave every one of them where it was."""
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import yaml

from fleet_utils import MODEL, ROOT, metric, start_fleet, urls, wait_for
from tandem.operator.local import free_port
from tandem.operator.spec import load_manifest, worker_config
from tandem.worker.api import auth
from tandem.worker.transfer.protocol import TransferError
from tandem.worker.transfer.tcp import pull_kv

pytestmark = pytest.mark.timeout(600)
KEYS = ["sk-tandem-first-0123456789", "sk-tandem-second-9876543210"]


def manifest_with_keys(tmp: Path) -> Path:
    """The example pool, named auth-a, whose router requires the keys of a Secret kept in the same file
    (as `tandem up` reads it; on Kubernetes the operator mounts it)."""
    pool = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    pool["metadata"]["name"] = "auth-a"
    pool["spec"]["router"]["apiKeySecretRef"] = {"name": "auth-a-keys"}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "auth-a-keys"},
              "stringData": {"alice": KEYS[0], "bob": KEYS[1] + "\n"}}
    path = tmp / "pool.yaml"
    path.write_text(yaml.safe_dump_all([pool, secret]))
    return path


@pytest.fixture(scope="module")
def secured():
    f = start_fleet(manifest=manifest_with_keys(Path(tempfile.mkdtemp())), pool_secret=True)
    yield f
    f.stop(grace=10)


def work_counters(worker: str) -> dict:
    """Everything that moves when a worker starts engine work for a request."""
    h = requests.get(worker + "/health", timeout=10).json()
    return {"prompt": metric(worker, "tandem:prompt_tokens_total"),
            "computed": metric(worker, "tandem:prompt_tokens_computed_total"),
            "generated": metric(worker, "tandem:generation_tokens_total"),
            "free_blocks": h["free_blocks"], "requests": h["num_requests"]}


def refusals(url: str, endpoint: str) -> float:
    return metric(url, "tandem:auth_failures_total", endpoint=endpoint)


def body(prompt: str = "What is the capital of France?") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}


def test_router_requires_an_api_key_and_keeps_probes_open(secured):
    workers = urls(secured, "prefill") + urls(secured, "decode")
    before = {w: work_counters(w) for w in workers}
    chat_url = secured.endpoint + "/v1/chat/completions"
    refused0 = refusals(secured.endpoint, "/v1/chat/completions")
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEYS[0]},   # no "Bearer"
                    {"Authorization": "Bearer " + KEYS[0][:-1]}):
        r = requests.post(chat_url, json=body(), headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 401 and err["message"]
        assert KEYS[0] not in r.text and KEYS[1] not in r.text
    assert requests.get(secured.endpoint + "/v1/models", timeout=10).status_code == 401
    assert refusals(secured.endpoint, "/v1/chat/completions") == refused0 + 4
    # no engine work started anywhere
    assert {w: work_counters(w) for w in workers} == before
    # probes and scrapes need no key
    for path in ("/health", "/ready", "/metrics"):
        assert requests.get(secured.endpoint + path, timeout=10).status_code == 200, path
    # both keys of the Secret work, through remote prefill (the router proves the pool to the workers,
    # the decode worker proves it to the prefill worker)
    for key in KEYS:
        r = requests.post(chat_url, json=body(), headers={"Authorization": f"Bearer {key}"}, timeout=300)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    (prefill,), (decode,) = urls(secured, "prefill"), urls(secured, "decode")
    assert metric(prefill, "tandem:prompt_tokens_computed_total") > before[prefill]["computed"]
    assert metric(decode, "tandem:kv_transfer_bytes_total", direction="received") > 0
    assert secured.ask("Say hi.", max_tokens=4)   # `tandem up --ask` sends the key too


def test_workers_take_requests_only_from_their_pool(secured):
    (prefill,), (decode,) = urls(secured, "prefill"), urls(secured, "decode")
    before = {w: work_counters(w) for w in (prefill, decode)}
    refused0 = refusals(decode, "/v1/chat/completions")
    other_pool = auth.pool_headers(b"another-pool-secret-0123456789")
    for headers in ({}, {"Authorization": f"Bearer {KEYS[0]}"},   # a client key is not a pool credential
                    other_pool, {**other_pool, "X-Tandem-Prefill-Peer": prefill}):
        r = requests.post(decode + "/v1/chat/completions", json=body(), headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == 401
    r = requests.post(prefill + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=60)
    assert r.status_code == 401
    assert requests.post(decode + "/drain", timeout=10).status_code == 401   # nobody else may drain it
    assert requests.get(decode + "/ready", timeout=10).status_code == 200
    assert requests.get(decode + "/drain", timeout=10).json()["draining"] is False
    assert refusals(decode, "/v1/chat/completions") == refused0 + 4
    assert refusals(decode, "/drain") >= 1 and refusals(prefill, "/v1/completions") >= 1
    assert {w: work_counters(w) for w in (prefill, decode)} == before
    # the pool's own token works (a caller playing this fleet's router)
    r = requests.post(decode + "/v1/chat/completions", json=body(), headers=secured.worker_headers, timeout=300)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]


def forged_pulls(kv_port: int, secrets) -> list[str]:
    """A KV pull with a forged layout under each of ``secrets``: each must fail (TransferError), and its
    message is returned (a refused handshake, or a layout mismatch once the handshake passed)."""
    hello = {"layout": {"forged": True}, "prompt_token_ids": list(range(1, 400)), "params": {"max_tokens": 1}}

    async def attempt(secret):
        with pytest.raises(TransferError) as e:
            await pull_kv("127.0.0.1", kv_port, dict(hello), lambda i, d: asyncio.sleep(0),
                          max_payload=1 << 20, secret=secret)
        return str(e.value)

    async def main():
        return [await attempt(s) for s in secrets]
    return asyncio.run(main())


def test_forged_kv_transfers_are_refused_before_allocation(secured):
    """A client that speaks the KV protocol, without the pool's secret or with another pool's, is
    refused at the handshake: neither worker's KV usage, compute or request counters move, and the
    refusal is counted. With the right secret the handshake passes (and then fails on the layout,
    which proves the check ran in that order)."""
    (prefill,), (decode,) = urls(secured, "prefill"), urls(secured, "decode")
    kv_port = requests.get(prefill + "/health", timeout=10).json()["kv_port"]
    before = {w: work_counters(w) for w in (prefill, decode)}
    refused0 = refusals(prefill, "kv")
    right = secured.secret_file.read_bytes().strip()
    no_secret, other, own = forged_pulls(kv_port, (None, b"another-pool-secret-0123456789", right))
    assert "not authenticated for this pool" in no_secret and "not authenticated for this pool" in other
    assert "KV layout mismatch" in own
    assert refusals(prefill, "kv") == refused0 + 2
    assert {w: work_counters(w) for w in (prefill, decode)} == before


def start_router(pool_name: str, decode: list[str], prefill: list[str], secret: bytes) -> tuple[subprocess.Popen, str]:
    """A router of another pool (its own secret) whose discovery names this fleet's workers."""
    pool = load_manifest(ROOT / "examples" / "smollm2.yaml")
    pool.metadata.name = pool_name
    cfg = Path(tempfile.mkdtemp()) / "router.yaml"
    cfg.write_text(worker_config(pool, "router", {"mode": "static", "prefill": prefill, "decode": decode}).to_yaml())
    sfile = cfg.parent / "secret"
    sfile.write_bytes(secret)
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1", auth.POOL_SECRET_FILE_ENV: str(sfile)}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "router", "--config",
                             str(cfg), "--port", str(port)], env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: proc.poll() is None and _up(url), 120), "router of pool b did not start"
    return proc, url


def _up(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def test_a_second_pool_cannot_use_the_first_pools_workers(secured):
    (prefill,), (decode,) = urls(secured, "prefill"), urls(secured, "decode")
    proc, router_b = start_router("auth-b", [decode], [prefill], b"pool-b-secret-" + os.urandom(16).hex().encode())
    try:
        # the workers are healthy (probes are open), so pool b's router sees them ready ...
        assert wait_for(lambda: requests.get(router_b + "/ready", timeout=5).status_code == 200, 30)
        before = {w: work_counters(w) for w in (prefill, decode)}
        refused0 = refusals(decode, "/v1/chat/completions")
        t0 = time.monotonic()
        r = requests.post(router_b + "/v1/chat/completions", json=body(), timeout=120)
        # ... but they refuse its requests: a clear 502, at once, and no work on pool a
        assert r.status_code == 502 and "pool credential" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 30
        assert refusals(decode, "/v1/chat/completions") == refused0 + 1
        assert {w: work_counters(w) for w in (prefill, decode)} == before
        # pool a still serves its own clients
        ok = requests.post(secured.endpoint + "/v1/chat/completions", json=body(),
                           headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=300)
        assert ok.status_code == 200
    finally:
        _stop(proc, 20)


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (drain, then exit), SIGKILL after ``grace`` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_a_worker_run_alone_takes_api_keys(tmp_path):
    """`tandem serve --role both` with TANDEM_API_KEYS: Bearer keys, as vLLM's --api-key; probes open."""
    from fleet_utils import example_manifest
    pool = load_manifest(example_manifest(None, "alone"))
    cfg = tmp_path / "worker.yaml"
    cfg.write_text(worker_config(pool, "both").to_yaml())
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1", auth.API_KEYS_ENV: "k-one-0123456789, k-two-0123456789"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "both", "--config",
                             str(cfg), "--port", str(port)], env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: proc.poll() is None and _up(url), 300)
        before = work_counters(url)
        assert requests.post(url + "/v1/chat/completions", json=body(), timeout=60).status_code == 401
        assert requests.post(url + "/v1/chat/completions", json=body(), timeout=60,
                             headers={"Authorization": "Bearer k-three"}).status_code == 401
        assert work_counters(url) == before
        assert refusals(url, "/v1/chat/completions") == 2
        r = requests.post(url + "/v1/chat/completions", json=body(), timeout=300,
                          headers={"Authorization": "Bearer k-two-0123456789"})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        assert requests.get(url + "/metrics", timeout=10).status_code == 200
    finally:
        _stop(proc, 30)


def test_an_api_key_reference_the_manifest_cannot_satisfy_is_a_clear_error(tmp_path, monkeypatch):
    from tandem.operator.local import LocalFleet
    from tandem.operator.spec import SpecError
    monkeypatch.delenv(auth.API_KEYS_ENV, raising=False)
    monkeypatch.delenv(auth.API_KEY_FILE_ENV, raising=False)
    pool = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    pool["spec"]["router"]["apiKeySecretRef"] = {"name": "missing"}
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(pool))
    with pytest.raises(SpecError, match="spec.router.apiKeySecretRef.*'missing'.*TANDEM_API_KEYS"):
        LocalFleet(str(path))
    monkeypatch.setenv(auth.API_KEYS_ENV, "from-env-0123456789")
    fleet = LocalFleet(str(path), router_port=1)
    try:
        assert fleet.api_keys == ["from-env-0123456789"]
        for f in (fleet.secret_file, fleet.api_key_file):   # credentials readable by their owner only
            assert f.stat().st_mode & 0o777 == 0o600
        assert fleet._credential_env("router")[auth.API_KEY_FILE_ENV] == str(fleet.api_key_file)
        assert auth.API_KEY_FILE_ENV not in fleet._credential_env("decode")
        assert auth.API_KEYS_ENV not in fleet._credential_env("router")   # never in a child's environment
    finally:
        shutil.rmtree(fleet.dir)


def test_the_decode_side_takes_kv_only_from_a_peer_that_proves_the_secret(tiny_llama):
    """Both directions of the handshake, on a real engine (tiny random Llama) over loopback: the same
    secret transfers; a prefill worker that cannot prove it (no secret, or another one) gets no block
    written, whatever it sends."""
    from tandem.worker.engine.async_engine import AsyncEngine
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.transfer.tcp import KVTransferServer

    async def main():
        pe = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, max_num_batched_tokens=16))
        pa = AsyncEngine(pe)
        pa.start()
        results = {}
        try:
            for name, server_secret, client_secret in (("same", b"s" * 32, b"s" * 32),
                                                       ("server-open", None, b"s" * 32),
                                                       ("other", b"o" * 32, b"s" * 32)):
                server = KVTransferServer(pa, pe.kv_layout(), secret=server_secret)
                port = await server.start("127.0.0.1", 0)
                blocks = []

                async def on_blocks(i, d):
                    blocks.append(i)
                hello = {"layout": pe.kv_layout(), "prompt_token_ids": list(range(1, 20)),
                         "params": {"max_tokens": 1, "temperature": 0}}
                try:
                    done, n = await pull_kv("127.0.0.1", port, hello, on_blocks, max_payload=1 << 24,
                                            secret=client_secret)
                    results[name] = ("ok", len(blocks), n)
                except TransferError as e:
                    results[name] = (str(e), len(blocks), 0)
                await server.stop()
        finally:
            pa.stop()
        return results
    res = asyncio.run(main())
    assert res["same"][0] == "ok" and res["same"][1] > 0 and res["same"][2] > 0
    assert "did not prove this pool's secret" in res["server-open"][0] and res["server-open"][1] == 0
    assert "not authenticated for this pool" in res["other"][0] and res["other"][1] == 0


def test_bench_client_sends_the_api_key(secured):
    """`tandem bench serve` against a keyed router: OPENAI_API_KEY (Target.api_key) as vLLM's bench."""
    import aiohttp

    from tandem.worker.bench.client import RequestRecord, Target, send
    from tandem.worker.bench.datasets import BenchRequest

    async def one(key):
        req = BenchRequest(id="r", messages=[{"role": "user", "content": "Hi"}], prompt_tokens=1, output_tokens=2)
        rec = RequestRecord(id="r", session=None, turn=0, scheduled=False, intended_mono=None)
        async with aiohttp.ClientSession() as s:
            return await send(s, Target(secured.endpoint, MODEL, api_key=key), req, rec)
    assert asyncio.run(one(None)).error_kind == "http_401"
    rec = asyncio.run(one(KEYS[0]))
    assert rec.ok and rec.completion_tokens == 2, (rec.error_kind, rec.error)


def test_only_the_pool_may_switch_the_routers_burst_absorption(secured):
    """POST /absorb-bursts (the operator's, on Kubernetes) takes the pool token and nothing else; while
    on, the router prefills on the decode worker (`absorb_burst` decisions), and it stops when told."""
    url, key = secured.endpoint, {"Authorization": f"Bearer {KEYS[0]}"}
    absorbed = lambda: metric(url, "tandem:router_routing_decisions_total", decision="absorb_burst")  # noqa: E731
    refused0 = refusals(url, "/absorb-bursts")
    for headers in ({}, key, auth.pool_headers(b"another-pool-secret-0123456789")):
        r = requests.post(url + "/absorb-bursts", json={"seconds": 60}, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
    assert refusals(url, "/absorb-bursts") == refused0 + 3
    for bad in ({"seconds": -1}, {"seconds": "soon"}, {"seconds": 1e9}):
        r = requests.post(url + "/absorb-bursts", json=bad, headers=secured.worker_headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seconds", r.text
    before = absorbed()
    r = requests.post(url + "/absorb-bursts", json={"seconds": 60}, headers=secured.worker_headers, timeout=10)
    assert r.status_code == 200 and r.json()["absorbBursts"] is True
    assert requests.post(url + "/v1/chat/completions", json=body(), headers=key, timeout=300).status_code == 200
    assert absorbed() == before + 1
    r = requests.post(url + "/absorb-bursts", json={"seconds": 0}, headers=secured.worker_headers, timeout=10)
    assert r.status_code == 200 and r.json()["absorbBursts"] is False
    assert requests.post(url + "/v1/chat/completions", json=body(), headers=key, timeout=300).status_code == 200
    assert absorbed() == before + 1


def test_the_router_holds_only_the_pool_token_key_which_makes_no_kv_proof(secured):
    """The router process is given the pool-token key alone (its environment names that file and no
    pool secret); that key, however it is used, gets no KV transfer out of the prefill worker: the
    handshake refuses it before allocating anything, and the refusal is counted. It still makes pool
    tokens the workers accept (the fleet answers through the router above)."""
    (prefill,), (decode,) = urls(secured, "prefill"), urls(secured, "decode")
    router, = [p for p in secured.procs if p.role == "router"]
    env = dict(line.split("=", 1) for line in
               Path(f"/proc/{router.popen.pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in line)
    assert auth.POOL_SECRET_FILE_ENV not in env and auth.POOL_SECRET_ENV not in env
    material = Path(env[auth.POOL_TOKEN_KEY_FILE_ENV]).read_bytes()
    secret = secured.secret_file.read_bytes().strip()
    assert secret not in material
    token_key = auth.load_pool_secret(env={auth.POOL_TOKEN_KEY_FILE_ENV: env[auth.POOL_TOKEN_KEY_FILE_ENV]})
    assert isinstance(token_key, auth.TokenKey)
    assert auth.TokenVerifier(secret).check(auth.pool_token(token_key))   # what the router is for

    kv_port = requests.get(prefill + "/health", timeout=10).json()["kv_port"]
    before = {w: work_counters(w) for w in (prefill, decode)}
    refused0 = refusals(prefill, "kv")
    # the key as loaded, its bytes, and the file's text as if it were a pool secret
    for msg in forged_pulls(kv_port, (token_key, bytes(token_key), material.strip())):
        assert "not authenticated for this pool" in msg, msg
    assert refusals(prefill, "kv") == refused0 + 3
    assert {w: work_counters(w) for w in (prefill, decode)} == before


class _Rogue:
    """A loopback HTTP server that records every request it gets (the host a forged prefill-peer header
    would name), answering /health with a KV port of its own."""

    def __init__(self):
        import http.server
        import threading
        rogue = self
        self.seen: list[str] = []

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                rogue.seen.append(self.path)
                data = b'{"kv_port": 9}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_decode_worker_pulls_kv_only_from_a_peer_its_pool_vouched_for(secured):
    """Even with a valid pool token, a prefill-peer header naming a host outside the pool makes the
    decode worker contact nothing: it prefills locally, answers correctly, and counts the refused peer.
    The pool's real prefill worker named without its claim is not used either; with the claim it
    publishes at /health (what the router forwards) the KV comes from it. Before the fix the decode
    worker fetched /health from whatever host the header named."""
    from tandem.worker.api.peer_claim import CLAIM_HEADER
    (prefill,), (decode,) = urls(secured, "prefill"), urls(secured, "decode")
    rogue = _Rogue()
    try:
        refused0 = refusals(decode, "kv")
        computed0 = metric(prefill, "tandem:prompt_tokens_computed_total")

        def ask(peer: str, extra: dict) -> None:
            h = {**secured.worker_headers, "X-Tandem-Prefill-Peer": peer, **extra}
            r = requests.post(decode + "/v1/chat/completions", json=body("What is the capital of France? Say it."),
                              headers=h, timeout=300)
            assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], (peer, r.text)
        ask(rogue.url, {})
        assert rogue.seen == []   # never contacted (before the fix: GET /health)
        claim = requests.get(prefill + "/health", timeout=10).json()["peer_claim"]
        ask(rogue.url, {CLAIM_HEADER: claim})   # another URL's claim
        ask(prefill, {})                        # a member, but unvouched
        assert rogue.seen == []
        assert refusals(decode, "kv") == refused0 + 3
        assert metric(prefill, "tandem:prompt_tokens_computed_total") == computed0   # all prefilled locally
        h = {**secured.worker_headers, "X-Tandem-Prefill-Peer": prefill, CLAIM_HEADER: claim}
        r = requests.post(decode + "/v1/chat/completions", json=body("What is the capital of France? Be brief."),
                          headers=h, timeout=300)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        assert metric(prefill, "tandem:prompt_tokens_computed_total") > computed0
    finally:
        rogue.close()
