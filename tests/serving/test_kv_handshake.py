"""The KV port before and after authentication (docs/security.md, "The KV transfer port"): a real
prefill engine (tiny random Llama) behind a real KVTransferServer on loopback, attacked by raw
sockets speaking the wire format.

- Nothing large is read before the peer proves the pool secret: an oversized HELLO is refused by its
  header, and the refusal is counted.
- Unauthenticated connections are capped and time out; they never count as in flight (drain).
- Malformed HELLOs (non-JSON, arrays, lone surrogates, wrong frame types) are refused and counted.
- After the handshake every frame is tagged: a byte changed on the path is caught before any block
  is written.
- A REJECT before ACCEPT is not authenticated: the decode side takes it as that peer's failure (a
  local prefill), never as a verdict that fails the request.
"""
import asyncio
import json

import pytest

from tandem.worker.engine.async_engine import AsyncEngine
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import LLMEngine
from tandem.worker.transfer import handshake
from tandem.worker.transfer.protocol import (HEADER, FrameType, RequestFailed, TransferError, read_frame,
                                             write_frame)
from tandem.worker.transfer.tcp import KVTransferServer, pull_kv

pytestmark = pytest.mark.timeout(120)
SECRET = b"s" * 32


@pytest.fixture(scope="module")
def prefill(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, max_num_batched_tokens=16))


def serve(pe, **kw):
    """A KV server (its engine started on the running loop) counting its refusals in ``server.refused``."""
    pa = AsyncEngine(pe)
    server = KVTransferServer(pa, pe.kv_layout(), secret=SECRET, **kw)
    pa.start()
    server.refused = 0

    def count():
        server.refused += 1
    server.on_refused = count
    return server


def hello(pe, n: int = 19, first: int = 1) -> dict:
    return {"layout": pe.kv_layout(), "prompt_token_ids": [i % 200 + first for i in range(n)],
            "params": {"max_tokens": 1, "temperature": 0}}


async def pull(port: int, h: dict, secret=SECRET):
    blocks = []

    async def on_blocks(i, d):
        blocks.append(i)
    done, n = await pull_kv("127.0.0.1", port, h, on_blocks, max_payload=1 << 24, secret=secret, deadline=30)
    return done, n, blocks


