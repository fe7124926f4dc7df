"""The HTTP surface the router and every worker share: the OpenAI routes' app skeleton, JSON errors,
and the headers they pass each other."""
from __future__ import annotations

import hashlib
import logging
import re
import uuid

from aiohttp import web

from tandem.worker.api.errors import error_body

log = logging.getLogger(__name__)

#: router -> decode worker: the prefill worker (an http URL) to pull the prompt's KV from
PREFILL_PEER_HEADER = "X-Tandem-Prefill-Peer"
#: worker -> router, on non-streaming responses: the worker's TTFT in seconds
TTFT_HEADER = "X-Tandem-TTFT-Seconds"
#: router -> decode worker: this stream's id (``<decode worker key>.<random hex>``). Its presence (from the
#: pool only) opts the request into resumption: the worker numbers the stream's events
#: (``id: <stream id>:<index>``) and keeps the sequence for a grace period when the connection drops
#: (tandem.worker.server.resumable)
STREAM_ID_HEADER = "X-Tandem-Stream-Id"
#: router -> decode worker: the seconds the worker keeps such a stream after its connection dropped
STREAM_GRACE_HEADER = "X-Tandem-Stream-Grace"
#: router -> decode worker: a digest of the client's credential; only the same digest may resume or cancel
STREAM_OWNER_HEADER = "X-Tandem-Stream-Owner"
#: a stream id: ``<16 hex: the decode worker's key (:func:`worker_key`)>.<32 hex: random>``
STREAM_ID = re.compile(r"^[0-9a-f]{16}\.[0-9a-f]{32}$")
#: the SSE reconnection header (the HTML standard's server-sent events): the id of the last event received
LAST_EVENT_ID_HEADER = "Last-Event-ID"


def worker_key(url: str) -> str:
    """A worker's key in stream ids: 16 hex digits of its URL's SHA-256. A router that resumes a stream
    finds the worker by matching this against the workers it discovered itself, so no address a
    client sends is ever connected to."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


#: the default limit on a request body (``tandem serve --max-request-bytes``)
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


#: the header that carries the id of a failed request, also in the server's log line for it
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_BYTES = web.AppKey("max_request_bytes", int)   # the app's body limit, for the 413 message


@web.middleware
async def json_errors(request: web.Request, handler):
    """aiohttp's own errors (unknown path 404, wrong method 405, body too large 413) as OpenAI JSON,
    and any unexpected exception as an OpenAI JSON 500 whose request id is in the log with its
    traceback (never aiohttp's plain-text page). A client that went away mid-answer (``ConnectionResetError``,
    aiohttp's ``ClientConnectionResetError`` included) is none of those: logged at INFO and answered
    with a 499 that aiohttp drops quietly on the closed connection."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_REQUEST_BYTES]
        return json_error(f"the request body is larger than this server's limit of {limit} bytes "
                          f"(tandem serve --max-request-bytes)", 413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_error(f"{e.reason}: {request.method} {request.path}", e.status)
    except ConnectionResetError:   # aiohttp's ClientConnectionResetError too: the client left mid-answer
        # nobody is left to answer, and it is not the server's error. A raised exception would be logged
        # by aiohttp as one; a response (nginx's 499 for the access log) meets the closed transport,
        # which aiohttp takes quietly as a premature disconnection
        log.info("client went away during %s %s", request.method, request.path)
        return web.Response(status=499, reason="Client Closed Request")
    except Exception:
        rid = uuid.uuid4().hex[:16]
        log.exception("internal error in %s %s (request id %s)", request.method, request.path, rid)
        resp = json_error(f"internal server error (request id {rid})", 500)
        resp.headers[REQUEST_ID_HEADER] = rid
        return resp


def openai_app(h, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> web.Application:
    """The routes the router and every worker share, served by ``h``'s handlers of the same names.

    A body over ``max_request_bytes`` is refused with 413 as it arrives, before it is parsed."""
    app = web.Application(client_max_size=max_request_bytes, middlewares=[json_errors])
    app[MAX_REQUEST_BYTES] = max_request_bytes
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/chat/completions", h.chat_completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ready", h.ready)
    app.router.add_get("/metrics", h.metrics_route)
    app.on_startup.append(h._startup)
    app.on_cleanup.append(h._cleanup)
    return app


def json_error(message: str, status: int, param: str | None = None) -> web.Response:
    """An OpenAI-style error response (``not_found_error`` for 404, ``server_error`` from 500)."""
    etype = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        etype = "not_found_error"
    return web.json_response(error_body(message, status, param, etype), status=status)
