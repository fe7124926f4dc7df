"""KV transfer over TCP with asyncio streams: the baseline transport.

The decode worker connects to the prefill worker's KV port and sends the prompt; the prefill worker
runs it through its engine and pushes each run of KV blocks as soon as the step that computed them
ends, so the transfer overlaps the rest of the prefill. Back-pressure is TCP's: the prefill side
awaits ``drain()`` after every frame and the decode side reads the next frame only after the last
one is written into its cache. Every wait has a deadline. On any failure the prefill side aborts its
request (freeing its blocks) and the decode side raises :class:`TransferError`, after which its
caller frees or reuses the reserved blocks (local prefill fallback).

Other transports (NCCL, NIXL, Mooncake-style RDMA) would provide the same two calls:
:meth:`KVTransferServer.start` on the prefill side and :func:`pull_kv` on the decode side.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable

from tandem.worker.engine.async_engine import AsyncEngine, EngineDead
from tandem.worker.engine.llm_engine import RequestOutput
from tandem.worker.api.errors import InvalidRequestError
from tandem.worker.transfer import handshake
from tandem.worker.transfer.protocol import (HEADER, FrameReceiver, FrameType, RequestFailed, TransferError,
                                             layout_mismatch, parse_header, parse_json, payload_to_tensor,
                                             tensor_to_payload, write_frame)
from tandem.worker.transfer.protocol import hello_limit as protocol_hello_limit

log = logging.getLogger(__name__)


class KVTransferServer:
    """The prefill worker's side: accepts transfers and streams KV blocks back.

    Nothing large is read before the peer authenticates: the HELLO's proof (at most
    ``handshake.PROOF_MAX_JSON`` bytes) is checked first, then its body is read only if it is within
    ``hello_limit`` bytes, and hashed against the proof before it is parsed. At most
    ``max_handshakes`` connections may be unauthenticated at once (more are closed at once), each for
    at most ``hello_timeout`` seconds; a connection counts in :attr:`active` (drain waits for it)
    only once its proof verified.

    Args:
        aengine: the prefill worker's engine.
        layout: this worker's KV layout (``LLMEngine.kv_layout()``).
        on_sent: ``fn(num_bytes, seconds)`` per finished transfer (metrics).
        hello_timeout: seconds from accepting a connection to its whole HELLO.
        frame_timeout: seconds one frame may take to leave (a decode worker that stops reading).
        secret: the pool secret; when set, a HELLO without its proof is refused before anything is
            allocated or computed (:mod:`tandem.worker.transfer.handshake`).
        on_refused: ``fn()`` per connection refused before authentication: a missing or wrong proof,
            a malformed or oversized HELLO, a handshake past its deadline, or over ``max_handshakes``
            (metrics).
        hello_limit: the most HELLO body bytes (``protocol.hello_limit``); default that of the
            engine's ``max_model_len`` and block size.
        max_handshakes: the most connections at once that have not yet authenticated.
    """

    def __init__(self, aengine: AsyncEngine, layout: dict, on_sent: Callable | None = None,
                 hello_timeout: float = 5.0, frame_timeout: float = 30.0, secret: bytes | None = None,
                 on_refused: Callable[[], None] | None = None, hello_limit: int | None = None,
                 max_handshakes: int = 64):
        self.aengine, self.layout, self.on_sent = aengine, layout, on_sent
        self.secret, self.on_refused = secret, on_refused
        self.hello_timeout, self.frame_timeout = hello_timeout, frame_timeout
        if hello_limit is None:
            e = aengine.engine
            hello_limit = protocol_hello_limit(e.max_model_len, e.config.block_size)
        self.hello_limit, self.max_handshakes = hello_limit, max_handshakes
        self.server: asyncio.AbstractServer | None = None
        self.active = 0          # authenticated transfers in flight (drain waits for them)
        self.handshaking = 0     # connections not yet authenticated
        self.accepting = True
        self._logged_at, self._unlogged = -1e9, 0
        self._handlers: dict[asyncio.Task, asyncio.StreamWriter] = {}   # open connections
        self._stopping = False

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (``port`` 0 picks a free one)."""
        self.server = await asyncio.start_server(self._handle, host, port)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop listening, end the connections still open (a handshake would wait up to ``hello_timeout``,
        a transfer for the engine), and wait for their handlers, at most ``timeout`` seconds (a hung
        engine thread must not hold a SIGTERM'd worker until SIGKILL; what is left is logged). On
        Python 3.11 ``wait_closed`` returns without waiting for connections, and a handler left pending
        when its loop closes is torn down half-run. Each is cancelled and its socket aborted as well:
        3.11's ``wait_for`` can lose a cancellation that meets a completed wait (gh-86296). A
        connection accepted meanwhile is aborted as its handler starts."""
        self._stopping = True
        if self.server:
            self.server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._handlers and loop.time() < deadline:
            for task, writer in list(self._handlers.items()):
                task.cancel()
                writer.transport.abort()
            await asyncio.wait(list(self._handlers), timeout=deadline - loop.time())
        if self._handlers:
            log.warning("KV server stopped with %d connection handlers still running", len(self._handlers))
        if self.server:
            await self.server.wait_closed()

    def _refuse(self, writer, why: str) -> None:
        """Count a refusal; log it, at most one line every 5 s (a flood must not become a log flood)."""
        if self.on_refused:
            self.on_refused()
        now = time.monotonic()
        if now - self._logged_at < 5.0:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more refused since the last line)" if self._unlogged else ""
        log.warning("KV connection from %s refused: %s%s", writer.get_extra_info("peername"), why, more)
        self._logged_at, self._unlogged = now, 0

    async def _read_hello(self, reader, nonce: str) -> tuple[dict | None, dict | None, str]:
        """``(proof, hello, why)``: the HELLO's verified proof and parsed body, or Nones and why not."""
        ftype, jlen, plen, _ = parse_header(await reader.readexactly(HEADER.size), self.hello_limit,
                                            handshake.PROOF_MAX_JSON)
        if ftype != FrameType.HELLO:
            return None, None, f"expected HELLO, got frame type {ftype}"
        proof = parse_json(await reader.readexactly(jlen))
        if not handshake.verify_proof(self.secret, nonce, proof, plen):
            return None, None, "no valid proof of this pool's secret"
        body = await reader.readexactly(plen)
        if not handshake.body_matches(proof, body):
            return None, None, "the HELLO body is not the one its proof names"
        return proof, parse_json(body), ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopping:
            writer.transport.abort()
            return
        task = asyncio.current_task()
        self._handlers[task] = writer
        try:
            await self._serve(reader, writer)
        finally:
            del self._handlers[task]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.handshaking >= self.max_handshakes:
            self._refuse(writer, f"{self.handshaking} connections already unauthenticated")
            writer.transport.abort()
            return
        self.handshaking += 1
        authenticated = False
        try:
            try:
                nonce = handshake.new_nonce()
                await self._send(writer, FrameType.CHALLENGE, {"nonce": nonce})
                proof, meta, why = await asyncio.wait_for(self._read_hello(reader, nonce), self.hello_timeout)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, TransferError) as e:
                self._refuse(writer, f"no valid HELLO: {e!r}")
                return
            finally:
                self.handshaking -= 1
            if meta is None:
                self._refuse(writer, why)
                await self._send(writer, FrameType.REJECT, {"message": "not authenticated for this pool"})
                return
            authenticated = True
            self.active += 1
            if meta.get("layout") != self.layout:
                msg = layout_mismatch(self.layout, meta.get("layout"))
                await self._send(writer, FrameType.REJECT, {"message": msg})
                return
            if not self.accepting:
                await self._send(writer, FrameType.REJECT, {"message": "prefill worker is draining"})
                return
            # The decode side sends nothing after HELLO: EOF means it left (client gone, deadline,
            # its own abort), and the prefill stops at once rather than at its next write.
            mac = handshake.FrameMac(self.secret, nonce, proof["nonce"]) if self.secret is not None else None
            transfer = asyncio.ensure_future(self._transfer(meta, writer, handshake.accept_proof(
                self.secret, nonce, proof["nonce"]), mac))
            peer_gone = asyncio.ensure_future(reader.read(1))
            try:
                await asyncio.wait({transfer, peer_gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                peer_gone.cancel()
                if not transfer.done():
                    transfer.cancel()
                    log.info("decode worker %s left during its KV transfer; prefill aborted",
                             writer.get_extra_info("peername"))
                await asyncio.gather(transfer, return_exceptions=True)
            if not transfer.cancelled():
                transfer.result()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, TransferError,
                EngineDead) as e:
            log.warning("KV transfer to %s failed: %r", writer.get_extra_info("peername"), e)
        finally:
            if authenticated:
                self.active -= 1
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, ftype: FrameType, meta: dict, payload=b"",
                    mac=None) -> None:
        write_frame(writer, ftype, meta, payload, mac)
        await asyncio.wait_for(writer.drain(), self.frame_timeout)

    async def _transfer(self, meta: dict, writer: asyncio.StreamWriter, proof: dict, mac) -> None:
        """Prefill the HELLO's prompt and stream its KV blocks, then DONE with the first token; the
        frames after ACCEPT are tagged by ``mac`` (None: a pool without a secret)."""
        sent, t0 = 0, time.monotonic()
        rid = self.aengine.new_request_id("prefill")
        post = self.aengine.post

        def kv_sink(seq, first_block, data, rid=rid):   # engine thread
            post(rid, (first_block, data))
        async with self.aengine.request(rid) as h:
            try:
                await h.add(self.aengine.engine.add_request, rid, prompt_token_ids=meta.get("prompt_token_ids"),
                            params=meta.get("params"), kv_sink=kv_sink, stop_after_first_token=True)
            except InvalidRequestError as e:
                await self._send(writer, FrameType.REJECT, {"message": e.message, "field": e.field,
                                                            "status": e.status, "request_error": True})
                return
            await self._send(writer, FrameType.ACCEPT, {"request_id": rid, **proof})
            async for item in h.outputs():
                if isinstance(item, RequestOutput) and item.finish_reason == "error":
                    await self._send(writer, FrameType.ERROR, {"message": item.error, "status": 500,
                                                               "request_error": True}, mac=mac)
                    return
                if isinstance(item, RequestOutput):
                    lp = item.logprobs[0] if item.logprobs else None
                    await self._send(writer, FrameType.DONE, {
                        "token_id": item.new_token_ids[0],
                        "logprob": lp.logprob if lp else None,
                        "top_logprobs": lp.top_logprobs if lp else None,
                        "num_cached_tokens": item.num_cached_tokens}, mac=mac)
                else:
                    first_block, data = item
                    tmeta, payload = tensor_to_payload(data)
                    await self._send(writer, FrameType.BLOCKS, {"first_block": first_block, **tmeta}, payload,
                                     mac=mac)
                    sent += len(payload)
        if self.on_sent:
            self.on_sent(sent, time.monotonic() - t0)