async def until(cond, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


def test_an_unauthenticated_hello_is_refused_by_its_header(prefill):
    """A client without the secret sends a 32 MiB HELLO (a long array of {}, as in the review's probe):
    the server refuses it after the header, so the client cannot even finish sending; the refusal is
    counted. Before the fix the whole HELLO was read and parsed, then refused."""
    pe = prefill

    async def main():
        server = serve(pe)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert (await read_frame(reader, max_payload=0))[0] == FrameType.CHALLENGE
            big = {"layout": {}, "x": [{}] * (32 * 2**20 // 3)}
            write_frame(writer, FrameType.HELLO, big)   # buffered here; the server reads what it wants
            try:
                await asyncio.wait_for(writer.drain(), 20)
                answer = await asyncio.wait_for(reader.read(), 20)
            except ConnectionError:
                answer = b""
            writer.transport.abort()
            assert not answer.startswith(b"TKV"), "the server read the whole oversized HELLO and answered it"
            assert await until(lambda: server.refused == 1)
            assert server.active == 0 and pe.seqs == {}
        finally:
            await server.stop()
            server.aengine.stop()
    asyncio.run(main())


def test_a_hello_longer_than_the_model_can_hold_is_refused_unread(prefill):
    """Even with the right secret, a HELLO body over ``hello_limit`` (derived from max_model_len and the
    block size) is refused by its header, counted, and nothing is allocated."""
    pe = prefill

    async def main():
        server = serve(pe)
        port = await server.start("127.0.0.1", 0)
        try:
            assert server.hello_limit < 11 * (pe.max_model_len + 4) + 16 * 1024 + 1
            with pytest.raises(TransferError):
                await pull(port, hello(pe, n=server.hello_limit // 2))
            assert await until(lambda: server.refused == 1)
            assert pe.seqs == {} and pe.block_manager.num_used == 0
            done, n, blocks = await pull(port, hello(pe))   # a real one still passes
            assert n > 0 and blocks and server.refused == 1
        finally:
            await server.stop()
            server.aengine.stop()
    asyncio.run(main())


def test_unauthenticated_connections_are_capped_time_out_and_are_not_in_flight(prefill):
    """40 idle connections against a cap of 8 and a 1 s handshake deadline: none counts in ``active``
    (what drain waits for), at most 8 wait at once, every one is closed by the server and counted, and
    a real transfer passes afterwards. Before the fix all 40 counted as in flight for 10 s."""
    pe = prefill

    async def main():
        server = serve(pe, hello_timeout=1.0, max_handshakes=8)
        port = await server.start("127.0.0.1", 0)
        conns = []
        try:
            for _ in range(40):
                conns.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0.3)
            assert server.active == 0
            assert server.handshaking <= 8
            ends = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in conns),
                                                         return_exceptions=True), 10)
            assert all(not isinstance(e, bytes) or HEADER.size < len(e) < 200 or e == b"" for e in ends)
            assert await until(lambda: server.refused == 40), server.refused
            assert server.handshaking == 0 and server.active == 0
            done, n, blocks = await pull(port, hello(pe))
            assert n > 0
        finally:
            for _, w in conns:
                w.transport.abort()
            await server.stop()
            server.aengine.stop()
    asyncio.run(main())


def _malformed() -> dict:
    """Raw bytes sent after the CHALLENGE, each a HELLO that is not one."""
    def frame(ftype, json_bytes: bytes, payload: bytes = b"") -> bytes:
        return HEADER.pack(b"TKV2", int(ftype), len(json_bytes), len(payload), bytes(32)) + json_bytes + payload
    surrogate = b'{"nonce":"\\ud800","bytes":2,"sha256":"\\udfff","mac":"\\ud800"}'
    return {
        "not json": frame(FrameType.HELLO, b"\xff\xfe{not json", b"{}"),
        "an array": frame(FrameType.HELLO, b"[1,2,3]", b"{}"),
        "lone surrogates": frame(FrameType.HELLO, surrogate, b"{}"),
        "wrong type": frame(FrameType.DONE, b"{}"),
        "bad magic": b"XXXX" + bytes(HEADER.size - 4),
        "truncated": frame(FrameType.HELLO, b'{"nonce":"ab"')[:-5],
    }


def test_stop_ends_the_connections_still_open(prefill):
    """Three clients connect and send nothing: ``stop`` returns at once, not at the 5 s handshake
    deadline, with no handler of theirs left pending, and each client sees its connection end. Before
    the fix, ``stop`` did not end them, and a CI run logged a handler torn down when its loop closed."""
    pe = prefill

    async def main():
        server = serve(pe, hello_timeout=5.0)
        port = await server.start("127.0.0.1", 0)
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        try:
            assert await until(lambda: server.handshaking == 3), server.handshaking
            await asyncio.wait_for(server.stop(), 2)
            mine = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
            assert not [t for t in mine if "_handle" in repr(t.get_coro())], mine
            ends = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in conns), return_exceptions=True), 2)
            assert all(isinstance(e, ConnectionError) or len(e) < 200 for e in ends), ends   # the CHALLENGE at most
            assert server.handshaking == 0 and server.active == 0
        finally:
            for _, w in conns:
                w.transport.abort()
            server.aengine.stop()
    asyncio.run(main())


@pytest.mark.parametrize("case", sorted(_malformed()))
def test_malformed_hellos_are_refused_and_counted(prefill, case):
    pe = prefill

    async def main():
        server = serve(pe, hello_timeout=1.0)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert (await read_frame(reader, max_payload=0))[0] == FrameType.CHALLENGE
            writer.write(_malformed()[case])
            await writer.drain()
            await asyncio.wait_for(reader.read(), 10)    # the server ends the connection
            writer.transport.abort()
            assert await until(lambda: server.refused == 1), f"{case}: not counted"
            assert server.active == 0 and server.handshaking == 0 and pe.seqs == {}
        finally:
            await server.stop()
            server.aengine.stop()
    asyncio.run(main())


