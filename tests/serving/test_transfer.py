"""KV transfer between two real engines over real TCP sockets on loopback (tiny random Llama, in one
process): the decoded output equals a local run, the decode worker computes no prompt token, and every
failure path frees every block on both sides."""
import asyncio
import json
import time

import pytest

from tandem.worker.engine.async_engine import AsyncEngine
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import LLMEngine
from tandem.worker.engine.sequence import SamplingParams
from tandem.worker.transfer import handshake, remote_prefill
from tandem.worker.transfer.protocol import HEADER, MAGIC, FrameType, TransferError, read_frame, write_frame
from tandem.worker.transfer.tcp import KVTransferServer, pull_kv

PARAMS = SamplingParams.parse({"temperature": 0, "max_tokens": 10, "ignore_eos": True})


class FixedPeers:
    """Stands in for the HTTP /health lookup of the prefill worker's KV port (named as such: the
    transfer itself is real); the full HTTP path is covered by tests/serving/test_fleet.py."""
    secret = None   # a pool without a shared secret

    def __init__(self, port):
        self.port = port

    async def kv_address(self, url):
        if self.port is None:
            raise TransferError("no such peer")
        return "127.0.0.1", self.port

    def forget(self, url):
        pass


def write_hello(writer, hello: dict) -> None:
    """A HELLO as the decode side sends it to a worker without a pool secret (the proof part then
    only names the body's size and hash)."""
    body = json.dumps(hello).encode()
    write_frame(writer, FrameType.HELLO, handshake.hello_proof(None, "", body), body)


def engines(path, **kw):
    cfg = dict(model=str(path), block_size=4, max_num_batched_tokens=16)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))


async def collect(gen):
    toks = []
    async for out in gen:
        toks += out.new_token_ids
    return toks


def test_remote_prefill_equals_local_and_decode_computes_no_prompt(tiny_llama):
    async def main():
        pe, de = engines(tiny_llama)
        local = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4))
        prompt = pe.tokenize("Paged attention keeps the KV cache in fixed-size blocks. Prefill computes")
        want = local.generate([prompt], PARAMS)[0].new_token_ids
        pa, da = AsyncEngine(pe), AsyncEngine(de)
        pa.start(), da.start()
        server = KVTransferServer(pa, pe.kv_layout())
        sent = []
        server.on_sent = lambda n, s: sent.append(n)
        port = await server.start("127.0.0.1", 0)
        got = await collect(remote_prefill.generate(da, "r1", prompt, PARAMS, "http://peer", FixedPeers(port)))
        assert got == want
        assert de.stats.prompt_tokens_computed == 0
        assert pe.stats.prompt_tokens_computed == len(prompt)
        assert sent and sent[0] > 0
        await asyncio.sleep(0.1)
        assert pe.block_manager.num_used == 0 and de.block_manager.num_used == 0
        # the prompt's blocks are now cached on both sides
        assert de.block_manager.cached_free and pe.block_manager.cached_free
        await server.stop()
        pa.stop(), da.stop()
    asyncio.run(main())


def test_layout_mismatch_is_refused_with_a_clear_error(tiny_llama):
    async def main():
        pe = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4))
        pa = AsyncEngine(pe)
        pa.start()
        server = KVTransferServer(pa, pe.kv_layout())
        port = await server.start("127.0.0.1", 0)
        layout = {**pe.kv_layout(), "block_size": 8}
        with pytest.raises(TransferError, match="KV layout mismatch.*block_size"):
            await pull_kv("127.0.0.1", port, {"layout": layout, "prompt_token_ids": [1, 2, 3]},
                          lambda i, d: asyncio.sleep(0))
        assert pe.block_manager.num_used == 0
        await server.stop()
        pa.stop()
    asyncio.run(main())


def test_dead_peer_falls_back_to_local_prefill(tiny_llama):
    async def main():
        _, de = engines(tiny_llama)
        da = AsyncEngine(de)
        da.start()
        prompt = de.tokenize("The quick brown fox jumps over the lazy dog")
        want = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4)).generate([prompt], PARAMS)[0]
        # a port nobody listens on
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        got = await collect(remote_prefill.generate(da, "r", prompt, PARAMS, "http://dead", FixedPeers(port)))
        assert got == want.new_token_ids
        assert de.stats.local_prefill_fallbacks == 1
        assert de.block_manager.num_used == 0
        de.block_manager.check_invariant()
        da.stop()
    asyncio.run(main())


def test_transfer_broken_mid_stream_frees_blocks_on_both_sides(tiny_llama):
    """A relay between decode and prefill cuts the connection after the first BLOCKS frame."""
    async def main():
        pe, de = engines(tiny_llama)
        pa, da = AsyncEngine(pe), AsyncEngine(de)
        pa.start(), da.start()
        server = KVTransferServer(pa, pe.kv_layout())
        port = await server.start("127.0.0.1", 0)

        async def relay(reader, writer):
            up_r, up_w = await asyncio.open_connection("127.0.0.1", port)

            async def pipe(r, w, limit):
                n = 0
                while data := await r.read(65536):
                    if limit and n + len(data) >= limit:   # forward exactly `limit` bytes, then cut
                        w.write(data[:limit - n])
                        break
                    w.write(data)
                    n += len(data)
                w.close()
                writer.close()
                up_w.close()
            # the whole KV of this prompt is ~14 KB: cut inside it
            await asyncio.gather(pipe(reader, up_w, 0), pipe(up_r, writer, 4000), return_exceptions=True)
        relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
        relay_port = relay_server.sockets[0].getsockname()[1]
        prompt = pe.tokenize("Paris is the capital of France; Berlin is the capital of Germany. " * 3)
        want = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4)).generate([prompt], PARAMS)[0]
        got = await collect(remote_prefill.generate(da, "r", prompt, PARAMS, "http://relay",
                                                    FixedPeers(relay_port)))
        assert got == want.new_token_ids
        assert de.stats.local_prefill_fallbacks == 1
        for _ in range(50):
            if pe.block_manager.num_used == 0 and not pe.seqs:
                break
            await asyncio.sleep(0.1)
        assert pe.block_manager.num_used == 0 and de.block_manager.num_used == 0
        pe.block_manager.check_invariant(), de.block_manager.check_invariant()
        relay_server.close()
        await server.stop()
        pa.stop(), da.stop()
    asyncio.run(main())


def test_transfer_frame_timeout(tiny_llama):
    async def main():
        async def silent(reader, writer):   # accepts, then never answers
            await asyncio.sleep(5)
            writer.close()
        srv = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        with pytest.raises(TransferError, match="broke"):
            await pull_kv("127.0.0.1", port, {"layout": {}, "prompt_token_ids": [1]},
                          lambda i, d: asyncio.sleep(0), frame_timeout=0.5)
        srv.close()
    asyncio.run(main())


def test_transfer_deadline_holds_against_a_peer_that_trickles_frames():
    """A test double of a prefill worker sends an (empty) BLOCKS frame every 0.1 s, each well inside
    the frame timeout, forever: only the whole-transfer deadline can end it."""
    async def main():
        async def trickle(reader, writer):
            write_frame(writer, FrameType.CHALLENGE, {"nonce": "0" * 32})
            await read_frame(reader, max_payload=1 << 20)
            write_frame(writer, FrameType.ACCEPT, {})
            while True:
                write_frame(writer, FrameType.BLOCKS, {"first_block": 0, "shape": [0], "dtype": "torch.float32"})
                await writer.drain()
                await asyncio.sleep(0.1)
        srv = await asyncio.start_server(trickle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="deadline"):
            await pull_kv("127.0.0.1", port, {"layout": {}, "prompt_token_ids": [1]},
                          lambda i, d: asyncio.sleep(0), frame_timeout=1.0, deadline=1.0)
        assert time.monotonic() - t0 < 2.5
        srv.close()
    asyncio.run(main())


def test_frame_lengths_from_the_peer_are_bounded_before_allocation():
    """A test double of a prefill worker announces a 1 TiB payload: the decode side refuses the frame
    by its header, without allocating, and says why."""
    async def main():
        async def liar(reader, writer):
            write_frame(writer, FrameType.CHALLENGE, {"nonce": "0" * 32})
            await read_frame(reader, max_payload=1 << 20)
            writer.write(HEADER.pack(MAGIC, int(FrameType.BLOCKS), 2, 2**40, bytes(32)) + b"{}")
            await writer.drain()
            await asyncio.sleep(5)
        srv = await asyncio.start_server(liar, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        with pytest.raises(TransferError, match="frame too large"):
            await pull_kv("127.0.0.1", port, {"layout": {}, "prompt_token_ids": [1]},
                          lambda i, d: asyncio.sleep(0), frame_timeout=3, max_payload=1 << 20)
        srv.close()
    asyncio.run(main())


def test_kv_server_frees_everything_when_add_request_fails_unexpectedly(tiny_llama):
    """A HELLO whose prompt makes the engine raise something other than InvalidRequestError (a nested
    list: TypeError) must leave no request queue and no sequence behind."""
    async def main():
        pe, _ = engines(tiny_llama)
        pa = AsyncEngine(pe)
        pa.start()
        server = KVTransferServer(pa, pe.kv_layout())
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        write_hello(writer, {"layout": pe.kv_layout(), "prompt_token_ids": [[1], [2]], "params": {"max_tokens": 1}})
        await writer.drain()
        assert (await read_frame(reader, max_payload=0))[0] == FrameType.CHALLENGE
        assert await asyncio.wait_for(reader.read(), 10) == b""   # closed without an answer
        for _ in range(50):
            if server.active == 0:
                break
            await asyncio.sleep(0.05)
        assert server.active == 0 and pa.queues == {} and pe.seqs == {}
        writer.close()
        await server.stop()
        pa.stop()
    asyncio.run(main())


def test_decode_leaving_mid_prefill_aborts_the_prefill_at_once(tiny_llama):
    """The decode side connects, says HELLO, and leaves while the prefill worker is busy: the prefill
    worker aborts at once (it watches for EOF), not at its next write."""
    async def main():
        pe, _ = engines(tiny_llama, max_num_batched_tokens=4)   # many chunks: a long prefill
        pa = AsyncEngine(pe)
        pa.start()
        server = KVTransferServer(pa, pe.kv_layout())
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        write_hello(writer, {"layout": pe.kv_layout(), "prompt_token_ids": [i % 300 + 1 for i in range(480)],
                             "params": {"max_tokens": 1}})
        await writer.drain()
        assert (await read_frame(reader, max_payload=0))[0] == FrameType.CHALLENGE
        assert (await read_frame(reader, max_payload=0))[0] == FrameType.ACCEPT
        writer.close()
        for _ in range(100):
            if not pe.seqs and server.active == 0:
                break
            await asyncio.sleep(0.05)
        assert pe.seqs == {} and pe.block_manager.num_used == 0 and pa.queues == {}
        assert pe.stats.aborts.get("running", 0) + pe.stats.aborts.get("queued", 0) == 1
        pe.block_manager.check_invariant()
        await server.stop()
        pa.stop()
    asyncio.run(main())
