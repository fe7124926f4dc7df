"""Triton pieces shared by the paged attention kernels (:mod:`.prefill`, :mod:`.decode`)."""
from __future__ import annotations

from ._triton import tl, triton


def check_paged_inputs(op: str, q, k_cache, v_cache):
    """Validate ``q [T, Hq, D]`` against caches ``[N, block_size, Hk, D]``; returns ``q`` with a
    contiguous head dim. Raises ValueError naming ``op`` on a mismatch or a strided cache head dim."""
    d, hq = q.shape[-1], q.shape[-2]
    hk, dk = k_cache.shape[2], k_cache.shape[3]
    if dk != d or hq % hk:
        raise ValueError(f"{op}: q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{op}: the KV cache's head dim must be contiguous")
    return q if q.stride(-1) == 1 else q.contiguous()


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_row, tok, tmask, kvh, block_size,
                 stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, d, dmask):
    """K and V rows ``[BLOCK_N, D_PAD]`` of positions ``tok`` of one KV head: each position's page comes
    from the sequence's block-table row ``bt_row`` (``page = table[tok // block_size]``), so a tile
    may span pages and any block size works. Masked rows and padded columns read as 0."""
    page = tl.load(bt_row + tok // block_size, mask=tmask, other=0).to(tl.int64)
    slot = tok % block_size
    kmask = tmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_k0 + slot[:, None] * stride_k1 + kvh * stride_k2
                + d[None, :], mask=kmask, other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_v0 + slot[:, None] * stride_v1 + kvh * stride_v2
                + d[None, :], mask=kmask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(acc, m_i, l_i, q, k, v, keep, qk_scale, MASKED: tl.constexpr,
                        PREC: tl.constexpr):
    """One FlashAttention-2 step in base 2: scores ``q k^T * qk_scale`` (``qk_scale`` holds
    ``log2(e)``), entries outside ``keep`` dropped when ``MASKED``, then the running max ``m_i``, sum
    ``l_i`` and unnormalised output ``acc`` (all float32) rescaled and updated. K/V (FP8 caches too)
    are cast to q's dtype for the tensor cores."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
    return acc, m_new, l_i
