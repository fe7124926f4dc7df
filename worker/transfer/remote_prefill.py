"""The decode worker's side of a disaggregated request (docs/architecture.md, "One request, end to end").

The decode worker owns the request: it reserves KV blocks, pulls the prompt's KV from the named
prefill worker into them, and then decodes. If the prefill worker is unreachable, refuses, or the
transfer breaks or times out, the reserved blocks are freed and the prompt is prefilled locally;
the client sees the same stream either way.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator
from urllib.parse import urlparse

import aiohttp

from tandem.worker.engine.async_engine import AsyncEngine
from tandem.worker.engine.llm_engine import RequestOutput
from tandem.worker.engine.sampler import SampleResult
from tandem.worker.engine.sequence import SamplingParams
from tandem.worker.api.errors import InvalidRequestError
from tandem.worker.transfer.protocol import RequestFailed, TransferError
from tandem.worker.transfer.tcp import pull_kv

log = logging.getLogger(__name__)


class PrefillPeers:
    """Finds a prefill worker's KV port from its HTTP address (``GET /health`` -> ``kv_port``), cached.
    ``secret`` is the pool secret the KV handshake proves (None: a pool without one)."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float = 3.0, secret: bytes | None = None):
        self.session, self.timeout, self.secret = session, timeout, secret
        self.ports: dict[str, int] = {}

    async def kv_address(self, peer_url: str) -> tuple[str, int]:
        u = urlparse(peer_url)
        host = u.hostname
        if u.scheme not in ("http", "https") or not host:
            raise TransferError(f"prefill peer {peer_url!r} is not an http URL")
        if peer_url not in self.ports:
            try:
                async with self.session.get(peer_url.rstrip("/") + "/health",
                                            timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                    info = await r.json()
                self.ports[peer_url] = int(info["kv_port"])
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError, TypeError) as e:
                raise TransferError(f"prefill worker {peer_url} unreachable: {e!r}") from None
        return host, self.ports[peer_url]

    def forget(self, peer_url: str) -> None:
        self.ports.pop(peer_url, None)


async def generate(aengine: AsyncEngine, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, prefill_peer: str | None, peers: PrefillPeers | None,
                   metrics=None, deadline: float = 300.0) -> AsyncIterator[RequestOutput]:
    """Yield the request's outputs; the prompt is prefilled on ``prefill_peer`` (an http URL) when
    given, else locally. Raises InvalidRequestError before the first output for a bad request.

    Every state of the request (reserved and waiting for the peer, receiving KV, queued for a local
    prefill, running) ends in the one ``aengine.request`` scope below, so closing this generator
    early (``contextlib.aclosing``), an error or a cancellation aborts it and frees its blocks."""
    if not prefill_peer or peers is None:
        async for out in aengine.generate(request_id, prompt_token_ids, params):
            yield out
        return
    engine = aengine.engine
    async with aengine.request(request_id) as h:
        seq = await h.add(engine.add_remote_request, request_id, prompt_token_ids, params)
        if seq is None:   # no room for the whole prompt now: queue a local prefill instead
            await h.add(engine.add_request, request_id, prompt_token_ids=prompt_token_ids, params=params)
        else:
            first = await _pull(aengine, request_id, prompt_token_ids, params, prefill_peer, peers, metrics,
                                deadline, seq.block_table)
            if first is not None:
                if first.finished:
                    h.live = False
                yield first
                if first.finished:
                    return
        async for out in h.outputs():
            yield out


async def _pull(aengine: AsyncEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                prefill_peer: str, peers: PrefillPeers, metrics, deadline: float,
                block_table: list[int]) -> RequestOutput | None:
    """Pull the prompt's KV from the peer into the reserved blocks; the first token's output, or None
    when the transfer failed and the request was queued for a local prefill instead. A request the
    peer refused as invalid raises InvalidRequestError; one that failed there ends in an "error"
    output (no local fallback for either: :class:`RequestFailed`)."""
    engine = aengine.engine
    t0 = time.monotonic()
    try:
        host, port = await peers.kv_address(prefill_peer)
        # stop strings and ids act on the decode side only (the prefill samples one token, with the
        # same result without them), and they would make the HELLO's size unbounded
        hello = {"layout": engine.kv_layout(), "prompt_token_ids": prompt_token_ids,
                 "params": {**params.model_dump(exclude={"stop", "stop_token_ids"}), "max_tokens": 1}}

        async def on_blocks(first_block, data):
            await aengine.call(engine.write_kv, request_id, first_block, data)

        done, nbytes = await pull_kv(host, port, hello, on_blocks, deadline=deadline,
                                     max_payload=len(block_table) * engine.runner.block_bytes,
                                     secret=peers.secret)
    except RequestFailed as e:
        # the request itself failed on the peer: a local prefill would fail the same way (and, where
        # the failure kills, kill this worker too), so the request fails here
        log.warning("request %s failed on prefill worker %s: %s", request_id, prefill_peer, e)
        if e.status == 400:
            raise InvalidRequestError(e.field or "", str(e)) from None
        return await aengine.call(engine.fail, request_id, f"on the prefill worker: {e}")
    except TransferError as e:
        log.warning("request %s: remote prefill failed, prefilling locally: %s", request_id, e)
        peers.forget(prefill_peer)
        await aengine.call(engine.fallback_local, request_id)
        return None
    lp = done.get("logprob")
    sample = SampleResult(done["token_id"], lp, [tuple(x) for x in done["top_logprobs"]]
                          if done.get("top_logprobs") else None)
    first = await aengine.call(engine.complete_remote, request_id, done["token_id"], sample)
    if metrics is not None:
        metrics.kv_transfer_bytes.labels(**metrics.labels, direction="received").inc(nbytes)
        metrics.kv_transfer_seconds.observe(time.monotonic() - t0)
    return first