async def pull_kv(host: str, port: int, hello: dict,
                  on_blocks: Callable[[int, object], Awaitable[None]],
                  connect_timeout: float = 5.0, frame_timeout: float = 30.0,
                  deadline: float = 300.0, max_payload: int = 0,
                  secret: bytes | None = None) -> tuple[dict, int]:
    """The decode worker's side of one transfer.

    Args:
        host, port: the prefill worker's KV address.
        hello: ``{layout, prompt_token_ids, params}``.
        on_blocks: ``await on_blocks(first_block_index, tensor)`` for each received run of blocks
            (``[layers, 2, n, block_size, Hk, D]``).
        connect_timeout, frame_timeout, deadline: seconds for connecting, between two frames, and
            for the whole transfer.
        max_payload: the most bytes one frame may carry: the reserved blocks' size. The length comes
            from the peer, so a larger one is refused before any buffer is allocated.
        secret: the pool secret: the HELLO proves it, and the prefill worker must prove it in its
            ACCEPT before any block is taken.

    Returns:
        ``(done_meta, bytes_received)``: the DONE frame's metadata (first token and its logprobs).

    Raises:
        RequestFailed: the request itself failed on the peer (an ERROR after the authenticated ACCEPT,
            or, in a pool without a secret, a REJECT naming the request).
        TransferError: refused, connection lost, malformed frame, or a deadline passed.
    """
    t_end = time.monotonic() + deadline
    received = 0
    loop = asyncio.get_running_loop()
    try:
        transport, proto = await asyncio.wait_for(
            loop.create_connection(lambda: FrameReceiver(max_payload), host, port), connect_timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise TransferError(f"cannot connect to prefill worker {host}:{port}: {e!r}") from None
    try:
        ftype, meta, _ = await asyncio.wait_for(proto.next_frame(), min(frame_timeout, deadline))
        if ftype != FrameType.CHALLENGE or not isinstance(meta.get("nonce"), str):
            raise TransferError(f"prefill worker {host}:{port} sent {ftype.name}, not a CHALLENGE")
        nonce = meta["nonce"]
        body = json.dumps(hello, separators=(",", ":")).encode()
        proof = handshake.hello_proof(secret, nonce, body)
        write_frame(transport, FrameType.HELLO, proof, body)
        accepted = False
        while True:
            left = t_end - time.monotonic()
            if left <= 0:
                raise TransferError(f"KV transfer from {host}:{port} passed its {deadline:.0f} s deadline")
            ftype, meta, payload = await asyncio.wait_for(proto.next_frame(), min(frame_timeout, left))
            if ftype in (FrameType.BLOCKS, FrameType.DONE) and not accepted:
                raise TransferError(f"prefill worker {host}:{port} sent {ftype.name} before ACCEPT")
            if ftype == FrameType.ACCEPT:
                if accepted or not handshake.verify_accept(secret, nonce, proof["nonce"], meta):
                    raise TransferError(f"prefill worker {host}:{port} did not prove this pool's secret")
                accepted = True
                if secret is not None:   # every later frame must carry this connection's tag
                    proto.mac = handshake.FrameMac(secret, nonce, proof["nonce"])
            elif ftype == FrameType.BLOCKS:
                received += len(payload)
                # the payload buffer is reused for the next frame: on_blocks copies it into the cache
                await on_blocks(meta["first_block"], payload_to_tensor(meta, payload))
            elif ftype == FrameType.DONE:
                return meta, received
            elif ftype in (FrameType.REJECT, FrameType.ERROR):
                # before ACCEPT nothing the peer sent is authenticated (its proof comes with ACCEPT):
                # a refusal then is a failure of this peer only (a local prefill), never a verdict
                # on the request that could fail it
                if meta.get("request_error") is True and (accepted or secret is None):
                    raise RequestFailed(str(meta.get("message")), meta.get("field"),
                                        400 if meta.get("status") == 400 else 500)
                raise TransferError(f"prefill worker {host}:{port} refused: {meta.get('message')}")
            else:
                raise TransferError(f"unexpected {ftype.name} frame")
    except (OSError, asyncio.TimeoutError) as e:
        if isinstance(e, asyncio.TimeoutError) and time.monotonic() >= t_end:
            raise TransferError(f"KV transfer from {host}:{port} passed its {deadline:.0f} s deadline") from None
        raise TransferError(f"KV transfer from {host}:{port} broke: {e!r}") from None
    finally:
        transport.close()
