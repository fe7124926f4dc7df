"""The router: the pool's OpenAI endpoint.

It tokenizes each prompt, hashes its blocks, picks a decode worker and (maybe) a prefill worker
(:mod:`tandem.worker.router.policy`), and forwards the request to the decode worker with the prefill
peer named in a header. It measures TTFT, TPOT and ITL as the client sees them (role="router"),
retries another decode worker when one cannot be reached, and polls the workers' health so a
draining or dead worker drops out of routing.
"""
from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
import logging
import time

import aiohttp
from aiohttp import web

from tandem.worker.engine.block_hash import block_hashes, fingerprint
from tandem.worker.engine.sequence import InvalidRequestError
from tandem.worker.router.policy import WorkerState, decide
from tandem.worker.server.app import PREFILL_PEER_HEADER, TTFT_HEADER, json_error, openai_app
from tandem.worker.server.metrics import Metrics, TokenTimer
from tandem.worker.server.openai import read_request

log = logging.getLogger(__name__)

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


class Router:
    """Routes OpenAI requests over one pool's workers.

    Args:
        pool: InferencePool name (metric label).
        model_name: the OpenAI model name.
        model_source: the engine's model source string (part of the block-hash fingerprint, which must
            match the workers').
        dtype, quantization: the engine's, for the same reason.
        tokenizer: the model's tokenizer.
        block_size: the engine's KV block size.
        discovery: where the workers are (``prefill_urls()``, ``decode_urls()``).
        remote_prefill_min_tokens, routing: the spec's router section.
        health_interval: seconds between worker health polls.
        queue_timeout: seconds a request waits for a ready decode worker before a 503.
    """

    def __init__(self, pool: str, model_name: str, model_source: str, dtype: str, quantization: str,
                 tokenizer, block_size: int, discovery, remote_prefill_min_tokens: int = 256,
                 routing: str = "prefix-affinity", health_interval: float = 1.0, queue_timeout: float = 30.0):
        self.model_name, self.tok, self.block_size = model_name, tokenizer, block_size
        self.fingerprint = fingerprint(model=model_source, dtype=dtype, quantization=quantization)
        self.discovery = discovery
        self.remote_min, self.routing = remote_prefill_min_tokens, routing
        self.health_interval, self.queue_timeout = health_interval, queue_timeout
        self.metrics = Metrics("router", pool)
        self.workers: dict[str, WorkerState] = {}
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        self._rr = 0
        self.in_flight = 0
        self.queued = 0

    def app(self) -> web.Application:
        return openai_app(self)

    async def _startup(self, app) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=3))
        await self.discovery.start()
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def _cleanup(self, app) -> None:
        if self._poller:
            self._poller.cancel()
        await self.discovery.stop()
        await self.session.close()

    # ---- worker state -----------------------------------------------------------------------
    def _states(self, urls: list[str]) -> list[WorkerState]:
        return [self.workers.setdefault(u, WorkerState(u)) for u in urls]

    async def _poll(self, w: WorkerState) -> None:
        try:
            async with self.session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                info = await r.json()
            w.free_blocks, w.num_blocks = info.get("free_blocks", 0), info.get("num_blocks", 0)
            w.ready = r.status == 200 and not info.get("draining", False)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            w.ready = False

    async def poll_once(self) -> None:
        urls = set(self.discovery.prefill_urls()) | set(self.discovery.decode_urls())
        for gone in set(self.workers) - urls:
            del self.workers[gone]
        await asyncio.gather(*(self._poll(w) for w in self._states(sorted(urls))))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.poll_once()
            except Exception:  # keep polling whatever one round hit
                log.exception("health poll failed")

    # ---- routes -----------------------------------------------------------------------------
    async def health(self, request):
        return web.json_response({"status": "ok", "role": "router", "workers": {
            u: {"ready": w.ready, "in_flight": w.in_flight, "free_blocks": w.free_blocks}
            for u, w in self.workers.items()}})

    async def ready(self, request):
        ok = any(w.ready for w in self._states(self.discovery.decode_urls()))
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem"}]})

    async def metrics_route(self, request):
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.router_queued.set(self.queued)
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def completions(self, request):
        return await self._route(request, "/v1/completions", chat=False)

    async def chat_completions(self, request):
        return await self._route(request, "/v1/chat/completions", chat=True)

    async def _wait_for_decode(self, decide_fn):
        """Decide now, or hold the request (``tandem:router_queued_requests``) until a decode worker is
        ready or ``queue_timeout`` passes."""
        decision = decide_fn()
        if decision is not None:
            return decision
        self.queued += 1
        try:
            t_end = time.monotonic() + self.queue_timeout
            while decision is None and time.monotonic() < t_end:
                await asyncio.sleep(min(0.5, self.health_interval))
                await self.poll_once()
                decision = decide_fn()
            return decision
        finally:
            self.queued -= 1

    async def _route(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        raw = await request.read()
        try:
            req, ids = read_request(raw, chat, self.model_name, self.tok)
        except InvalidRequestError as e:
            return json_error(str(e), getattr(e, "status", 400), e.field)
        hashes = block_hashes(ids, self.block_size, self.fingerprint)
        tried: set[str] = set()   # decode workers that failed this request

        def decide_fn():
            return decide(self._states(self.discovery.decode_urls()), self._states(self.discovery.prefill_urls()),
                          len(ids), hashes, self.remote_min, self.routing, tried, self._rr)
        self.in_flight += 1
        try:
            while True:
                d = await self._wait_for_decode(decide_fn)
                if d is None:
                    return json_error("no ready decode worker", 503)
                self._rr += 1
                headers = {"Content-Type": "application/json"}
                if d.prefill is not None:
                    headers[PREFILL_PEER_HEADER] = d.prefill.url
                with _load(d):
                    t_send = time.monotonic()
                    try:
                        upstream = await self.session.post(d.decode.url + path, data=raw, headers=headers)
                    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                        log.warning("decode worker %s unreachable (%r); trying another", d.decode.url, e)
                        d.decode.ready = False
                        tried.add(d.decode.url)
                        continue
                    if upstream.status == 503 and len(tried) < len(self.discovery.decode_urls()) - 1:
                        upstream.release()              # draining: try another decode worker
                        d.decode.ready = False
                        tried.add(d.decode.url)
                        continue
                    self.metrics.routing.labels(**self.metrics.labels, decision=d.reason).inc()
                    if upstream.status == 200:
                        d.decode.remember(hashes)
                        if d.prefill:
                            d.prefill.remember(hashes)
                    if req.stream and upstream.status == 200:
                        return await self._relay_stream(request, upstream, t0)
                    return await self._relay_full(upstream, t0, t_send)
        finally:
            self.in_flight -= 1

    async def _relay_full(self, upstream: aiohttp.ClientResponse, t0: float, t_send: float) -> web.Response:
        async with upstream:
            body = await upstream.read()
            resp = web.Response(body=body, status=upstream.status,
                                content_type=upstream.content_type or "application/json")
            if upstream.status == 200:
                try:
                    usage = json.loads(body).get("usage", {})
                    worker_ttft = float(upstream.headers.get(TTFT_HEADER, "nan"))
                except (ValueError, AttributeError):
                    return resp
                e2e = time.monotonic() - t0
                # the client waited for the router's own work too, before the worker saw the request
                ttft = min(e2e, (t_send - t0) + worker_ttft)
                self.metrics.observe_request(ttft if ttft == ttft else None, e2e,
                                             int(usage.get("completion_tokens", 0)))
            return resp

    async def _relay_stream(self, request, upstream: aiohttp.ClientResponse, t0: float) -> web.StreamResponse:
        resp = web.StreamResponse(status=upstream.status, headers={
            k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
        await resp.prepare(request)
        timer, buf = TokenTimer(t0), b""
        async with upstream:
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                    buf += chunk
                    *events, buf = buf.split(b"\n\n")
                    for ev in events:
                        if _has_token_text(ev):
                            timer.tick()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                log.info("client went away mid-stream")   # leaving closes upstream; the worker aborts
                return resp
            except aiohttp.ClientPayloadError as e:
                log.warning("decode worker broke the stream: %r", e)
                return resp
        self.metrics.observe_request(timer.ttft, time.monotonic() - t0, timer.tokens, timer.itls)
        await resp.write_eof()
        return resp


@contextmanager
def _load(d):
    """Count a request against the workers a decision names, for as long as it is in flight."""
    workers = [w for w in (d.decode, d.prefill) if w is not None]
    for w in workers:
        w.in_flight += 1
    try:
        yield
    finally:
        for w in workers:
            w.in_flight -= 1


def _has_token_text(event: bytes) -> bool:
    """Does one SSE event carry token text (not the role-only first chunk, not [DONE], not usage)?"""
    if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
        return False
    try:
        choices = json.loads(event[6:]).get("choices") or []
    except ValueError:
        return False
    for c in choices:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False
