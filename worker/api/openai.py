"""OpenAI request schemas and their parsing: the request contract the router and every worker share."""
from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator,
                      model_validator)

from tandem.worker.api.errors import InvalidRequestError, UnknownModelError
from tandem.worker.api.sampling import FAULT_FIELD, MAX_TOKEN_ID, SamplingParams, faults_enabled
from tandem.worker.api.tokenizer import chat_token_ids

log = logging.getLogger(__name__)

_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$")
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias")
#: integers longer than this are parsed as floats (and so refused by the integer fields, naming them):
#: Python refuses to parse over 4,300 digits at all, which would leave no field to name
_MAX_INT_DIGITS = 64


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
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: Optional[dict[str, Any]] = None

    def sampling(self, max_model_len: int, num_prompt_tokens: int) -> dict:
        """The SamplingParams fields. Without max_tokens: OpenAI's 16 for completions; for chat, the
        rest of the context (as vLLM does)."""
        d = {k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}
        if faults_enabled() and self.model_extra and FAULT_FIELD in self.model_extra:
            d[FAULT_FIELD] = self.model_extra[FAULT_FIELD]   # a test's fault hook, for the engine
        d["max_tokens"] = (self.max_tokens if self.max_tokens is not None
                           else self._default_max_tokens(max_model_len, num_prompt_tokens))
        return d

    def _default_max_tokens(self, max_model_len: int, num_prompt_tokens: int) -> int:
        return max(1, min(16, max_model_len - num_prompt_tokens))   # OpenAI's 16, where it fits

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: Union[str, list[StrictInt], list[str]]
    logprobs: Optional[int] = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _token_ids_in_range(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], int):
            bad = next((t for t in v if not 0 <= t <= MAX_TOKEN_ID), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is not in [0, {MAX_TOKEN_ID}]")
        return v

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


class ContentPart(BaseModel):
    """One part of a message's content; text parts are kept, others ignored."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_part_has_text(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a string text")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: bool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)

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
                content = "".join(p.text for p in content if p.type == "text")
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
        raise InvalidRequestError(loc, f"{msg} (got {_short(err.get('input'))})") from None
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options", "only allowed when stream is true")
    if req.model_extra:
        log.info("ignoring unknown request fields: %s", sorted(req.model_extra))
    return req


def _short(value: Any) -> str:
    """``repr(value)`` cut to 200 characters: an error message never echoes a whole large input."""
    r = repr(value)
    return r if len(r) <= 200 else r[:200] + "..."


def check_unicode(text: str, field: str) -> None:
    """Raise InvalidRequestError when ``text`` is not valid Unicode (a lone surrogate from a JSON
    ``\\udXXX`` escape: it has no UTF-8 form, so no tokenizer can take it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(field, f"is not valid Unicode: a lone surrogate at character {e.start}") from None


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The most characters a prompt can have and still fit ``max_model_len`` tokens.

    A token covers at most as many characters as its longest spelling in the vocabulary (byte-level
    and sentencepiece spellings use one character per byte or fewer), so a longer text cannot fit
    and is refused before the tokenizer spends time on it."""
    return max_model_len * max(len(t) for t in tokenizer.get_vocab())


def _check_chars(n: int, limit: int | None, field: str) -> None:
    if limit is not None and n > limit:
        raise InvalidRequestError(field, f"the prompt has {n} characters, more than can fit this model's "
                                  f"context length (at most {limit} characters)")


def prompt_token_ids(req: "CompletionRequest | ChatCompletionRequest", tokenizer,
                     char_limit: int | None = None) -> list[int]:
    """The prompt's token ids: the chat template applied to ``messages``, or the completion ``prompt``
    (text, or token ids). Raises InvalidRequestError for an empty prompt, several prompts, or a text
    over ``char_limit`` characters (see :func:`max_prompt_chars`)."""
    if isinstance(req, ChatCompletionRequest):
        messages = req.message_dicts()
        _check_chars(sum(len(m["content"]) for m in messages), char_limit, "messages")
        for i, m in enumerate(messages):
            check_unicode(m["content"], f"messages.{i}.content")
        return chat_token_ids(tokenizer, messages)
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return list(p)
    if isinstance(p, list):
        if not p:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(p) != 1:
            raise InvalidRequestError("prompt", "only one prompt per request is supported")
        p = p[0]
    if not p:
        raise InvalidRequestError("prompt", "must not be empty")
    _check_chars(len(p), char_limit, "prompt")
    check_unicode(p, "prompt")
    return list(tokenizer.encode(p))


def read_request(raw: bytes, chat: bool, model_name: str, tokenizer, char_limit: int | None = None):
    """Parse and check one OpenAI request body; returns ``(request, prompt_token_ids)``.

    CPU-bound (JSON, validation, tokenization): servers run it off the event loop.
    Raises InvalidRequestError (HTTP 400: malformed JSON, a bad field, a prompt over ``char_limit``
    characters) or UnknownModelError (404)."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError
        raise InvalidRequestError("", f"malformed JSON body: {_short(str(e))}") from None
    except RecursionError:
        raise InvalidRequestError("", "malformed JSON body: nested too deeply") from None
    req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
    if req.model != model_name:
        raise UnknownModelError("model", f"The model `{req.model}` does not exist.")
    ids = prompt_token_ids(req, tokenizer, char_limit)
    # every front end refuses bad sampling values before any work (the engine checks them again)
    SamplingParams.parse(req.sampling(len(ids) + 1, len(ids)))
    return req, ids


def _parse_int(digits: str):
    return int(digits) if len(digits) <= _MAX_INT_DIGITS else float(digits)


#: bodies up to this size are parsed on the event loop: well under a millisecond, less than the hop
#: to a thread costs (the router's added latency is a ~2 ms budget)
INLINE_BODY_BYTES = 16 * 1024


async def read_request_async(raw: bytes, chat: bool, model_name: str, tokenizer,
                             char_limit: int | None = None):
    """:func:`read_request`; a body over ``INLINE_BODY_BYTES`` on the default thread pool, so a large
    body never stalls the event loop (health probes included)."""
    if len(raw) <= INLINE_BODY_BYTES:
        return read_request(raw, chat, model_name, tokenizer, char_limit)
    return await asyncio.get_running_loop().run_in_executor(
        None, read_request, raw, chat, model_name, tokenizer, char_limit)

