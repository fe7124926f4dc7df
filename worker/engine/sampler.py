"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al., "The Curious Case of Neural
Text Degeneration", 2020), OpenAI's presence/frequency penalties and logit bias, the repetition penalty
(Keskar et al., "CTRL", 2019, as vLLM applies it), per-request seeds, and log-probabilities.

No finite input makes a probability non-finite: non-finite logits are mapped to finite ones (NaN to
-inf, +inf to the largest float) before the softmax, and a row left without probability mass falls
back to the greedy token, so ``torch.multinomial`` never sees NaN, inf or a zero sum.
"""
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


def apply_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """``row`` (``[vocab]`` float32 logits) with ``seq``'s penalties and logit bias applied (a new tensor).

    Presence and frequency penalties count the output tokens (OpenAI's definition); the repetition
    penalty covers prompt and output tokens (vLLM's). Bias entries for ids outside the vocabulary are
    ignored (the engine refuses them at admission)."""
    p = seq.params
    vocab = row.shape[-1]
    row = row.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)), dtype=torch.long,
                            device=row.device)
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        if ids:
            row[torch.tensor(ids, device=row.device)] += torch.tensor(
                [p.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)
    return row


def finite_probs(row: torch.Tensor) -> torch.Tensor | None:
    """Softmax of ``row`` (``[vocab]`` float32 logits, already divided by the temperature) with
    non-finite logits mapped first (NaN -> -inf, +inf -> the dtype's max); None when no token keeps
    any probability (every logit -inf or NaN), where the caller samples greedily."""
    row = torch.nan_to_num(row.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    if not torch.isfinite(row).any():
        return None
    probs = torch.softmax(row, dim=-1)
    if not torch.isfinite(probs).all() or float(probs.sum()) <= 0.0:
        return None
    return probs


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
        row = apply_penalties(logits[i], seq) if p.penalized else logits[i]
        if p.temperature == 0.0:
            tok = int(row.argmax()) if p.penalized else greedy[i]
        else:
            row = row / p.temperature
            if 0 < p.top_k < row.shape[-1]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = finite_probs(row)
            if probs is not None and p.top_p < 1.0:
                sorted_p, idx = probs.sort(descending=True)
                # keep the smallest prefix whose mass reaches top_p (the top token always stays)
                drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
            if probs is None:
                tok = int(row.argmax()) if p.penalized else greedy[i]
            else:
                tok = int(torch.multinomial(probs, 1, generator=_generator(seq, logits.device)))
        res = SampleResult(tok)
        if p.logprobs is not None:
            res.logprob = float(logp[i, tok])
            if p.logprobs > 0:
                v, ix = logp[i].topk(p.logprobs)
                res.top_logprobs = list(zip(ix.tolist(), v.tolist()))
        out.append(res)
    return out
