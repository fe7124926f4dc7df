"""Issue 24: an unexpected exception in any handler is an OpenAI-format JSON 500 whose request id is in
the log beside its traceback, never aiohttp's plain-text page. The handler that raises is a stand-in
(named as such): no real route raises on any input we know of, which is the point of the other fixes."""
import asyncio
import logging

import aiohttp
from aiohttp import web

from tandem.worker.api.http import REQUEST_ID_HEADER, openai_app


class RaisingHandlers:
    """A stand-in for the router or a worker whose completions handler has a bug."""

    async def completions(self, request):
        raise KeyError("a bug")

    chat_completions = completions

    async def models(self, request):
        return web.json_response({"data": []})

    health = ready = metrics_route = models

    async def _startup(self, app):
        pass

    _cleanup = _startup


async def serve(handlers) -> tuple[web.AppRunner, int]:
    """The shared app skeleton over ``handlers`` on a free loopback port: (runner, port)."""
    runner = web.AppRunner(openai_app(handlers))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_an_unexpected_exception_is_a_json_500_with_a_logged_request_id(caplog):
    async def run():
        runner, port = await serve(RaisingHandlers())
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as r:
                    return r.status, r.headers.get(REQUEST_ID_HEADER), await r.json()
        finally:
            await runner.cleanup()
    with caplog.at_level(logging.ERROR):
        status, rid, body = asyncio.run(run())
    assert status == 500 and rid
    assert body["error"]["type"] == "server_error" and rid in body["error"]["message"]
    record = next(r for r in caplog.records if rid in r.getMessage())
    assert record.exc_info and "a bug" in str(record.exc_info[1])


class LeftStreamHandlers(RaisingHandlers):
    """A stand-in streaming handler: one event, then (once the client has closed the connection) a
    second write, which raises aiohttp's ClientConnectionResetError as a real stream's does."""

    async def completions(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {}\n\n")
        for _ in range(500):
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    chat_completions = completions


def test_a_client_gone_mid_stream_is_not_an_internal_error(caplog):
    """The router and workers logged a client that closed its stream early as an internal error with a
    traceback (clean-clone runs, fifteenth session): it is a departure, logged at INFO."""
    async def run():
        runner, port = await serve(LeftStreamHandlers())
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.readuntil(b"data: {}\n\n")
            writer.close()                           # the client leaves after the first event
            await asyncio.sleep(0.5)                 # the handler's next write meets the closed transport
        finally:
            await runner.cleanup()
    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert any("client went away" in r.getMessage() for r in caplog.records)
