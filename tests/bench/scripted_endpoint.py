"""A TEST DOUBLE of an OpenAI-compatible streaming endpoint, for tests/bench only.

It answers /v1/chat/completions and /v1/completions from a script known to the test: per request
(keyed by the last message's content, or the prompt), the delay to the first content chunk, the
delay before each later content chunk, how many tokens each content chunk claims, and an optional
error (an HTTP status, an error event inside the stream, or a dropped connection; with
``error_times``, on that many first arrivals of the request only). Chat streams start with a
role-only chunk, and empty-content chunks are interleaved, as real servers send them. Delays
are kept against absolute deadlines from the request's arrival, so they do not drift. It records
when each request arrived, when it wrote each content chunk and when it ended each stream
(time.monotonic, which is CLOCK_MONOTONIC and so comparable with the client's clock in another
process), and how many requests were open at once.

Run: python scripted_endpoint.py --script FILE --port N  (GET /_arrivals returns what it recorded)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

DEFAULT = {"ttft": 0.05, "gaps": [0.01], "chunk_tokens": [1, 1]}


class Double:
    def __init__(self, script: dict, default: dict, capacity: int = 0):
        self.script, self.default = script, default
        # capacity > 0: at most that many requests are served at once, the rest queue (a saturable server)
        self.slots = asyncio.Semaphore(capacity) if capacity else None
        self.arrivals: list[tuple[str, float]] = []
        self.chunks_sent: dict[str, list[float]] = {}   # key -> when each content chunk was written
        self.ended: dict[str, float] = {}               # key -> when the stream's end was written
        self.open = 0
        self.max_open = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            if self.slots is None:
                return await self._handle(request, t0)
            async with self.slots:
                return await self._handle(request, t0, time.monotonic())
        finally:
            self.open -= 1

    async def _handle(self, request: web.Request, arrived: float, t0: float | None = None) -> web.StreamResponse:
        body = await request.json()
        chat = "messages" in body
        key = body["messages"][-1]["content"] if chat else body["prompt"]
        self.arrivals.append((key, arrived))
        t0 = arrived if t0 is None else t0
        s = {**self.default, **self.script.get(key, {})}
        err = s.get("error")
        if "error_times" in s and sum(1 for k, _ in self.arrivals if k == key) > s["error_times"]:
            err = None   # the scripted error hit only the first error_times arrivals of this request

        async def until(dt: float) -> None:
            await asyncio.sleep(max(0.0, t0 + dt - time.monotonic()))

        if err and err.startswith("http_"):
            await until(s.get("error_after", 0.0))
            code = int(err[5:])
            return web.json_response({"error": {"message": f"scripted {code}", "type": "scripted", "code": code}},
                                     status=code)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish=None, role=False, usage=None) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": text or "", "finish_reason": finish}]
            d = {"id": "x", "object": obj, "model": body["model"], "choices": [] if usage else choices}
            if usage:
                d["usage"] = usage
            return b"data: " + json.dumps(d).encode() + b"\n\n"

        if chat:
            await resp.write(chunk(None, role=True))
        tokens = s["chunk_tokens"]
        at = s["ttft"]
        for i, n in enumerate(tokens):
            if i:
                at += s["gaps"][(i - 1) % len(s["gaps"])]
            await until(at)
            if i in s.get("empty_before", []):
                await resp.write(chunk(""))
            if err == "stream_error" and i == s.get("error_at", 1):
                await resp.write(b'data: {"error": {"message": "scripted failure", "code": 500}}\n\n')
                return resp
            if err == "disconnect" and i == s.get("error_at", 1):
                request.transport.close()
                return resp
            await resp.write(chunk(" ".join(["tok"] * n) + " "))
            self.chunks_sent.setdefault(key, []).append(time.monotonic())
        await resp.write(chunk(None, finish="length"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(chunk(None, usage={"prompt_tokens": 7, "completion_tokens": sum(tokens),
                                                "total_tokens": 7 + sum(tokens)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.ended[key] = time.monotonic()
        return resp

    async def report(self, request: web.Request) -> web.Response:
        return web.json_response({"arrivals": self.arrivals, "max_open": self.max_open,
                                  "chunks_sent": self.chunks_sent, "ended": self.ended})


async def main(args) -> None:
    spec = json.loads(open(args.script).read()) if args.script else {}
    d = Double(spec.get("requests", {}), {**DEFAULT, **spec.get("default", {})}, spec.get("capacity", 0))
    app = web.Application()
    app.router.add_post("/v1/chat/completions", d.handle)
    app.router.add_post("/v1/completions", d.handle)
    app.router.add_get("/_arrivals", d.report)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # the client opens hundreds of connections at once; the default backlog of 128 would make them queue
    await web.TCPSite(runner, "127.0.0.1", args.port, backlog=2048).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--script")
    p.add_argument("--port", type=int, required=True)
    asyncio.run(main(p.parse_args()))
