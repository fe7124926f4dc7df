"""Attention over the paged KV cache: varlen prefill with a cached prefix, and decode.

Paging is vLLM's PagedAttention (Kwon et al., SOSP 2023): each sequence's keys and values live in
fixed-size blocks named by its row of the block table. Prefill treats every query chunk as the tail of
its sequence, so chunked prefill and prefix-cache hits go through the same call: query ``i`` of a chunk
of length ``q_len`` in a sequence of total length ``L`` sits at position ``L - q_len + i`` and attends
to positions ``<= L - q_len + i`` (causal, FlashAttention-2 semantics, Dao 2023).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv_ref(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence: ``[length, Hk, D]`` from ``cache [N, bs, Hk, D]``."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    # index_select, not cache[idx]: on CPU, advanced indexing into the large cache costs ~10 ms per
    # call, index_select microseconds (docs/cpu.md)
    return cache.index_select(0, block_table_row[:nblocks].long()).flatten(0, 1)[:length]


def _dequant(x: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Cache values to ``dtype``: a cast, times ``kv_scale`` when it is not 1 (FP8 cache)."""
    x = x.to(dtype)
    return x if kv_scale == 1.0 else x * kv_scale


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """Causal varlen attention whose keys and values (prefix and new tokens) come from the paged cache.

    The new tokens' K/V must already be in the cache (``rope_and_cache`` writes them).

    Args:
        q: ``[T, Hq, D]`` queries of all sequences, concatenated.
        k_cache, v_cache: ``[num_blocks, block_size, Hk, D]``; ``Hq % Hk == 0`` (GQA).
        block_tables: ``[B, max_blocks]`` int32 block ids.
        cu_seqlens_q: ``[B + 1]`` int32 prefix sums of the query lengths.
        seq_lens: ``[B]`` int32 total lengths (cached prefix + this chunk).
        scale: softmax scale, usually ``D ** -0.5``.
        kv_scale: per-tensor scale of an FP8 (e4m3) cache: the stored values times ``kv_scale`` are
            the keys and values (see ``tandem.kernels.rope.to_cache_dtype``); 1.0 otherwise.

    Returns:
        ``[T, Hq, D]`` in the dtype of ``q``.
    """
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    hq, hk = q.shape[1], k_cache.shape[2]
    for b, length in enumerate(lens):
        qs, qe = cu[b], cu[b + 1]
        qlen = qe - qs
        if qlen == 0:
            continue
        k = _dequant(gather_kv_ref(k_cache, block_tables[b], length).transpose(0, 1), q.dtype, kv_scale)
        v = _dequant(gather_kv_ref(v_cache, block_tables[b], length).transpose(0, 1), q.dtype, kv_scale)
        # 4-D [1, H, L, D]: with 3-D inputs torch's CPU SDPA leaves its flash kernel for the ~6x
        # slower math path
        qb = q[qs:qe].transpose(0, 1)[None]
        k, v = k[None], v[None]
        if qlen == length:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale,
                                               enable_gqa=hq != hk)
        else:
            pos = torch.arange(length - qlen, length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=hq != hk)
        out[qs:qe] = o[0].transpose(0, 1)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         kv_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence against its whole paged context (PagedAttention decode).

    Args:
        q: ``[B, Hq, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, Hk, D]``.
        block_tables: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` int32 context lengths, the current token included (its K/V already cached).
        scale: softmax scale.
        kv_scale: per-tensor scale of an FP8 cache (as in :func:`prefill_attention_ref`).

    Returns:
        ``[B, Hq, D]`` in the dtype of ``q``.
    """
    bsz, hq, d = q.shape
    hk, bs = k_cache.shape[2], k_cache.shape[1]
    lens = seq_lens.tolist()
    max_len = max(lens)
    nblocks = (max_len + bs - 1) // bs
    idx = block_tables[:, :nblocks].reshape(-1).long()
    shape = (bsz, nblocks * bs, hk, d)
    # index_select over the flattened table (see gather_kv_ref for why not k_cache[idx])
    k = _dequant(k_cache.index_select(0, idx).view(shape)[:, :max_len].transpose(1, 2), q.dtype,
                 kv_scale)  # [B, Hk, L, D]
    v = _dequant(v_cache.index_select(0, idx).view(shape)[:, :max_len].transpose(1, 2), q.dtype, kv_scale)
    mask = None
    if min(lens) < max_len:   # equal lengths (always at batch 1) need no mask: ~6 fewer ops a layer
        lens_t = seq_lens.to(q.device)[:, None].long()
        mask = (torch.arange(max_len, device=q.device)[None, :] < lens_t)[:, None, None, :]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hk)
    return o.squeeze(2)


# The Triton versions live one file per kernel family; they take the same arguments as the references.
from .decode import decode_attention_triton  # noqa: E402,F401
from .prefill import prefill_attention_triton  # noqa: E402,F401
