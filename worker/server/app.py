"""The worker's HTTP server (aiohttp): OpenAI routes, health, readiness, drain and metrics.

Roles: ``both`` prefills and decodes locally; ``decode`` does the same unless the router names a
prefill peer (header ``X-Tandem-Prefill-Peer``), in which case the prompt's KV is pulled from it;
``prefill`` also runs the KV transfer server that decode workers pull from.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from tandem.worker.api import auth
from tandem.worker.api.errors import InvalidRequestError, error_event
from tandem.worker.api.http import (DEFAULT_MAX_REQUEST_BYTES, LAST_EVENT_ID_HEADER, PREFILL_PEER_HEADER,
                                    STREAM_GRACE_HEADER, STREAM_ID_HEADER, STREAM_OWNER_HEADER, TTFT_HEADER,
                                    json_error, openai_app)
from tandem.worker.api.openai import max_prompt_chars, read_request_async
from tandem.worker.engine.async_engine import AsyncEngine, EngineDead
from tandem.worker.engine.sequence import SamplingParams
from tandem.worker.api.metrics import Metrics, TokenTimer
from tandem.worker.server.responses import ResponseBuilder
from tandem.worker.server.resumable import STREAM_ID, StreamRegistry
from tandem.worker.server.startup import worker_routes
from tandem.worker.api import peer_claim
from tandem.worker.transfer import remote_prefill
from tandem.worker.transfer.tcp import KVTransferServer

log = logging.getLogger(__name__)


class WorkerServer:
    """One worker process's HTTP face.

    Args:
        role: ``both`` | ``prefill`` | ``decode``.
        aengine: the started engine.
        pool: the InferencePool name (metric label).
        model_name: the OpenAI model name served.
        kv_server: the KV transfer server (prefill role), else None.
        transfer_deadline: seconds a remote prefill may take before decode prefills locally.
        max_request_bytes: the largest request body accepted (413 above it).
        api_keys: client API keys accepted (a worker run alone), or None.
        pool_secret: the pool's shared secret: the router's pool token is accepted, and the KV
            handshake proves it (both ways). None: no pool credential.
        startup: the process's :class:`tandem.worker.server.startup.StartupStatus` (shown at /health).
        own_url: this worker's URL as the router discovers it: a prefill worker with a pool secret
            vouches for it at /health (tandem.worker.api.peer_claim). None: no claim.
    """

    def __init__(self, role: str, aengine: AsyncEngine, pool: str, model_name: str,
                 kv_server: KVTransferServer | None = None, kv_port: int | None = None,
                 transfer_deadline: float = 120.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 api_keys: auth.KeyStore | None = None, pool_secret: bytes | None = None, startup=None,
                 own_url: str | None = None):
        self.role, self.aengine, self.model_name = role, aengine, model_name
        self.own_url = own_url
        self.startup = startup   # the StartupStatus of this process (phase timings), or None
        self.engine = aengine.engine
        self.max_request_bytes = max_request_bytes
        self.char_limit = max_prompt_chars(self.engine.tokenizer, self.engine.max_model_len)
        self.metrics = Metrics(role, pool, self.engine)
        self.kv_server, self.kv_port = kv_server, kv_port
        self.transfer_deadline = transfer_deadline
        self.draining = False
        self.in_flight = 0
        self.session: aiohttp.ClientSession | None = None
        self.peers: remote_prefill.PrefillPeers | None = None
        self.api_keys, self.pool_secret = api_keys, pool_secret
        self.streams = StreamRegistry()   # streams the router opted into resumption
        if kv_server is not None:
            kv_server.on_sent = self._on_sent
            kv_server.on_refused = lambda: self.metrics.auth_refused("kv")

    def _on_sent(self, nbytes: int, seconds: float) -> None:
        self.metrics.kv_transfer_bytes.labels(**self.metrics.labels, direction="sent").inc(nbytes)
        self.metrics.kv_transfer_seconds.observe(seconds)

    def app(self) -> web.Application:
        return worker_routes(auth.install(openai_app(self, self.max_request_bytes), self.api_keys,
                                          self.pool_secret, self.metrics.auth_refused), self)

    async def fault_engine(self, request: web.Request) -> web.Response:
        """Test hook: make the engine thread die as a broken model would (the process then exits)."""
        log.warning("fault injection: killing the engine thread")
        self.aengine.inject_fault()
        return web.json_response({"injected": "engine"})

    async def _startup(self, app) -> None:
        self.session = aiohttp.ClientSession()
        self.peers = remote_prefill.PrefillPeers(self.session, secret=self.pool_secret)

    async def _cleanup(self, app) -> None:
        await self.session.close()

    def _prefill_peer(self, request: web.Request) -> str | None:
        """The prefill peer the router named, if a member of the pool vouched for it (its claim,
        tandem.worker.api.peer_claim); else None (a local prefill), so no caller can make this
        worker connect to a host outside the pool. Without a pool secret nothing can be checked."""
        peer = request.headers.get(PREFILL_PEER_HEADER)
        if peer is None or self.pool_secret is None:
            return peer
        if peer_claim.verify_claim(self.pool_secret, peer, request.headers.get(peer_claim.CLAIM_HEADER)):
            return peer
        log.warning("prefill peer %r has no valid claim of this pool: prefilling locally", peer[:200])
        self.metrics.auth_refused("kv")
        return None

    # ---- status routes ----------------------------------------------------------------------
    def pending(self) -> int:
        """Requests, KV transfers and resumable streams still held (drain waits for 0): a stream that lost
        its reader is held for its grace, and a worker that exits then loses a stream a client is about
        to resume (the chaos soak's one avoidable failure: a router killed, then its decode worker
        drained and exited with the stream's events unread)."""
        return self.in_flight + (self.kv_server.active if self.kv_server else 0) + len(self.streams.streams)

    async def health(self, request: web.Request) -> web.Response:
        bm = self.engine.block_manager
        ok = self.aengine.error is None
        return web.json_response({
            "status": "ok" if ok else "engine_dead", "role": self.role, "model": self.model_name,
            "kv_port": self.kv_port, "num_blocks": bm.num_blocks, "free_blocks": bm.num_free_blocks,
            "kv_cache_usage": bm.usage(), "in_flight": self.pending(), "draining": self.draining,
            "num_requests": len(self.engine.seqs),
            # streams kept for a resume (their router connection broke), and those aborted unresumed
            "resumable_streams": len(self.streams.streams), "streams_expired": self.streams.expired,
            "block_size": self.engine.config.block_size, "max_model_len": self.engine.max_model_len,
            "kv_capacity_tokens": bm.num_blocks * self.engine.config.block_size,
            # the model's identity (content, resolved dtype, quantization): the router pairs only
            # workers that report the same one
            "model_fingerprint": self.engine.fingerprint.hex(), "dtype": self.engine.config.dtype,
            "startup": self.startup.as_dict() if self.startup is not None else None,
            **({"peer_claim": peer_claim.make_claim(self.pool_secret, self.own_url)}
               if self.kv_server is not None and self.pool_secret and self.own_url else {}),
        }, status=200 if ok else 500)

    async def ready(self, request: web.Request) -> web.Response:
        if self.draining or self.aengine.error is not None:
            return web.json_response({"ready": False, "draining": self.draining}, status=503)
        return web.json_response({"ready": True})

    async def drain(self, request: web.Request) -> web.Response:
        """Stop admitting work and turn not-ready; in-flight work finishes (``GET /drain`` shows it)."""
        self.start_drain()
        return await self.drain_status(request)

    def start_drain(self) -> None:
        if not self.draining:
            log.info("draining: %d in flight", self.pending())
        self.draining = True
        if self.kv_server:
            self.kv_server.accepting = False

    async def drain_status(self, request: web.Request) -> web.Response:
        n = self.pending()
        return web.json_response({"draining": self.draining, "in_flight": n,
                                  "drained": self.draining and n == 0})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem",
             # root: the model source (vLLM's field); `tandem bench serve` loads its tokenizer from it
             "root": getattr(getattr(self.engine, "config", None), "model", None),
             "max_model_len": self.engine.max_model_len}]})

    async def metrics_route(self, request: web.Request) -> web.Response:
        self.metrics.in_flight.set(self.pending())
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    # ---- OpenAI routes ----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        self.in_flight += 1   # from arrival: a drain must wait for a request still being read
        try:
            if self.draining:
                return json_error("worker is draining", 503)
            try:
                req, ids = await read_request_async(await request.read(), chat, self.model_name,
                                                    self.engine.tokenizer, self.char_limit)
                params = SamplingParams.parse(req.sampling(self.engine.max_model_len, len(ids)))
            except InvalidRequestError as e:
                return json_error(str(e), e.status, e.field)
            rid = self.aengine.new_request_id("chat" if chat else "cmpl")
            # only the router names prefill peers (a pool token, not a client's API key)
            peer = self._prefill_peer(request) \
                if self.role == "decode" and auth.from_pool(request, self.pool_secret) else None
            gen = remote_prefill.generate(self.aengine, rid, ids, params, peer, self.peers, self.metrics,
                                          deadline=self.transfer_deadline)
            resume = self._resume_opt_in(request) if req.stream else None
            # however this handler ends (finished, client gone, cancelled), the generator is closed here
            # and now, which aborts the request and frees its blocks; unless it was handed to a
            # resumable stream's producer task, which then owns it
            ended = False   # finished, or refused before it was admitted; anything else is an abort
            handed = False
            try:
                try:
                    first = await gen.__anext__()
                except InvalidRequestError as e:
                    ended = True
                    if chat and e.field == "prompt":   # a chat request has no prompt field: name messages
                        e = InvalidRequestError("messages", e.message)
                    return json_error(str(e), 400, e.field)
                except EngineDead as e:
                    return json_error(str(e), 500)
                builder = ResponseBuilder(chat, self.model_name, self.engine.tokenizer, len(ids))
                timer = TokenTimer(t0)

                def finish(last):
                    nonlocal ended
                    ended = True
                    self._finished(last, t0, timer, first)
                if resume is not None:
                    stream = self.streams.open(*resume)
                    stream.task = asyncio.create_task(
                        self._produce(stream, req, builder, first, gen, timer, finish))
                    handed = ended = True   # the producer owns the generator, and counts its own end
                    return await self._read(request, stream, -1)
                if req.stream:
                    return await self._stream(request, req, builder, first, gen, timer, finish)
                return await self._collect(builder, first, gen, timer, finish)
            finally:
                if not handed:
                    await gen.aclose()
                if not ended:
                    self._count("abort")
        finally:
            self.in_flight -= 1

    # ---- resumable streams (tandem.worker.server.resumable) ---------------------------------
    def _resume_opt_in(self, request: web.Request) -> tuple[str, str, float] | None:
        """``(stream id, owner, grace seconds)`` when the router opted this stream into resumption (a
        pool request with a well-formed id not in use and a grace > 0), else None: today's behaviour."""
        sid = request.headers.get(STREAM_ID_HEADER)
        if sid is None or not auth.from_pool(request, self.pool_secret) or not STREAM_ID.match(sid) \
                or sid in self.streams.streams:
            return None
        try:
            grace = float(request.headers.get(STREAM_GRACE_HEADER, "0"))
        except ValueError:
            return None
        if not grace > 0:
            return None
        return sid, request.headers.get(STREAM_OWNER_HEADER, "")[:128], grace

    async def _produce(self, stream, req, builder, first, gen, timer, finish) -> None:
        """Generate a resumable stream's events into its buffer, whoever reads them. Counts in
        ``in_flight`` (a drain waits for it); cancelled (the client left, or nobody resumed within the
        grace), it closes the generator: the request is aborted and its blocks freed."""
        done = False

        def fin(last):
            nonlocal done
            done = True
            finish(last)

        async def write(data: bytes) -> None:
            stream.append(data)
        self.in_flight += 1
        try:
            async with contextlib.aclosing(gen):
                await self._events(write, req, builder, first, gen, timer, fin)
        except EngineDead as e:
            stream.append(error_event(str(e)))
        finally:
            stream.close()
            if not done:
                self._count("abort")
            self.in_flight -= 1

    async def _read(self, request: web.Request, stream, after: int) -> web.StreamResponse:
        """One reader of a resumable stream: the events after index ``after``, then the live ones."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)     # raises too when the reader left before its headers went
            await self.streams.serve(stream, resp.write, after)
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            log.info("the reader of stream %s went away", stream.sid)
        return resp

    def _stream_of(self, request: web.Request):
        """The stream a pool request names (id and owner), or an error response."""
        refused = auth.pool_only(request, self.pool_secret, self.metrics.auth_refused, self.api_keys)
        if refused is not None:
            return refused
        sid = request.headers.get(STREAM_ID_HEADER, "")
        stream = self.streams.get(sid, request.headers.get(STREAM_OWNER_HEADER, "")) if STREAM_ID.match(sid) else None
        if stream is None:
            return json_error("no such stream here (finished, expired after its grace, or cancelled)", 404)
        return stream

    async def resume_stream(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/streams/resume`` (the pool only; headers ``X-Tandem-Stream-Id``, ``X-Tandem-Stream-Owner``
        and ``Last-Event-ID: <index>``): the stream's events after that index, then the live ones.
        404 when the stream is not here or has another owner; 400 for an index it never sent."""
        stream = self._stream_of(request)
        if isinstance(stream, web.Response):
            return stream
        try:
            after = int(request.headers.get(LAST_EVENT_ID_HEADER, ""))
            if not -1 <= after < len(stream.events):
                raise ValueError(after)
        except ValueError:
            return json_error(f"{LAST_EVENT_ID_HEADER} must be the index of an event this stream sent "
                              f"(0 to {len(stream.events) - 1})", 400, LAST_EVENT_ID_HEADER)
        return await self._read(request, stream, after)

    async def cancel_stream(self, request: web.Request) -> web.Response:
        """``POST /v1/streams/cancel`` (the pool only; the stream's id and owner headers): abort the stream
        now and free its blocks (the router's client went away)."""
        stream = self._stream_of(request)
        if isinstance(stream, web.Response):
            return stream
        self.streams.cancel(stream)
        return web.json_response({"cancelled": stream.sid})

    async def _collect(self, builder, first, gen, timer, finish):
        """The whole answer as one JSON body, or a 500 when the engine died on the way; ``finish(last
        output)`` runs once the answer is whole, before the client gets it."""
        samples, out = [], first
        try:
            async with contextlib.aclosing(_chain(first, gen)) as outs:
                async for out in outs:
                    if out.new_text:
                        timer.tick()
                    samples += out.logprobs
        except EngineDead as e:
            return json_error(str(e), 500)
        if out.finish_reason == "error":
            finish(out)
            return json_error(f"the request failed: {out.error}", 500)
        finish(out)
        resp = web.json_response(builder.full(out.text, out.finish_reason, out.num_output_tokens, samples))
        if timer.ttft is not None:
            resp.headers[TTFT_HEADER] = f"{timer.ttft:.6f}"
        return resp

    async def _stream(self, request, req, builder, first, gen, timer, finish):
        """The answer as server-sent events; ``finish(last output)`` runs before ``[DONE]`` is sent (so a
        client that reads the metrics after its stream finds its request counted), and not at all when
        the client left or the engine died mid-stream."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._events(resp.write, req, builder, first, gen, timer, finish)
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            log.info("client went away mid-stream")
            return resp
        except EngineDead as e:
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
                await resp.write(error_event(str(e)))
        return resp

    async def _events(self, write, req, builder, first, gen, timer, finish) -> None:
        """Write (``await write(bytes)``) a stream's SSE events, ``[DONE]`` last; raises EngineDead when
        the engine died mid-stream."""
        out = first
        if builder.chat:
            await write(builder.role_chunk())
        async with contextlib.aclosing(_chain(first, gen)) as outs:
            async for out in outs:
                if out.finish_reason == "error":
                    finish(out)
                    await write(error_event(f"the request failed: {out.error}"))
                    await write(builder.DONE)
                    return
                if out.new_text:
                    timer.tick()
                if out.new_text or out.finished or out.logprobs:
                    await write(builder.delta_chunk(out.new_text, out.finish_reason, out.logprobs))
        if req.include_usage:
            await write(builder.usage_chunk(out.num_output_tokens))
        finish(out)
        await write(builder.DONE)

    def _count(self, reason: str) -> None:
        self.metrics.requests.labels(**self.metrics.labels, finished_reason=reason).inc()

    def _finished(self, out, t0, timer, first) -> None:
        if out.finish_reason == "error":   # counted, but its latencies are not the pool's
            self._count("error")
            return
        self.metrics.observe_request(timer.ttft, time.monotonic() - t0, out.num_output_tokens, timer.itls)
        if first.queue_time is not None:
            self.metrics.queue_time.observe(first.queue_time)
            self.metrics.prefill_time.observe(first.prefill_time)
        self._count(out.finish_reason)


async def _chain(first, gen):
    """``first``, then the rest of ``gen`` (not closed here: the caller owns ``gen``)."""
    yield first
    async for out in gen:
        yield out
