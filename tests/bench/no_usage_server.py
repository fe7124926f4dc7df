"""A STAND-IN for an OpenAI-compatible server that streams no ``usage`` (as llama-cpp-python's does),
for tests/bench only: real aiohttp on loopback, a real tokenizer, no model.

It answers /v1/chat/completions and /v1/completions with ``max_tokens`` real token pieces of the
SmolLM2 tokenizer (the ids of a fixed English sentence, cycled), one piece per content chunk, and
ignores ``stream_options.include_usage``. What it did to each request is recorded under the client's
``X-Bench-Request-Id`` header and served at GET /_seen: the ids it streamed and the prompt's token
count as the server would prefill it (chat messages under the chat template, a text prompt with the
model's special tokens).

Per arrival (0-based, in the order requests reach it), ``--usage-every K`` makes every K-th request
send a usage chunk after all (``prompt_tokens`` 1000 + arrival, so a test can tell it came from usage),
and ``--cut N`` makes the N-th request stop after two chunks with a plain-text line (its "words")
and no ``[DONE]``.

Run: python no_usage_server.py --port N --tokenizer SOURCE [--usage-every K] [--cut N]
"""
from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

from tandem.worker.api.tokenizer import chat_token_ids, load_tokenizer

SENTENCE = " The quick brown fox jumps over the lazy dog, and then it runs home to sleep."
CUT_WORDS = "stand-in: generation interrupted by a newer request"


class StandIn:
    def __init__(self, tokenizer, usage_every: int, cut: int):
        self.tok, self.usage_every, self.cut = tokenizer, usage_every, cut
        self.ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
        self.arrivals = 0
        self.seen: dict[str, dict] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = self.arrivals
        self.arrivals += 1
        chat = "messages" in body
        prompt = len(chat_token_ids(self.tok, body["messages"])) if chat else len(self.tok.encode(body["prompt"]))
        ids = [self.ids[i % len(self.ids)] for i in range(int(body["max_tokens"]))]
        usage = bool(self.usage_every) and n % self.usage_every == 0
        cut = n == self.cut
        self.seen[request.headers.get("X-Bench-Request-Id", str(n))] = {
            "arrival": n, "prompt_tokens": prompt, "ids": ids, "usage": usage, "cut": cut}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(piece: str | None, finish=None, use=None) -> bytes:
            if chat:
                choices = [{"index": 0, "delta": {"content": piece} if piece is not None else {},
                            "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": piece or "", "finish_reason": finish}]
            d = {"id": "s", "object": "chat.completion.chunk" if chat else "text_completion",
                 "model": body["model"], "choices": [] if use else choices}
            if use:
                d["usage"] = use
            return b"data: " + json.dumps(d).encode() + b"\n\n"

        if chat:
            await resp.write(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n')
        for k, i in enumerate(ids):
            if cut and k == 2:
                await resp.write(CUT_WORDS.encode() + b"\n\n")
                await resp.write_eof()
                return resp
            await resp.write(chunk(self.tok.decode([i])))
            await asyncio.sleep(0.002)
        await resp.write(chunk(None, finish="length"))
        if usage:
            await resp.write(chunk(None, use={"prompt_tokens": 1000 + n, "completion_tokens": len(ids),
                                              "total_tokens": 1000 + n + len(ids)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model",
                                                              "owned_by": "stand-in"}]})

    async def report(self, request: web.Request) -> web.Response:
        return web.json_response(self.seen)


async def main(args) -> None:
    s = StandIn(load_tokenizer(args.tokenizer), args.usage_every, args.cut)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", s.handle)
    app.router.add_post("/v1/completions", s.handle)
    app.router.add_get("/v1/models", s.models)
    app.router.add_get("/_seen", s.report)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--usage-every", type=int, default=0)
    p.add_argument("--cut", type=int, default=-1)
    asyncio.run(main(p.parse_args()))
