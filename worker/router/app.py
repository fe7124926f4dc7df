"""The router: the pool's OpenAI endpoint.

It tokenizes each prompt, hashes its blocks, picks a decode worker and (maybe) a prefill worker
(:mod:`tandem.worker.router.policy`), and forwards the request to the decode worker with the prefill
peer named in a header. It measures TTFT, TPOT and ITL as the client sees them (role="router"),
retries another decode worker when one cannot be reached, and polls the workers' health so a
draining or dead worker drops out of routing.

Faults (docs/serving.md, "Faults"): a request that has not had its first token when its decode or
prefill worker dies or stops answering (``HUNG_POLLS`` health polls in a row without an answer: a
stopped process) is sent again to another worker; a stream that has begun and whose decode worker's
connection breaks, or that gets nothing for ``stream_idle_timeout`` seconds, ends with an SSE error
event in OpenAI's format, counted in ``tandem:router_stream_errors_total`` by reason.

Stream resumption (docs/serving.md, "Stream resumption"): with ``stream_resume_grace`` > 0 (the spec's
``router.streamResumeGraceSeconds``) every streamed request is opted in at its decode worker
(tandem.worker.server.resumable), so every event relayed carries ``id: <stream id>:<index>``. A client
whose connection to a router broke (the router was killed) sends the same request again, to any router
of the pool, with ``Last-Event-ID: <the last id it got>`` (the HTML standard's SSE reconnection), and
gets the rest of the stream. The stream id names the decode worker only by a key (a digest of its URL)
that the router matches against the workers it discovered itself; the request passes the same auth as
any other, and the worker gives the stream only to the client credential that opened it. A router
whose client went away cancels the stream at its worker at once (its blocks are freed).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid

import aiohttp
from aiohttp import web

from tandem.worker.api import auth
from tandem.worker.api.block_hash import block_hashes
from tandem.worker.api.errors import InvalidRequestError, error_event
from tandem.worker.api.peer_claim import CLAIM_HEADER
from tandem.worker.api.http import (DEFAULT_MAX_REQUEST_BYTES, LAST_EVENT_ID_HEADER, PREFILL_PEER_HEADER,
                                    STREAM_GRACE_HEADER, STREAM_ID, STREAM_ID_HEADER, STREAM_OWNER_HEADER,
                                    TTFT_HEADER, json_error, openai_app, worker_key)
from tandem.worker.api.openai import max_prompt_chars, read_request_async
from tandem.worker.router.policy import WorkerState, decide, pick_decode
from tandem.worker.api.metrics import Metrics, TokenTimer

log = logging.getLogger(__name__)

#: health polls in a row without an answer after which a worker counts as hung: a request waiting for
#: its first token there is sent elsewhere (a poll times out after 2 s, so about 2-6 s after the stop)
HUNG_POLLS = 2
#: response headers naming the workers that served a request, for the pool's own tools (the chaos
#: soak, worker/bench/chaos.py): sent only to a caller with the pool token, or by an open pool
DECODE_WORKER_HEADER = "X-Tandem-Decode-Worker"
PREFILL_WORKER_HEADER = "X-Tandem-Prefill-Worker"

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


class Router:
    """Routes OpenAI requests over one pool's workers.

    Args:
        pool: InferencePool name (metric label).
        model_name: the OpenAI model name.
        model_source, dtype, quantization: the spec's (the model's fingerprint, which block hashes mix
            in, comes from the workers' ``/health``: the router loads no weights).
        tokenizer: the model's tokenizer.
        block_size: the engine's KV block size.
        discovery: where the workers are (``prefill_urls()``, ``decode_urls()``).
        remote_prefill_min_tokens, routing: the spec's router section.
        health_interval: seconds between worker health polls.
        queue_timeout: seconds a request of a scale-to-zero pool waits for a ready decode worker
            before a 503 (spec.router.queueTimeoutSeconds).
        unavailable_timeout: seconds a request of any other pool waits for a ready decode worker
            (a restart) before a 503 with Retry-After (spec.router.unavailableTimeoutSeconds).
        ready_without_workers: report ready while no decode worker is (a scale-to-zero pool: the
            router must take the first request, hold it and so wake the pool).
        max_model_len: the pool's context length in tokens, when the spec sets it: longer prompts are
            refused by their length in characters before tokenizing (the workers check tokens).
        max_request_bytes: the largest request body accepted (413 above it).
        stream_idle_timeout: seconds a begun stream may go without a byte from its decode worker before
            the router ends it with an error event (longer than a worker's 20 s stop in the chaos soak,
            which such streams then survive).
        stream_resume_grace: seconds a decode worker keeps a stream whose router connection broke, for the
            client to resume through any router (``Last-Event-ID``); 0: streams are not resumable.
        api_keys: the client API keys accepted (``Authorization: Bearer``), or None: open.
        pool_secret: the pool's shared secret, proved to the workers (``X-Tandem-Pool-Token``).
    """

    def __init__(self, pool: str, model_name: str, model_source: str, dtype: str, quantization: str,
                 tokenizer, block_size: int, discovery, remote_prefill_min_tokens: int = 256,
                 routing: str = "prefix-affinity", health_interval: float = 1.0, queue_timeout: float = 300.0,
                 max_model_len: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 api_keys: auth.KeyStore | None = None, pool_secret: bytes | None = None,
                 ready_without_workers: bool = False, unavailable_timeout: float = 5.0,
                 stream_idle_timeout: float = 60.0, stream_resume_grace: float = 0.0):
        self.model_name, self.tok, self.block_size = model_name, tokenizer, block_size
        self.char_limit = max_prompt_chars(tokenizer, max_model_len) if max_model_len else None
        self.max_request_bytes = max_request_bytes
        self.model_source = model_source
        self._refusals: set[tuple[str, str, str, str]] = set()   # (decode, its fp, prefill, its fp) logged
        self.discovery = discovery
        self.remote_min, self.routing = remote_prefill_min_tokens, routing
        self.health_interval, self.queue_timeout = health_interval, queue_timeout
        self.unavailable_timeout = unavailable_timeout
        self.max_model_len = max_model_len
        self.ready_without_workers = ready_without_workers
        self.stream_idle_timeout = stream_idle_timeout
        self.stream_resume_grace = stream_resume_grace
        self._cancels: set[asyncio.Task] = set()   # stream cancels sent after a client left
        self.metrics = Metrics("router", pool)
        self.api_keys = api_keys
        self.pool_secret = pool_secret
        self.absorb_until = 0.0                    # monotonic time until which bursts prefill on decode
        self.workers: dict[str, WorkerState] = {}
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        self._rr = 0
        self.in_flight = 0
        self.queued = 0

    def app(self) -> web.Application:
        app = auth.install(openai_app(self, self.max_request_bytes), self.api_keys, None,
                           self.metrics.auth_refused)
        app.router.add_post("/absorb-bursts", self.absorb_bursts)
        return app

    async def absorb_bursts(self, request: web.Request) -> web.Response:
        """``POST /absorb-bursts {"seconds": s}`` (the pool token only): prefill on decode workers with
        headroom for the next ``s`` seconds (0 stops), as the autoscaler's decision asks while new
        prefill replicas start (operator/autoscaler/kube_loop.py; the local fleet uses its discovery
        file instead). Bounded to an hour; it lapses by itself, so a dead operator leaves nothing on."""
        refused = auth.pool_only(request, self.pool_secret, self.metrics.auth_refused, self.api_keys)
        if refused is not None:
            return refused
        try:
            seconds = float((await request.json()).get("seconds", 0))
            if not 0 <= seconds <= 3600:
                raise ValueError(seconds)
        except (ValueError, TypeError, AttributeError, json.JSONDecodeError):
            return json_error('body must be {"seconds": a number from 0 to 3600}', 400, "seconds")
        self.absorb_until = time.monotonic() + seconds
        return web.json_response({"absorbBursts": seconds > 0, "seconds": seconds})

    def _absorbing(self) -> bool:
        return time.monotonic() < self.absorb_until or getattr(self.discovery, "absorb_bursts", lambda: False)()

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
        # a worker new to discovery is ready once a health poll says so: taken as ready at once, a
        # prefill worker restarted on its old address looked like a ready worker of another model (no
        # fingerprint yet) and its prompts were counted as model mismatches
        return [self.workers.setdefault(u, WorkerState(u, ready=False)) for u in urls]

    async def _poll(self, w: WorkerState) -> None:
        try:
            async with self.session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                info = await r.json()
            w.free_blocks, w.num_blocks = info.get("free_blocks", 0), info.get("num_blocks", 0)
            w.fingerprint = info.get("model_fingerprint", w.fingerprint)
            w.peer_claim = info.get("peer_claim") if isinstance(info.get("peer_claim"), str) else None
            if isinstance(info.get("max_model_len"), int):
                w.max_model_len = info["max_model_len"]
            w.ready = r.status == 200 and not info.get("draining", False)
            w.failed_polls = 0
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            w.ready = False
            w.failed_polls += 1

    async def poll_once(self) -> None:
        urls = set(self.discovery.prefill_urls()) | set(self.discovery.decode_urls())
        for gone in set(self.workers) - urls:
            # a worker that drops out of discovery for a moment (one slow readiness probe takes a pod
            # out of its Endpoints) keeps its count while its streams run: forgotten and re-added at 0,
            # it drew new requests onto streams it still served, and left a peer idle
            if self.workers[gone].in_flight <= 0:
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
            u: {"ready": w.ready, "in_flight": w.in_flight, "free_blocks": w.free_blocks,
                "model_fingerprint": w.fingerprint}
            for u, w in self.workers.items()}, "model_fingerprints": self.fingerprints()})

    def fingerprints(self) -> dict[str, list[str]]:
        """The model fingerprints the workers report, each with the workers reporting it (more than
        one key: the pool serves different models, and those workers are never paired)."""
        out: dict[str, list[str]] = {}
        for u, w in sorted(self.workers.items()):
            if w.fingerprint:
                out.setdefault(w.fingerprint, []).append(u)
        return out

    def _log_refusals(self, d) -> None:
        """Say, once per pair, why a prefill worker is not paired with a decode worker."""
        for p in d.refused:
            key = (d.decode.url, d.decode.fingerprint or "", p.url, p.fingerprint or "")
            if key not in self._refusals:
                self._refusals.add(key)
                log.warning("not pairing decode worker %s (model fingerprint %s) with prefill worker %s "
                            "(model fingerprint %s): they serve different models (content, dtype or "
                            "quantization); its prompts are prefilled elsewhere", *key)

    async def ready(self, request):
        ok = self.ready_without_workers or any(w.ready for w in self._states(self.discovery.decode_urls()))
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            # root: the model source (vLLM's field); `tandem bench serve` loads its tokenizer from it
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem",
             "root": self.model_source}]})

    async def metrics_route(self, request):
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.router_queued.set(self.queued)
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def completions(self, request):
        return await self._route(request, "/v1/completions", chat=False)

    async def chat_completions(self, request):
        return await self._route(request, "/v1/chat/completions", chat=True)

    def context_limit(self) -> int | None:
        """The longest prompt, in tokens, any worker could take: the spec's ``maxModelLen``, else the
        largest the workers report (each worker checks its own exactly); None before any reported."""
        if self.max_model_len:
            return self.max_model_len
        return max((w.max_model_len for w in self.workers.values() if w.max_model_len), default=None)

    async def _wait_for_decode(self, decide_fn):
        """Decide now, or hold the request (``tandem:router_queued_requests``) until a decode worker is
        ready or the wait passes: ``queue_timeout`` for a scale-to-zero pool (its workers are being
        woken), ``unavailable_timeout`` for any other (a pool that should have workers and has none
        ready fails fast, so clients retry rather than hang)."""
        decision = decide_fn()
        if decision is not None:
            return decision
        self.queued += 1
        try:
            wait = self.queue_timeout if self.ready_without_workers else self.unavailable_timeout
            t_end = time.monotonic() + wait
            while decision is None and time.monotonic() < t_end:
                await asyncio.sleep(min(0.5, self.health_interval))
                await self.poll_once()
                decision = decide_fn()
            return decision
        finally:
            self.queued -= 1

    async def _route(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        self.in_flight += 1
        try:
            raw = await request.read()
            try:
                req, ids = await read_request_async(raw, chat, self.model_name, self.tok, self.char_limit)
            except InvalidRequestError as e:
                return json_error(str(e), e.status, e.field)
            if req.stream and LAST_EVENT_ID_HEADER in request.headers:
                return await self._resume(request, req)
            limit = self.context_limit()
            if limit is not None and len(ids) >= limit:
                # before hashing: a million token ids would hold the event loop for a quarter second
                field = "messages" if chat else "prompt"
                return json_error(f"{field}: this model's maximum context length is {limit} tokens; the "
                                  f"prompt has {len(ids)} tokens", 400, field)
            self.metrics.request_received(len(ids))
            by_fp: dict[str, list[bytes]] = {}

            def hashes_for(w) -> list[bytes]:
                # block hashes mix in the model fingerprint, which comes from the workers' /health
                fp = w.fingerprint or ""
                if fp not in by_fp:
                    by_fp[fp] = block_hashes(ids, self.block_size, bytes.fromhex(fp))
                return by_fp[fp]
            tried: set[str] = set()   # decode workers that failed this request
            client_usage = req.include_usage
            if req.stream and not client_usage:
                # TPOT needs the output token count, which only the usage chunk carries: ask for it,
                # and keep it from a client that did not
                raw = json.dumps({**json.loads(raw), "stream_options": {"include_usage": True}}).encode()

            def decide_fn():
                decodes = self._states(self.discovery.decode_urls())
                fp_worker = pick_decode(decodes, tried)   # the one decide() picks: hash for its model
                return decide(decodes, self._states(self.discovery.prefill_urls()), len(ids),
                              hashes_for(fp_worker) if fp_worker else [], self.remote_min, self.routing,
                              tried, self._rr,
                              absorb_bursts=self._absorbing())
            while True:
                d = await self._wait_for_decode(decide_fn)
                if d is None:
                    resp = json_error("no ready decode worker (the pool's workers are starting or "
                                      "restarting); retry later", 503)
                    resp.headers["Retry-After"] = str(max(1, round(self.unavailable_timeout)))
                    return resp
                self._rr += 1
                self._log_refusals(d)
                hashes = hashes_for(d.decode)
                place = "remote" if d.prefill is not None else "local"
                headers = {"Content-Type": "application/json", **auth.pool_headers(self.pool_secret)}
                if d.prefill is not None:
                    headers[PREFILL_PEER_HEADER] = d.prefill.url
                    if d.prefill.peer_claim:   # the decode worker connects only to a peer the pool vouched for
                        headers[CLAIM_HEADER] = d.prefill.peer_claim
                stream_headers = {}
                if req.stream and self.stream_resume_grace > 0:
                    stream_headers = {STREAM_ID_HEADER: f"{worker_key(d.decode.url)}.{uuid.uuid4().hex}",
                                      STREAM_OWNER_HEADER: _owner(request),
                                      STREAM_GRACE_HEADER: f"{self.stream_resume_grace:g}"}
                    headers.update(stream_headers)
                with _Load(d) as load:
                    t_send = time.monotonic()
                    try:
                        upstream = await self._post_watched(d, d.decode.url + path, raw, headers)
                    except asyncio.CancelledError:
                        # the client left before its first token (aiohttp cancels the handler): the
                        # worker keeps a resumable stream that lost its reader for the resume grace,
                        # holding a decode slot, unless it is told (a killed load generator kept its
                        # decode workers busy for 30 s in a clean-clone run)
                        self._canceller(d.decode.url, stream_headers)()
                        raise
                    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                        log.warning("decode worker %s unreachable (%r); trying another", d.decode.url, e)
                        self._retried("unreachable")
                        d.decode.ready = False
                        tried.add(d.decode.url)
                        continue
                    except _WorkerHung as e:
                        # a stopped decode worker is left for good; a stopped prefill worker is out of
                        # routing already (not ready), so the same decode worker may take it again
                        log.warning("%s stopped answering before this request's first token; sending it "
                                    "again", e.worker.url)
                        self._retried("hung")
                        if e.worker is d.decode:
                            tried.add(d.decode.url)
                        continue
                    if upstream.status == 503 and len(tried) < len(self.discovery.decode_urls()) - 1:
                        upstream.release()              # draining: try another decode worker
                        self._retried("draining")
                        d.decode.ready = False
                        tried.add(d.decode.url)
                        continue
                    if upstream.status == 401:
                        # a worker of another pool, or one rolled out with a rotated secret: another
                        # decode worker (of this router's generation) may still take it
                        upstream.release()
                        log.warning("decode worker %s refused this router's pool credential", d.decode.url)
                        tried.add(d.decode.url)
                        if tried >= set(self.discovery.decode_urls()):
                            return json_error("every decode worker refused this router's pool credential", 502)
                        continue
                    self.metrics.routing.labels(**self.metrics.labels, decision=d.reason).inc()
                    if upstream.status == 200:
                        d.decode.remember(hashes)
                        if d.prefill:
                            d.prefill.remember(hashes)
                    shown = self._worker_headers(request, d)
                    if req.stream and upstream.status == 200:
                        return await self._relay_stream(request, upstream, t0, client_usage, place, load.release,
                                                        load.release_prefill, shown,
                                                        self._canceller(d.decode.url, stream_headers))
                    resp = await self._relay_full(upstream, t0, t_send, place)
                    resp.headers.update(shown)
                    return resp
        finally:
            self.in_flight -= 1

    def _retried(self, reason: str) -> None:
        self.metrics.router_retries.labels(**self.metrics.labels, reason=reason).inc()

    def _worker_headers(self, request: web.Request, d) -> dict[str, str]:
        """The workers that serve this request, for a caller with the pool token (or an open pool):
        worker addresses are the pool's own business."""
        if auth.pool_only(request, self.pool_secret) is not None:
            return {}
        return {DECODE_WORKER_HEADER: d.decode.url, PREFILL_WORKER_HEADER: d.prefill.url if d.prefill else "local"}

    async def _post_watched(self, d, url: str, raw: bytes, headers: dict) -> aiohttp.ClientResponse:
        """POST the request to its decode worker and wait for the response's head (a worker sends it
        with the first token), giving up with :class:`_WorkerHung` when the decode or the prefill worker
        misses ``HUNG_POLLS`` health polls in a row meanwhile. Closing the connection then makes the
        worker abort the request (and free its blocks) when it next writes to it."""
        post = asyncio.ensure_future(self.session.post(url, data=raw, headers=headers))
        try:
            while True:
                done, _ = await asyncio.wait({post}, timeout=min(0.5, self.health_interval))
                if done:
                    return post.result()
                for w in (d.decode, d.prefill):
                    if w is not None and w.failed_polls >= HUNG_POLLS:
                        raise _WorkerHung(w)
        finally:
            if not post.done():
                post.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await post

    async def _relay_full(self, upstream: aiohttp.ClientResponse, t0: float, t_send: float,
                          place: str) -> web.Response:
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
                                             int(usage.get("completion_tokens", 0)), prefill=place)
            return resp

    async def _relay_stream(self, request, upstream: aiohttp.ClientResponse, t0: float,
                            client_usage: bool, place: str, on_last=lambda: None,
                            on_first=lambda: None, extra_headers: dict | None = None,
                            on_client_gone=lambda: None, observed: bool = False) -> web.StreamResponse:
        """Relay an SSE stream; ``on_first()`` runs at the first token, ``on_last()`` when the ``[DONE]``
        event arrives, both before the client gets them (the router's count of the workers' load drops
        there: see :class:`_Load`). The request's latencies are observed at ``[DONE]`` too, before the
        client gets it, so a client that reads the metrics after its stream finds its request counted.

        A stream whose decode worker's connection breaks, or that gets nothing for
        ``stream_idle_timeout`` seconds, ends with an error event in OpenAI's format (``data:
        {"error": {...}}``, no ``[DONE]``, as the worker ends a stream whose engine died), counted by
        reason; its tokens cannot move to another worker, so it is not retried. A client that goes away
        runs ``on_client_gone()`` (the explicit cancel of a resumable stream at its worker). A resumed
        stream (``observed``) is not observed again: its latencies are not the client's."""
        resp = web.StreamResponse(status=upstream.status, headers={
            **{k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}, **(extra_headers or {})})
        try:
            await resp.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            # gone while its stream was being set up: without the cancel a resumable stream would go on at
            # its worker for the whole resume grace, holding its slot (a clean-clone run's terminated
            # load generator left its decode workers busy for 30 s)
            log.info("client went away before its stream began")
            upstream.close()
            on_client_gone()
            return resp
        timer, buf, num_tokens = TokenTimer(t0), b"", 0

        def observe():
            nonlocal observed
            if not observed:
                observed = True
                self.metrics.observe_request(timer.ttft, time.monotonic() - t0, num_tokens, timer.itls,
                                             prefill=place)
        broken = None   # why the decode worker's stream ended early: a router_stream_errors reason
        async with upstream:
            try:
                while True:
                    try:
                        chunk = await asyncio.wait_for(upstream.content.readany(), self.stream_idle_timeout)
                    except asyncio.TimeoutError:
                        broken = "decode_worker_timeout"
                        break
                    if not chunk:
                        break
                    buf += chunk
                    *events, buf = buf.split(b"\n\n")
                    out = []
                    for ev in events:
                        obj = _event_json(ev)
                        if obj is not None and "usage" in obj and not obj.get("choices"):
                            num_tokens = int((obj["usage"] or {}).get("completion_tokens", 0))
                            if not client_usage:
                                continue
                        if obj is not None and _has_token_text(obj):
                            if timer.ttft is None:
                                on_first()
                            timer.tick()
                        if (_data(ev) or b"").startswith(b"[DONE]"):
                            on_last()
                            observe()
                        out.append(ev + b"\n\n")
                    if out:
                        await resp.write(b"".join(out))
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                log.info("client went away mid-stream")   # leaving closes upstream; the worker aborts
                on_client_gone()
                return resp
            except asyncio.CancelledError:   # the client went away (aiohttp's handler cancellation)
                on_client_gone()
                raise
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                log.warning("decode worker broke the stream: %r", e)
                broken = "decode_worker_lost"
        if broken is not None:
            return await self._end_broken(resp, broken)
        # (resp.write raises CancelledError only while the handler is cancelled: handled above)
        observe()   # a stream without [DONE]
        # (a client gone by now, after its last event, is the middleware's json_errors: logged at INFO)
        if buf:
            await resp.write(buf)
        await resp.write_eof()
        return resp

    def _canceller(self, decode_url: str, stream_headers: dict):
        """``on_client_gone`` for a stream: a resumable one is cancelled at its worker at once (without
        it the worker would keep it for the grace, as for a lost router); any other is aborted by its
        closed connection alone."""
        if not stream_headers:
            return lambda: None

        def cancel():
            task = asyncio.ensure_future(self._cancel_stream(decode_url, stream_headers))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
        return cancel

    async def _cancel_stream(self, decode_url: str, stream_headers: dict) -> None:
        headers = {**auth.pool_headers(self.pool_secret), STREAM_ID_HEADER: stream_headers[STREAM_ID_HEADER],
                   STREAM_OWNER_HEADER: stream_headers[STREAM_OWNER_HEADER]}
        try:
            async with self.session.post(decode_url + "/v1/streams/cancel", headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status not in (200, 404):   # 404: it had finished meanwhile
                    log.warning("cancelling stream at %s: HTTP %d", decode_url, r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("cancelling stream at %s failed (%r); the worker frees it after the grace", decode_url, e)

    async def _resume(self, request: web.Request, req) -> web.StreamResponse:
        """A client's reconnection (``Last-Event-ID: <stream id>:<index>``): the events after ``index``
        of that stream, from the decode worker the id's key names among the workers this router
        discovered itself (404 when none does, or the worker no longer has the stream for this client)."""
        sid, _, index = request.headers[LAST_EVENT_ID_HEADER].strip().rpartition(":")
        if not STREAM_ID.match(sid) or not index.isdigit() or len(index) > 9:
            return json_error(f"{LAST_EVENT_ID_HEADER} is not an event id of this pool's streams", 400,
                              LAST_EVENT_ID_HEADER)
        key = sid.split(".")[0]
        url = next((u for u in self.discovery.resumable_urls() if worker_key(u) == key), None)
        if url is None:
            self._resumed("unknown_worker")
            return json_error("the stream's decode worker is not in this pool any more: it cannot be resumed", 404)
        owner = {STREAM_ID_HEADER: sid, STREAM_OWNER_HEADER: _owner(request)}
        headers = {**auth.pool_headers(self.pool_secret), **owner, LAST_EVENT_ID_HEADER: index}
        try:
            upstream = await self.session.post(url + "/v1/streams/resume", headers=headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            self._resumed("unreachable")
            return json_error(f"the stream's decode worker cannot be reached ({type(e).__name__})", 502)
        if upstream.status != 200:
            body = await upstream.read()
            upstream.release()
            self._resumed("not_found" if upstream.status == 404 else "refused")
            return web.Response(body=body, status=upstream.status, content_type="application/json")
        self._resumed("resumed")
        log.info("resuming stream %s after event %s at %s", sid, index, url)
        w = self.workers.get(url)
        if w is not None:
            w.in_flight += 1
        try:
            return await self._relay_stream(request, upstream, time.monotonic(), req.include_usage, "local",
                                            on_client_gone=self._canceller(url, owner), observed=True)
        finally:
            if w is not None:
                w.in_flight -= 1

    def _resumed(self, outcome: str) -> None:
        self.metrics.router_stream_resumes.labels(**self.metrics.labels, outcome=outcome).inc()

    async def _end_broken(self, resp: web.StreamResponse, reason: str) -> web.StreamResponse:
        """End a begun stream whose decode worker failed it: an OpenAI error event, counted."""
        self.metrics.router_stream_errors.labels(**self.metrics.labels, reason=reason).inc()
        message = ("the decode worker serving this stream failed mid-stream" if reason == "decode_worker_lost"
                   else f"the decode worker serving this stream sent nothing for {self.stream_idle_timeout:.0f} s")
        with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
            await resp.write(error_event(message, 502, reason=reason))
            await resp.write_eof()
        return resp


class _WorkerHung(Exception):
    """A worker a request waits on stopped answering its health checks (``worker``: its WorkerState)."""

    def __init__(self, worker):
        super().__init__(worker.url)
        self.worker = worker


class _Load:
    """Count a request against the workers a decision names while it is in flight: from the decision
    until the stream's last event (:meth:`release`, once) or the handler's end, whichever comes first;
    a streamed request's prefill worker only until its first token (:meth:`release_prefill`).

    At the last event, not at the handler's end: a client that counts a stream done at ``[DONE]`` sends
    its next request while the router still waits for the worker to close the stream, and that request
    saw the finished one still counted; on a tie it could join the other stream on one worker, leaving
    this one idle (suspected in tests/e2e, where a drain found a worker empty; this fix alone did not
    change that, docs/e2e.md)."""

    def __init__(self, d):
        self.decode, self.prefill = d.decode, d.prefill
        for w in (self.decode, self.prefill):
            if w is not None:
                w.in_flight += 1

    def release_prefill(self) -> None:
        """The prefill worker's part is over (the stream's first token: its KV is on the decode worker).
        Counted until the stream's end, a prefill worker that served long answers looked busy to
        :func:`pick_prefill` while it was idle."""
        if self.prefill is not None:
            self.prefill.in_flight -= 1
            self.prefill = None

    def release(self) -> None:
        self.release_prefill()
        if self.decode is not None:
            self.decode.in_flight -= 1
            self.decode = None

    def __enter__(self) -> "_Load":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _owner(request: web.Request) -> str:
    """A digest of the client's credential (its API key; "" on an open pool): only a client with the
    same may resume or cancel the stream it opens."""
    cred = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hashlib.sha256(b"tandem-stream-owner\0" + cred).hexdigest()[:32]


def _data(event: bytes) -> bytes | None:
    """The ``data:`` field of one SSE event (which may carry an ``id:`` line too), or None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            return line[6:]
    return None


def _event_json(event: bytes) -> dict | None:
    """The JSON object of one SSE ``data:`` event; None for [DONE] and anything else."""
    data = _data(event)
    if data is None or data.startswith(b"[DONE]"):
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _has_token_text(obj: dict) -> bool:
    """Does one chunk carry token text (not the role-only first chunk, not usage)?"""
    for c in obj.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False
