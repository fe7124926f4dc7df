"""KV block allocation with automatic prefix caching.

Blocks are reference-counted. A block whose KV covers a full block of tokens is registered under
its chained hash (:mod:`tandem.worker.api.block_hash`). When its last user frees it, a registered
block is not cleared: it waits in an LRU queue, still findable by hash, until a new allocation
evicts it. This is vLLM's automatic prefix caching (Kwon et al., SOSP 2023; vLLM v1's KV cache
manager). Invariant, checked by :meth:`BlockManager.check_invariant`:
``free + cached_free + used == total``.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from tandem.worker.api.block_hash import ROOT_HASH, block_hashes
from tandem.worker.engine.sequence import Sequence


class BlockManager:
    """Owns the ids ``0 .. num_blocks - 1`` of the paged KV cache.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: register full blocks by hash and reuse them.
        model_fingerprint: 32 bytes mixed into every block hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 model_fingerprint: bytes):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.fingerprint = model_fingerprint
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))   # unregistered, ref 0
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # registered, ref 0, LRU order
        self.by_hash: dict[bytes, int] = {}
        self.num_used = 0
        self.prefix_queries = 0   # prompt tokens looked up
        self.prefix_hits = 0      # of which found in the cache

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus cached-free."""
        return len(self.free) + len(self.cached_free)

    def usage(self) -> float:
        """Fraction of blocks held by running requests (ref count > 0), 0..1."""
        return self.num_used / self.num_blocks

    def check_invariant(self) -> None:
        """Raise AssertionError unless free + cached_free + used == total and the counts agree."""
        used = sum(1 for r in self.ref_count if r > 0)
        assert used == self.num_used, (used, self.num_used)
        assert len(self.free) + len(self.cached_free) + used == self.num_blocks, (
            len(self.free), len(self.cached_free), used, self.num_blocks)
        assert all(self.ref_count[b] == 0 and self.block_hash[b] is None for b in self.free)
        assert all(self.ref_count[b] == 0 and self.block_hash[b] is not None for b in self.cached_free)

    # ---- allocation -------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self.cached_free.pop(block, None)
            self.num_used += 1
        self.ref_count[block] += 1

    def _new_block(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.cached_free.popitem(last=False)  # evict the least recently freed
            del self.by_hash[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_count[block] = 1
        self.num_used += 1
        return block

    def compute_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to every full block of its tokens."""
        n = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if n else ROOT_HASH
        seq.block_hashes.extend(block_hashes(seq.token_ids, self.block_size, self.fingerprint, n, parent))

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, leaving at least its last token to compute
        (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        self.compute_hashes(seq)
        limit = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in seq.block_hashes[:limit]:
            block = self.by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def allocate_prefill(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Admit a waiting ``seq``: take its cached prefix and blocks for ``num_new_tokens`` more tokens
        after it. Sets ``seq.num_computed_tokens`` to the cached length. Returns False (taking nothing)
        when the blocks are not there."""
        assert not seq.block_table
        hits = self.cached_prefix(seq)
        cached_tokens = len(hits) * self.block_size
        total = cached_tokens + min(num_new_tokens, seq.num_tokens - cached_tokens)
        need = -(-total // self.block_size) - len(hits)
        hits_on_lru = sum(1 for b in hits if self.ref_count[b] == 0)
        if need > self.num_free_blocks - hits_on_lru:
            return False
        for b in hits:
            self._take(b)
        seq.block_table = hits + [self._new_block() for _ in range(need)]
        seq.num_computed_tokens = cached_tokens
        seq.num_registered_blocks = len(hits)
        seq.num_cached_tokens = cached_tokens
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += cached_tokens
        return True

    def allocate_all(self, seq: Sequence) -> bool:
        """Blocks for every token of ``seq`` with no prefix reuse (the KV will be written from outside,
        as on a decode worker receiving a remote prefill). Returns False when they are not there."""
        need = self.blocks_needed(seq, seq.num_tokens)
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(self._new_block() for _ in range(need))
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running ``seq`` to hold ``num_new_tokens`` more computed tokens. False if out of blocks."""
        need = self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(self._new_block() for _ in range(need))
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are now full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        self.compute_hashes(seq)
        for i in range(seq.num_registered_blocks, full):
            h, block = seq.block_hashes[i], seq.block_table[i]
            if self.block_hash[block] is None and h not in self.by_hash:
                self.block_hash[block] = h
                self.by_hash[h] = block
        seq.num_registered_blocks = full

    def free_seq(self, seq: Sequence) -> None:
        """Release every block of ``seq``. Tail blocks go to the LRU first, so they are evicted first."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.num_used -= 1
                if self.block_hash[block] is None:
                    self.free.append(block)
                else:
                    self.cached_free[block] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (they become plain free blocks)."""
        for block in list(self.cached_free):
            del self.by_hash[self.block_hash[block]]
            self.block_hash[block] = None
            self.free.append(block)
        self.cached_free.clear()
