"""The ``flash-attn`` attention backend: FlashAttention-2's CUDA kernels (Dao, 2023) behind our
attention signatures. flash-attn is optional (no wheel on PyPI; its sdist needs CUDA to build), so
it is imported on first use and a missing package raises ImportError with the way out.

FlashAttention-2 reads a paged cache only when the page size is a multiple of 256 tokens. With such
a cache the block table is passed straight through; with smaller blocks (the engine's default is 16)
each call gathers the sequences' K/V into contiguous tensors first, which costs one extra copy of
the context per call. An FP8 cache is dequantized in that gather (FlashAttention-2 has no FP8 path).
"""
from __future__ import annotations

import torch

_PAGED_MULTIPLE = 256


def require() -> None:
    """Raise ImportError (saying how to get it) when flash-attn is not installed."""
    _flash()


def _flash():
    try:
        import flash_attn
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("attentionBackend flash-attn needs the flash-attn package "
                          "(pip install 'tandem-fleet[gpu]' on a CUDA machine), or choose triton") from e
    return flash_attn


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int], dtype: torch.dtype,
            kv_scale: float) -> torch.Tensor:
    """Concatenate every sequence's first ``seq_lens[b]`` positions: ``[sum(seq_lens), Hk, D]``."""
    bs = cache.shape[1]
    parts = []
    for b, length in enumerate(seq_lens):
        nblocks = (length + bs - 1) // bs
        parts.append(cache[block_tables[b, :nblocks].long()].flatten(0, 1)[:length])
    out = torch.cat(parts).to(dtype)
    return out if kv_scale == 1.0 else out * kv_scale


def _usable_paged(k_cache: torch.Tensor, kv_scale: float) -> bool:
    return (k_cache.shape[1] % _PAGED_MULTIPLE == 0 and k_cache.dtype != torch.float8_e4m3fn
            and kv_scale == 1.0)


def prefill_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """flash-attn version of :func:`tandem.kernels.attention.prefill_attention_ref`.

    FlashAttention-2 aligns the causal mask to the bottom right when ``q_len < k_len``, which is
    exactly our "the chunk is the tail of its sequence" rule.
    """
    fa = _flash()
    lens = seq_lens.tolist()
    qlens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.tensor(lens, device=q.device).cumsum(0)
    common = dict(cu_seqlens_q=cu_seqlens_q.int(), cu_seqlens_k=cu_k, max_seqlen_q=max(qlens),
                  max_seqlen_k=max(lens), softmax_scale=scale, causal=True)
    if _usable_paged(k_cache, kv_scale):
        return fa.flash_attn_varlen_func(q, k_cache, v_cache, block_table=block_tables.int(), **common)
    k = _gather(k_cache, block_tables, lens, q.dtype, kv_scale)
    v = _gather(v_cache, block_tables, lens, q.dtype, kv_scale)
    return fa.flash_attn_varlen_func(q, k, v, **common)


def decode_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           kv_scale: float = 1.0) -> torch.Tensor:
    """flash-attn version of :func:`tandem.kernels.attention.decode_attention_ref`."""
    fa = _flash()
    if _usable_paged(k_cache, kv_scale):
        out = fa.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                         cache_seqlens=seq_lens.int(), block_table=block_tables.int(),
                                         softmax_scale=scale, causal=True)
        return out.squeeze(1)
    bsz = q.shape[0]
    cu_q = torch.arange(bsz + 1, dtype=torch.int32, device=q.device)
    return prefill_attention_flash(q, k_cache, v_cache, block_tables, cu_q, seq_lens, scale, kv_scale)
