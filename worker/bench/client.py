"""One streamed request to an OpenAI-compatible endpoint, timed as vLLM's serving benchmark times it.

TTFT runs from the moment the client sends to the first chunk that carries token text (a chat
stream's role-only chunk and empty chunks do not count). Every content chunk's arrival time is kept;
ITL is the gap between consecutive content chunks, so a chunk that carries several tokens is one gap
(vLLM's convention; a server that batches tokens per chunk shows longer, fewer gaps). The output
token count comes from the usage the server returns (``stream_options.include_usage``), never from
counting chunks. A stream without usage (llama-cpp-python's server sends none) keeps its text and
prompt, and the runner counts both with the model's tokenizer after the run (``counting.py``), as
``vllm bench serve`` does; the record says which way it was counted (``token_source``).

A stream whose connection breaks mid-body after an event with an ``id`` (a router that numbers its
events: tandem's, docs/serving.md "Stream resumption") is resumed: the same request is sent again with
``Last-Event-ID: <the last id>`` (the HTML standard's SSE reconnection), a bounded number of times within
the request's deadline, and the rest of the stream is appended (``resumes`` counts the reconnections).
A stream that ends before ``data: [DONE]``, or whose connection breaks mid-body, is ``incomplete``;
whatever the server wrote that was not an SSE data line (a plain-text error, an ``event: error``
block) is kept in the error message as the server's words.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from tandem.worker.bench.datasets import BenchRequest


@dataclass
class RequestRecord:
    """What one request did. Times are seconds on the client's monotonic clock (``*_mono``) and, for
    joining with other logs (replica counts over time), Unix time of the send (``send_unix``)."""
    id: str
    session: int | None
    turn: int
    scheduled: bool                 # on the up-front schedule (counts in the send-lag report)
    intended_mono: float | None     # when the schedule said to send
    send_mono: float = 0.0
    send_unix: float = 0.0
    first_token_mono: float | None = None
    token_times_mono: list[float] = field(default_factory=list)   # one per content chunk
    end_mono: float | None = None
    prompt_tokens_asked: int = 0
    output_tokens_asked: int = 0
    prompt_tokens: int | None = None        # from the server's usage, or counted (token_source)
    completion_tokens: int | None = None    # from the server's usage, or counted (token_source)
    token_source: str | None = None         # usage | tokenizer (None: not counted yet, or failed)
    prompt_sent: object = None              # messages or prompt, kept only to count a stream without usage
    status: str = "ok"                      # ok | error
    # http_<code> | stream_error | incomplete | disconnected | no_usage | connect | timeout | ...
    error_kind: str | None = None
    error: str | None = None
    text: str = ""
    served_by: dict = field(default_factory=dict)   # the router's X-Tandem-*-Worker headers, when it sends them
    resends: int = 0                        # times sent again after the connection failed before any answer
    last_event_id: str | None = None        # the SSE id of the last event received (resumption)
    resumes: int = 0                        # reconnections with Last-Event-ID after the stream broke

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_mono is None else self.first_token_mono - self.send_mono

    @property
    def e2e(self) -> float | None:
        return None if self.end_mono is None else self.end_mono - self.send_mono

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), only with at least 2 output tokens (docs/architecture.md)."""
        if not self.ok or not self.completion_tokens or self.completion_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times_mono
        return [b - a for a, b in zip(t, t[1:])]

    def fail(self, kind: str, msg: str) -> "RequestRecord":
        self.status, self.error_kind, self.error = "error", kind, msg[:500]
        self.end_mono = self.end_mono or time.monotonic()
        return self


#: failures after which nothing came back, so a request may be sent again (``Target.resend_s``)
RESENDABLE = ("connect", "disconnected", "http_503")
#: failures of a begun stream after which it is resumed (with its last event id), and of a resume
#: attempt after which it is tried again: the stream broke, or the router is not back yet
RESUMABLE = ("incomplete", "client_error", *RESENDABLE)
#: reconnections of one broken stream at most, 0.5 s, 1 s, then 2 s apart: about 21 s in all, a
#: restarting router's time (the thirteenth session's local soak needed 6-7 on a loaded machine),
#: within the decode worker's resume grace (spec.router.streamResumeGraceSeconds, default 30 s)
MAX_RESUMES = 12