def test_frames_after_the_handshake_carry_a_mac(prefill):
    """A host on the path (a TCP proxy here) flips one byte of the first BLOCKS payload: the decode
    side refuses that frame before writing it into its cache. Untouched, the same path transfers.
    Before the fix BLOCKS and DONE frames carried no MAC, and the altered KV was taken."""
    pe = prefill

    async def main():
        server = serve(pe)
        port = await server.start("127.0.0.1", 0)
        tamper = {"on": False, "done": False}

        async def pipe(src, dst, flip: bool):
            seen = 0
            try:
                while data := await src.read(65536):
                    if flip and tamper["on"] and not tamper["done"] and seen + len(data) > 600:
                        i = max(0, 600 - seen)   # inside the first BLOCKS frame's payload
                        data = data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]
                        tamper["done"] = True
                    seen += len(data)
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        async def proxy(cr, cw):
            sr, sw = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True))
        mitm = await asyncio.start_server(proxy, "127.0.0.1", 0)
        mport = mitm.sockets[0].getsockname()[1]
        try:
            h = hello(pe, n=40)
            done, n, blocks = await pull(mport, h)
            assert n > 600 and blocks
            tamper["on"] = True
            with pytest.raises(TransferError, match="MAC"):
                await pull(mport, hello(pe, n=40, first=7))   # not in the prefix cache either
            assert tamper["done"]
        finally:
            mitm.close()
            await server.stop()
            server.aengine.stop()
    asyncio.run(main())


def test_proofs_are_bound_to_the_body_and_the_keys_are_separate():
    """The HELLO proof names its body's hash: another body fails; each purpose has its own key."""
    body = json.dumps({"prompt_token_ids": [1, 2, 3]}).encode()
    proof = handshake.hello_proof(SECRET, "n" * 32, body)
    assert handshake.verify_proof(SECRET, "n" * 32, proof, len(body))
    assert not handshake.verify_proof(SECRET, "m" * 32, proof, len(body))
    assert not handshake.verify_proof(b"o" * 32, "n" * 32, proof, len(body))
    assert handshake.body_matches(proof, body)
    assert not handshake.body_matches(proof, body.replace(b"3", b"4"))
    keys = {handshake.derive(SECRET, p) for p in (handshake.KV_PROOF, handshake.KV_FRAME, handshake.ROUTER_TOKEN)}
    assert len(keys) == 3 and SECRET not in keys


@pytest.mark.parametrize("ftype", [FrameType.REJECT, FrameType.ERROR])
def test_a_refusal_before_accept_is_a_failure_of_that_peer_only(ftype):
    """A host that is no member of the pool answers the HELLO with a REJECT (or ERROR) that says the
    request itself is invalid. Nothing before ACCEPT carries a proof, so the decode side raises a plain
    TransferError (its caller prefills locally) and not RequestFailed (which would fail the client's
    request with the stranger's message). Before the fix it raised RequestFailed("forged"). In a pool
    without a secret nothing is authenticated and the old meaning stays."""
    async def main(secret):
        async def rogue(reader, writer):
            write_frame(writer, FrameType.CHALLENGE, {"nonce": handshake.new_nonce()})
            await writer.drain()
            await read_frame(reader, max_payload=1 << 20, max_json=handshake.PROOF_MAX_JSON)
            write_frame(writer, ftype, {"message": "forged", "field": "messages", "status": 400,
                                        "request_error": True})
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(rogue, "127.0.0.1", 0)
        try:
            with pytest.raises(TransferError) as e:
                await pull_kv("127.0.0.1", server.sockets[0].getsockname()[1], {"prompt_token_ids": [1, 2]},
                              lambda i, d: asyncio.sleep(0), max_payload=1 << 20, secret=secret, deadline=10)
            return e.value
        finally:
            server.close()
    err = asyncio.run(main(SECRET))
    assert not isinstance(err, RequestFailed) and "forged" in str(err)
    assert isinstance(asyncio.run(main(None)), RequestFailed)
