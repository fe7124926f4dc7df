"""Requests as the engine sees them: sampling parameters (validated) and sequence state."""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from tandem.worker.api.errors import InvalidRequestError  # noqa: F401  (re-exported)
from tandem.worker.api.sampling import GREEDY_TEMPERATURE, SamplingParams  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)


class SeqStatus(enum.Enum):
    WAITING = "waiting"                 # queued for (re)prefill
    WAITING_REMOTE = "waiting_remote"   # blocks held, KV arriving from a prefill worker
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's tokens, KV blocks and progress.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache; the next step computes
    ``len(token_ids) - num_computed_tokens`` more (a prompt chunk, or the one sampled token).
    """
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_cached_tokens: int = 0           # prompt tokens served by the prefix cache (last admission)
    num_preemptions: int = 0
    keep_logits: bool = False            # tests: keep every computed row's logits
    logits: list = field(default_factory=list)
    kv_sink: Callable | None = None      # prefill role: receives KV blocks as they complete
    num_blocks_sent: int = 0
    kv_received: bool = False            # decode role: some of the prompt's KV arrived from the peer
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    stop_after_first_token: bool = False  # prefill role: one token, then hand over
    detokenizer: object = None           # IncrementalDetokenizer, set by the engine
    text: str = ""                       # the output text so far (stop strings cut from it)
    num_emitted_chars: int = 0           # of ``text``, already returned in outputs

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1 or not self.output_token_ids and self.num_uncomputed > 0