@dataclass
class Target:
    """Where and how to send: ``endpoint`` is ``chat`` (/v1/chat/completions) or ``completions``."""
    base_url: str
    model: str
    endpoint: str = "chat"
    ignore_eos: bool = True         # ask for exactly output_tokens (tandem, vLLM and llama.cpp accept it)
    min_tokens: bool = False        # also send min_tokens = max_tokens (vLLM)
    temperature: float = 0.0
    timeout: float = 600.0
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None      # sent as Authorization: Bearer (docs/security.md)
    #: more request headers: a dict, or a function called for every send that returns one (the chaos
    #: soak's pool token, which is accepted once: docs/security.md)
    headers: dict | Callable[[], dict] = field(default_factory=dict)
    #: send again, for up to this many seconds after the first send, a request whose connection failed
    #: before any answer (refused, or closed before the response's head or before its first token and
    #: event id) or that got a 503, as OpenAI's SDK retries connection errors and 5xx: a restarting
    #: router (the chaos soak) loses no request that it never saw begin
    resend_s: float = 0.0
    tokenizer: str | None = None    # counts streams without usage (counting.py); None: tandem's served model

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        base = base[:-3] if base.endswith("/v1") else base
        return base + ("/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions")

    def body(self, req: BenchRequest, history: list[dict] | None = None) -> dict:
        b = {"model": self.model, "max_tokens": req.output_tokens, "temperature": self.temperature,
             "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            b["ignore_eos"] = True
        if self.min_tokens:
            b["min_tokens"] = req.output_tokens
        if self.endpoint == "chat":
            b["messages"] = (history or []) + req.messages
        elif req.prompt_token_ids is not None:
            b["prompt"] = req.prompt_token_ids
        else:
            b["prompt"] = "\n\n".join(m["content"] for m in (history or []) + req.messages)
        return {**b, **self.extra_body}


def _content(chunk: dict) -> str:
    text = ""
    for ch in chunk.get("choices") or []:
        text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return text


async def send(session: aiohttp.ClientSession, target: Target, req: BenchRequest, rec: RequestRecord,
               history: list[dict] | None = None) -> RequestRecord:
    """Send ``req`` now and fill ``rec`` as the stream arrives. Never raises for a server's fault:
    failures become ``rec.status == "error"`` with an ``error_kind``. ``target.resend_s`` > 0 sends
    again (after 0.5 s) a request whose connection failed before any answer, or that got a 503, within that many seconds
    of the first send and within ``target.timeout``."""
    rec.send_mono, rec.send_unix = time.monotonic(), time.time()
    tries = 0   # resume attempts of this stream
    while True:
        await _send_once(session, target, req, rec, history)
        waited = time.monotonic() - rec.send_mono
        if rec.last_event_id is not None and not rec.ok:
            # a begun stream is never sent afresh (its tokens would repeat): resumed, or failed
            delay = min(2.0, 0.5 * 2 ** tries)
            if rec.error_kind not in RESUMABLE or tries >= MAX_RESUMES or waited + delay > target.timeout:
                return rec
            tries += 1
            rec.resumes += 1
            rec.status, rec.error_kind, rec.error, rec.end_mono = "ok", None, None, None
            await asyncio.sleep(delay)
            continue
        if rec.ok or rec.error_kind not in RESENDABLE or waited + 0.5 > min(target.resend_s, target.timeout):
            return rec
        rec.resends += 1
        rec.status, rec.error_kind, rec.error, rec.end_mono = "ok", None, None, None
        await asyncio.sleep(0.5)


async def _send_once(session: aiohttp.ClientSession, target: Target, req: BenchRequest, rec: RequestRecord,
                     history: list[dict] | None = None) -> RequestRecord:
    rec.prompt_tokens_asked, rec.output_tokens_asked = req.prompt_tokens, req.output_tokens
    body = target.body(req, history)
    head = False   # the response's head arrived
    words: list[str] = []   # what the server wrote outside SSE data lines: its words if it ends early

    def said() -> str:
        return f"; the server said: {' | '.join(words)[:300]}" if words else ""

    try:
        extra = target.headers() if callable(target.headers) else target.headers
        headers = {"X-Bench-Request-Id": rec.id, **extra}
        if rec.last_event_id is not None:
            headers["Last-Event-ID"] = rec.last_event_id
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
        left = target.timeout - (time.monotonic() - rec.send_mono)
        async with session.post(target.url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=left)) as r:
            head = True
            served = {k: v for k, v in r.headers.items() if k.startswith("X-Tandem-") and k.endswith("-Worker")}
            rec.served_by = served or rec.served_by   # a resumed stream's answer names no worker
            if r.status != 200:
                return rec.fail(f"http_{r.status}", (await r.text())[:500])
            done, usage = False, None
            buf = b""
            async for data in r.content.iter_any():
                now = time.monotonic()
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if line.startswith(b"id:"):
                        rec.last_event_id = line[3:].strip().decode("utf-8", "replace")
                        continue
                    if not line.startswith(b"data:"):
                        # SSE comments (":") and blank separators are not words; event: lines are
                        if line and not line.startswith(b":") and len(words) < 8:
                            words.append(line.decode("utf-8", "replace"))
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        err = chunk["error"]
                        return rec.fail("stream_error", err.get("message", str(err)) if isinstance(err, dict)
                                        else str(err))
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    text = _content(chunk)
                    if text:
                        if rec.first_token_mono is None:
                            rec.first_token_mono = now
                        rec.token_times_mono.append(now)
                        rec.text += text   # kept across a resumption
            rec.end_mono = time.monotonic()
            if buf.strip():
                words.append(buf.strip().decode("utf-8", "replace"))
            if not done:
                return rec.fail("incomplete", "the stream ended without [DONE]" + said())
            if rec.first_token_mono is None:
                return rec.fail("no_tokens", "the stream carried no token text")
            if usage:
                rec.prompt_tokens, rec.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
                rec.token_source = "usage"
            else:   # counted after the run with the tokenizer (counting.py), or failed there as no_usage
                rec.prompt_sent = body.get("messages", body.get("prompt"))
            return rec
    except asyncio.TimeoutError:
        return rec.fail("timeout", f"no answer within {target.timeout} s")
    except aiohttp.ClientConnectorError as e:
        return rec.fail("connect", str(e))
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
        # nothing of the answer came back (before the head: a reused connection reset, the server gone;
        # after it, no token and no event id: a router killed between relaying its decode worker's head
        # and the first event, as once in a clean-clone chaos soak), so the request may be sent again
        # (``Target.resend_s``) without repeating a token; once a token or an event id came, it is resumed
        # or failed, never sent afresh
        begun = head and (rec.text or rec.last_event_id is not None or rec.first_token_mono is not None)
        return rec.fail("incomplete" if begun else "disconnected", f"{type(e).__name__}: {e}" + said())
    except aiohttp.ClientError as e:
        return rec.fail("client_error", f"{type(e).__name__}: {e}")
    except json.JSONDecodeError as e:
        return rec.fail("bad_json", str(e))
