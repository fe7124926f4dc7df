"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al., "The Curious Case of Neural
Text Degeneration", 2020), per-request seeds, and log-probabilities."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.worker.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None                       # of the sampled token, raw distribution
    top_logprobs: list[tuple[int, float]] | None = None


def _generator(seq: Sequence, device) -> torch.Generator | None:
    if seq.params.seed is None:
        return None
    # Keyed by (seed, output index): the same token comes out after a preemption and recompute.
    g = torch.Generator(device=device)
    g.manual_seed((seq.params.seed * 1_000_003 + len(seq.output_token_ids)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    """Pick one token per row.

    Args:
        logits: ``[S, vocab]`` float32, row ``i`` belonging to ``seqs[i]``.

    Returns:
        One :class:`SampleResult` per sequence.
    """
    greedy = logits.argmax(dim=-1).tolist()
    want_lp = any(s.params.logprobs is not None for s in seqs)
    logp = torch.log_softmax(logits, dim=-1) if want_lp else None
    out = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.temperature == 0.0:
            tok = greedy[i]
        else:
            row = logits[i] / p.temperature
            if 0 < p.top_k < row.shape[-1]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_p, idx = probs.sort(descending=True)
                # keep the smallest prefix whose mass reaches top_p (the top token always stays)
                drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
            tok = int(torch.multinomial(probs, 1, generator=_generator(seq, logits.device)))
        res = SampleResult(tok)
        if p.logprobs is not None:
            res.logprob = float(logp[i, tok])
            if p.logprobs > 0:
                v, ix = logp[i].topk(p.logprobs)
                res.top_logprobs = list(zip(ix.tolist(), v.tolist()))
        out.append(res)
    return out
