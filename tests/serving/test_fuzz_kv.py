"""Property-based fuzzing of the KV port (hypothesis): random bytes, frames with random headers and
parts, random JSON proofs, and real HELLOs made with a wrong key then mutated byte by byte, each sent
on its own connection to a real KVTransferServer (tiny random Llama engine, loopback) that holds a
pool secret. Properties: the server never crashes, every input is refused and counted, nothing leaks
(no sequence, no block, nothing in flight or mid-handshake), and a real transfer still passes after.

CI runs ``TANDEM_FUZZ_EXAMPLES`` inputs (default 300, well under a minute); set it higher for the
long run recorded in bench/RESULTS.md. The figure (inputs, refusals, leaks, RSS growth) is printed.
"""
import asyncio
import json
import os
import resource
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.worker.engine.async_engine import AsyncEngine
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import LLMEngine
from tandem.worker.transfer import handshake
from tandem.worker.transfer.protocol import HEADER, MAGIC, FrameType, encode_frame
from tandem.worker.transfer.tcp import KVTransferServer, pull_kv

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "300"))
pytestmark = pytest.mark.timeout(max(120, EXAMPLES // 2))
SECRET = b"f" * 32


def _read_challenge(s: socket.socket) -> str:
    buf = b""
    while len(buf) < HEADER.size:
        chunk = s.recv(HEADER.size - len(buf))
        if not chunk:
            raise ConnectionError("closed before CHALLENGE")
        buf += chunk
    _, _, jlen, _, _ = HEADER.unpack(buf)
    body = b""
    while len(body) < jlen:
        body += s.recv(jlen - len(body))
    return json.loads(body)["nonce"]


def _send(port: int, make) -> None:
    """One connection: read the CHALLENGE, send ``make(nonce)``'s bytes, close our side, wait for the
    server to end it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        data = make(_read_challenge(s))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except (ConnectionError, socket.timeout):
            pass


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _header(ftype: int, jlen: int, plen: int) -> bytes:
    return struct.pack("<4sBIQ32s", MAGIC, ftype, jlen, plen, bytes(32))


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)

raw_bytes = st.binary(max_size=2048).map(lambda b: lambda nonce: b)
frames = st.tuples(st.integers(0, 255), st.integers(0, 4096), st.integers(0, 1 << 22), st.binary(max_size=2048)).map(
    lambda t: lambda nonce: _header(t[0], t[1], t[2]) + t[3])
proofs = st.tuples(json_values, st.binary(max_size=256)).map(
    lambda t: lambda nonce: (lambda j: _header(FrameType.HELLO, len(j), len(t[1])) + j + t[1])(
        json.dumps(t[0]).encode()))


def _wrong_key_hello(nonce: str, mutations) -> bytes:
    body = json.dumps({"layout": {}, "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 1}}).encode()
    data = bytearray(b"".join(bytes(x) for x in encode_frame(FrameType.HELLO, handshake.hello_proof(
        b"w" * 32, nonce, body), body)))
    for pos, val in mutations:
        data[pos % len(data)] = val
    return bytes(data)


mutated = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6).map(
    lambda m: lambda nonce: _wrong_key_hello(nonce, m))


def test_the_kv_port_survives_fuzzing_and_counts_every_refusal(tiny_llama):
    pe = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, max_num_batched_tokens=16))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    refused = [0]

    async def setup():
        pa = AsyncEngine(pe)
        server = KVTransferServer(pa, pe.kv_layout(), secret=SECRET, hello_timeout=2.0,
                                  on_refused=lambda: refused.__setitem__(0, refused[0] + 1))
        pa.start()
        return pa, server, await server.start("127.0.0.1", 0)
    pa, server, port = asyncio.run_coroutine_threadsafe(setup(), loop).result(60)
    tried = [0]
    rss0, peak0 = _rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(raw_bytes, frames, proofs, mutated))
    def fuzz(make):
        _send(port, make)
        tried[0] += 1

    try:
        fuzz()
        for _ in range(200):   # the last refusals land on the server's loop
            if refused[0] >= tried[0] and server.handshaking == 0:
                break
            time.sleep(0.05)
        seconds = time.monotonic() - t0
        growth, peak = _rss_mib() - rss0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak0
        print(f"\nfuzz: {tried[0]} inputs in {seconds:.1f} s, {refused[0]} refused and counted, "
              f"sequences left {len(pe.seqs)}, blocks used {pe.block_manager.num_used}, "
              f"in flight {server.active}, RSS growth {growth:.1f} MiB (peak RSS growth {peak:.1f} MiB; "
              f"server and client share this process)")
        assert refused[0] == tried[0]
        assert pe.seqs == {} and pe.block_manager.num_used == 0
        assert server.active == 0 and server.handshaking == 0 and pa.error is None

        async def real():
            hello = {"layout": pe.kv_layout(), "prompt_token_ids": list(range(1, 20)),
                     "params": {"max_tokens": 1, "temperature": 0}}
            return await pull_kv("127.0.0.1", port, hello, lambda i, d: asyncio.sleep(0), max_payload=1 << 24,
                                 secret=SECRET)
        done, n = asyncio.run(real())
        assert n > 0 and "token_id" in done
    finally:
        async def teardown():
            await server.stop()
            pa.stop()
        asyncio.run_coroutine_threadsafe(teardown(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
