"""The router's choices, as pure functions over what it knows of each worker.

- Decode: the least-loaded ready decode worker (fewest requests in flight, then most free KV blocks).
- Remote or local prefill (docs/architecture.md, "One request, end to end"): local when the prompt is
  shorter than ``remotePrefillMinTokens``, when the chosen decode worker already caches at least half of the
  prompt's blocks, or when no ready prefill worker reports the decode worker's model fingerprint
  (different content, dtype or quantization: their KV would not mean the same); remote otherwise.
- Prefill: prefix affinity within a load bound. Among prefill workers whose load is within
  ``load_bound`` of the least loaded, the one whose prefix cache most likely holds the prompt's
  leading blocks (by block hash), as in SGLang's cache-aware routing and NVIDIA Dynamo's KV router.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    """What the router believes about one worker."""
    url: str
    in_flight: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    ready: bool = True
    fingerprint: str | None = None   # the model fingerprint the worker reports at /health (hex)
    max_model_len: int | None = None  # the context length the worker reports at /health (tokens)
    failed_polls: int = 0            # health polls in a row that got no answer (a dead or stopped worker)
    peer_claim: str | None = None    # a prefill worker's latest claim of pool membership (/health), forwarded
    cached: OrderedDict = field(default_factory=OrderedDict)   # block hash -> None, LRU

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` this worker probably caches."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def remember(self, hashes: list[bytes], capacity: int = 200_000) -> None:
        """Record that this worker now caches ``hashes`` (bounded by its block count, LRU)."""
        cap = self.num_blocks or capacity
        for h in hashes:
            self.cached[h] = None
            self.cached.move_to_end(h)
        while len(self.cached) > cap:
            self.cached.popitem(last=False)


@dataclass
class Decision:
    decode: WorkerState
    prefill: WorkerState | None
    reason: str    # remote | short_prompt | decode_cached | no_prefill_worker | model_mismatch | absorb_burst
    #: ready prefill workers left out because their model fingerprint differs from the decode worker's
    refused: list[WorkerState] = field(default_factory=list)


def pick_decode(decodes: list[WorkerState], exclude: set[str] = frozenset()) -> WorkerState | None:
    """The ready decode worker with the fewest requests in flight, then the most free blocks."""
    ready = [w for w in decodes if w.ready and w.url not in exclude]
    if not ready:
        return None
    return min(ready, key=lambda w: (w.in_flight, -w.free_blocks, w.url))


def pick_prefill(prefills: list[WorkerState], hashes: list[bytes], routing: str = "prefix-affinity",
                 load_bound: int = 2, rr_counter: int = 0) -> WorkerState | None:
    """Choose a prefill worker (see the module docstring); None when none is ready."""
    ready = [w for w in prefills if w.ready]
    if not ready:
        return None
    if routing == "round-robin":
        return sorted(ready, key=lambda w: w.url)[rr_counter % len(ready)]
    least = min(w.in_flight for w in ready)
    within = [w for w in ready if w.in_flight <= least + load_bound]
    if routing == "least-loaded":
        return min(within, key=lambda w: (w.in_flight, w.url))
    return max(within, key=lambda w: (w.matched_blocks(hashes), -w.in_flight, w.url))


#: A decode worker has headroom for a burst's local prefill while at most this fraction of its KV
#: blocks is held.
BURST_HEADROOM_KV = 0.5


def decide(decodes: list[WorkerState], prefills: list[WorkerState], num_tokens: int, hashes: list[bytes],
           remote_prefill_min_tokens: int, routing: str = "prefix-affinity", exclude: set[str] = frozenset(),
           rr_counter: int = 0, absorb_bursts: bool = False) -> Decision | None:
    """Where one request goes; None when no decode worker is ready. ``absorb_bursts`` (the autoscaler's
    decision, while new prefill replicas start): prefill locally on a decode worker with headroom
    (at most BURST_HEADROOM_KV of its KV blocks held), after TokenScale (arXiv 2512.03416)."""
    decode = pick_decode(decodes, exclude)
    if decode is None:
        return None
    if absorb_bursts and decode.num_blocks and \
            decode.free_blocks >= (1 - BURST_HEADROOM_KV) * decode.num_blocks:
        return Decision(decode, None, "absorb_burst")
    if num_tokens < remote_prefill_min_tokens:
        return Decision(decode, None, "short_prompt")
    if hashes and 2 * decode.matched_blocks(hashes) >= len(hashes):
        return Decision(decode, None, "decode_cached")
    # KV moves only between workers serving the same model content, dtype and quantization
    refused = [p for p in prefills if p.ready and p.fingerprint != decode.fingerprint]
    prefill = pick_prefill([p for p in prefills if p not in refused], hashes, routing, rr_counter=rr_counter)
    if prefill is None:
        return Decision(decode, None, "model_mismatch" if refused else "no_prefill_worker", refused)
    return Decision(decode, prefill, "remote", refused)
