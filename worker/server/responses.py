"""OpenAI response bodies and stream chunks, built from the engine's outputs (OpenAI's and vLLM's shapes)."""
from __future__ import annotations

import json
import re
import time
import uuid


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the spelling of byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_alphabet()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for, even when they are only part of a UTF-8 character (its decoded
    text would then be U+FFFD). Byte-level BPE spells each byte with one character of GPT-2's
    alphabet; sentencepiece spells a space as U+2581 and a lone byte as ``<0xNN>``."""
    tok = tokenizer.convert_ids_to_tokens(token_id)
    if all(c in _BYTES for c in tok):
        return bytes(_BYTES[c] for c in tok)
    m = _BYTE_FALLBACK.match(tok)
    if m:
        return bytes([int(m.group(1), 16)])
    return tok.replace("\u2581", " ").encode()


class ResponseBuilder:
    """Builds the bodies of one request's response, streaming or not."""

    def __init__(self, chat: bool, model: str, tokenizer, num_prompt_tokens: int):
        self.chat, self.model, self.tok = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.text_offset = 0   # characters of completion text before the next token (legacy logprobs)

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.num_prompt_tokens + completion_tokens}

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def _logprobs(self, samples) -> dict | None:
        if not samples:
            return None
        toks = [self._text(s.token_id) for s in samples]
        if self.chat:
            return {"content": [{
                "token": t, "logprob": s.logprob, "bytes": list(token_bytes(self.tok, s.token_id)),
                "top_logprobs": [{"token": self._text(i), "logprob": lp, "bytes": list(token_bytes(self.tok, i))}
                                 for i, lp in (s.top_logprobs or [])]} for t, s in zip(toks, samples)]}
        offsets = []
        for t in toks:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        return {"tokens": toks, "token_logprobs": [s.logprob for s in samples],
                "top_logprobs": [{self._text(i): lp for i, lp in (s.top_logprobs or [])}
                                 for s in samples], "text_offset": offsets}

    def full(self, text: str, finish_reason: str | None, completion_tokens: int, samples) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs(samples), "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(samples),
                      "finish_reason": finish_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(completion_tokens)}

    def _chunk(self, choices: list, usage: dict | None = None) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    def role_chunk(self) -> bytes:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def delta_chunk(self, text: str, finish_reason: str | None, samples) -> bytes:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(samples),
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(samples),
                      "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage_chunk(self, completion_tokens: int) -> bytes:
        return self._chunk([], self.usage(completion_tokens))

    DONE = b"data: [DONE]\n\n"
