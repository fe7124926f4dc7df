"""Sampling parameters: the contract between the OpenAI front ends (router, workers) and the engine.

They travel from the decode worker to its prefill peer in the KV handshake, so the router, both
workers and the engine validate them with this one definition.
"""
from __future__ import annotations

import logging
import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem.worker.api.errors import InvalidRequestError

log = logging.getLogger(__name__)

#: set to 1 to turn on test-only fault hooks (a request field ``tandem_fault``, a worker's
#: ``POST /fault/engine``); never set in production
FAULT_INJECTION_ENV = "TANDEM_FAULT_INJECTION"
#: the request field that, with :data:`FAULT_INJECTION_ENV` on, makes the engine fail that request
FAULT_FIELD = "tandem_fault"


def faults_enabled() -> bool:
    """Whether the test-only fault hooks are on (:data:`FAULT_INJECTION_ENV`)."""
    return os.environ.get(FAULT_INJECTION_ENV) == "1"


#: temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by a smaller one
#: overflows float32 to inf, and softmax of inf is NaN
GREEDY_TEMPERATURE = 1e-5
#: token ids travel as little-endian uint32 (block hashes, the KV protocol)
MAX_TOKEN_ID = 2**32 - 1


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop, with OpenAI/vLLM names and ranges.

    ``temperature`` 0 (or below :data:`GREEDY_TEMPERATURE`, normalized to 0) means greedy. ``top_k``
    of -1 or 0 and ``top_p`` of 1 disable those filters. ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, -2..2) lower the logits of tokens already generated, once and per
    occurrence; ``repetition_penalty`` (CTRL, Keskar et al. 2019, as vLLM applies it; 1 is off) divides
    positive and multiplies negative logits of tokens in the prompt or the output; ``logit_bias``
    (OpenAI's, token id -> -100..100) is added to the logits. Every float must be finite.
    ``seed`` makes sampling reproducible per request (also across preemption). ``stop`` strings are
    cut from the output; ``stop_token_ids`` end it, as the model's EOS does unless ``ignore_eos``.
    ``logprobs`` asks for the sampled token's log-probability and the top-N alternatives.
    Unknown fields are ignored (and logged by :meth:`parse`).
    """
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOKEN_ID)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=1024)
    seed: int | None = Field(None, ge=-2**63, lt=2**64)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("temperature")
    @classmethod
    def _greedy_below_eps(cls, v):
        return 0.0 if v < GREEDY_TEMPERATURE else v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        for tok, bias in v.items():
            if not 0 <= tok <= MAX_TOKEN_ID:
                raise ValueError(f"token id {tok} is not in [0, {MAX_TOKEN_ID}]")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {tok} is {bias}, not in [-100, 100]")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_id_range(cls, v):
        bad = [t for t in v if not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in [0, {MAX_TOKEN_ID}]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_length(cls, v):
        for s in v:
            if not s or len(s) > 1024:
                raise ValueError("each stop string must have 1 to 1024 characters")
        return v

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @classmethod
    def parse(cls, values: "dict | SamplingParams | None") -> "SamplingParams":
        """Validate ``values``; raise :class:`InvalidRequestError` naming the first bad field."""
        if isinstance(values, SamplingParams):
            return values
        try:
            params = cls.model_validate(values or {})
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            got = repr(err.get("input"))
            got = got if len(got) <= 200 else got[:200] + "..."
            raise InvalidRequestError(loc, f"{err['msg'].removeprefix('Value error, ')} (got {got})") from None
        if params.model_extra:
            log.info("ignoring unknown sampling fields: %s", sorted(params.model_extra))
        return params
