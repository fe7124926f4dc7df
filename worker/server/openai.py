"""OpenAI request schemas and response/chunk builders (the shapes of OpenAI's and vLLM's API)."""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator,
                      model_validator)

from tandem.worker.api.tokenizer import chat_token_ids
from tandem.worker.engine.sequence import InvalidRequestError

log = logging.getLogger(__name__)

_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$")
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: Optional[dict[str, Any]] = None

    def sampling(self, max_model_len: int, num_prompt_tokens: int) -> dict:
        """The SamplingParams fields. Without max_tokens: OpenAI's 16 for completions; for chat, the
        rest of the context (as vLLM does)."""
        d = {k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}
        d["max_tokens"] = (self.max_tokens if self.max_tokens is not None
                           else self._default_max_tokens(max_model_len, num_prompt_tokens))
        return d

    def _default_max_tokens(self, max_model_len: int, num_prompt_tokens: int) -> int:
        return 16

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: Union[str, list[StrictInt], list[str]]
    logprobs: Optional[int] = None
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    def sampling(self, max_model_len: int, num_prompt_tokens: int) -> dict:
        d = super().sampling(max_model_len, num_prompt_tokens)
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        return d


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None

    def sampling(self, max_model_len: int, num_prompt_tokens: int) -> dict:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        d = super().sampling(max_model_len, num_prompt_tokens)
        if self.logprobs:
            d["logprobs"] = self.top_logprobs or 0
        return d

    def _default_max_tokens(self, max_model_len: int, num_prompt_tokens: int) -> int:
        return max(1, max_model_len - num_prompt_tokens)

    def message_dicts(self) -> list[dict]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            out.append({"role": m.role, "content": content or ""})
        return out


def parse_request(cls, body: Any):
    """Validate a request body; raise InvalidRequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("", "the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not _UNION_MEMBER.match(str(x)))
        msg = err["msg"].removeprefix("Value error, ")
        raise InvalidRequestError(loc, f"{msg} (got {err.get('input')!r})"[:300]) from None
    if req.model_extra:
        log.info("ignoring unknown request fields: %s", sorted(req.model_extra))
    return req


def prompt_token_ids(req: "CompletionRequest | ChatCompletionRequest", tokenizer) -> list[int]:
    """The prompt's token ids: the chat template applied to ``messages``, or the completion ``prompt``
    (text, or token ids). Raises InvalidRequestError for an empty prompt or several prompts."""
    if isinstance(req, ChatCompletionRequest):
        return chat_token_ids(tokenizer, req.message_dicts())
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return list(p)
    if isinstance(p, list):
        if len(p) != 1:
            raise InvalidRequestError("prompt", "only one prompt per request is supported")
        p = p[0]
    if not p:
        raise InvalidRequestError("prompt", "must not be empty")
    return list(tokenizer.encode(p))


class UnknownModelError(InvalidRequestError):
    """The request names a model this pool does not serve (HTTP 404)."""
    status = 404


def read_request(raw: bytes, chat: bool, model_name: str, tokenizer):
    """Parse and check one OpenAI request body; returns ``(request, prompt_token_ids)``.

    Raises InvalidRequestError (HTTP 400: malformed JSON, a bad field) or UnknownModelError (404)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError("", f"malformed JSON body: {e}") from None
    req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
    if req.model != model_name:
        raise UnknownModelError("model", f"The model `{req.model}` does not exist.")
    return req, prompt_token_ids(req, tokenizer)


def error_body(message: str, status: int, param: str | None = None,
               etype: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": etype, "param": param or None, "code": status}}


class ResponseBuilder:
    """Builds the bodies of one request's response, streaming or not."""

    def __init__(self, chat: bool, model: str, tokenizer, num_prompt_tokens: int):
        self.chat, self.model, self.tok = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens

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
                "token": t, "logprob": s.logprob, "bytes": list(t.encode()),
                "top_logprobs": [{"token": self._text(i), "logprob": lp, "bytes": list(self._text(i).encode())}
                                 for i, lp in (s.top_logprobs or [])]} for t, s in zip(toks, samples)]}
        return {"tokens": toks, "token_logprobs": [s.logprob for s in samples],
                "top_logprobs": [{self._text(i): lp for i, lp in (s.top_logprobs or [])}
                                 for s in samples], "text_offset": []}

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
