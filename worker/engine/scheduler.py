"""Continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (``max_num_batched_tokens``). Running sequences go first, in arrival
order, so decodes (one token each) are never starved by a long prompt; a prompt that does not fit
in what is left is prefilled in chunks over several steps (Agrawal et al., "Sarathi-Serve", OSDI 2024;
vLLM's chunked prefill). Then waiting sequences are admitted while budget and KV blocks last. When a
running sequence needs a block and none is free, the most recently arrived running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later
(prefix caching usually makes that cheap). Nothing is lost.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.worker.engine.block_manager import BlockManager
from tandem.worker.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    """One step's work: ``(sequence, tokens to compute)``, single-token decodes first."""
    decodes: list[tuple[Sequence, int]] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def items(self) -> list[tuple[Sequence, int]]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    """Decides what each engine step computes.

    Args:
        block_manager: the KV block allocator.
        max_num_batched_tokens: token budget per step.
        max_num_seqs: cap on running sequences.
    """

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.bm = block_manager
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: dict[str, Sequence] = {}   # WAITING_REMOTE, blocks held
        # KV arrived from a prefill worker while the batch was full (max_num_seqs): blocks held,
        # first token sampled, joining the running batch as soon as there is room
        self.handed_over: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.handed_over)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence whose prompt KV is in place (a remote prefill): it joins the running batch now,
        or when the batch has room."""
        seq.status = SeqStatus.RUNNING
        if len(self.running) < self.max_num_seqs:
            self.running.append(seq)
        else:
            self.handed_over.append(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        batch.preempted.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and reserve their KV slots."""
        batch = ScheduledBatch()
        budget = self.budget
        scheduled: set[str] = set()
        while self.handed_over and len(self.running) < self.max_num_seqs:
            self.running.append(self.handed_over.popleft())
        # Running sequences, decodes before chunks in flight, oldest first.
        for seq in sorted(self.running, key=lambda s: (s.in_prefill, s.arrival_time)):
            if budget == 0:
                break
            if seq not in self.running:     # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            while not self.bm.append_slots(seq, n):
                victims = [s for s in self.running if s.request_id not in scheduled]
                victim = max(victims, key=lambda s: s.arrival_time)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                scheduled.add(seq.request_id)
                (batch.decodes if n == 1 else batch.prefills).append((seq, n))
                budget -= n
        # Admit waiting sequences.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.allocate_prefill(seq, budget):
                break
            self.waiting.popleft()
            n = min(seq.num_uncomputed, budget)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            (batch.decodes if n == 1 else batch.prefills).append((seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.handed_over:
            self.handed_over.remove(seq)
        self.remote.pop(seq.request_id, None)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED
