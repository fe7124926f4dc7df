"""Paged decode attention in Triton: flash-decoding (split-K) with a reduction kernel.

One query token per sequence attends to its whole paged context. Decode is bound by reading the KV
cache, so the kernel is built to read every cached byte once and keep the chip busy at small batch:

* **GQA packing.** One program serves all ``Hq / Hk`` query heads that share a KV head, so each K/V
  tile is loaded once per KV head (not once per query head). The query heads form the M side of a
  ``tl.dot`` (padded to 16, the smallest MMA tile).
* **Split-K** (Dao et al., "Flash-Decoding for long-context inference", 2023). The context is cut into
  ``num_splits`` ranges so that ``B * Hk * num_splits`` programs fill the GPU even at batch 1. Each
  program runs an online softmax over its range and writes an unnormalised partial output with its
  log-sum-exp (base 2); :func:`_decode_reduce_kernel` merges the partials. With one split the first
  kernel writes the output directly and the reduction is skipped.
* **Paging.** A tile of ``BLOCK_N`` tokens may span pages: each token's page comes from the block
  table (``page = table[tok // block_size]``), so any block size works.
* **No host sync.** The split count is derived from the block table's width (an upper bound of the
  context), never from ``seq_lens`` values, so a decode step can be captured in a CUDA graph.
* **FP8 cache.** K/V stored as float8 e4m3 are upcast on load; ``kv_scale`` is folded into the softmax
  scale (for K) and into the final normalisation (for V), costing nothing per element.
"""
from __future__ import annotations

import math

import torch

from ._triton import dot_precision, interpreting, next_pow2, sm_count, tl, triton
from .paged import check_paged_inputs, load_kv_tile, online_softmax_step

# Tile sizes, by environment. Benchmarks may overwrite these (see bench/gpu_kernels.py).
DECODE_CONFIG = {
    "gpu": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "max_splits": 64, "waves": 2},
    "interpret": {"BLOCK_N": 16, "num_warps": 1, "num_stages": 1, "max_splits": 4, "waves": 1},
}


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
                         stride_qb, stride_qh, stride_k0, stride_k1, stride_k2,
                         stride_v0, stride_v1, stride_v2, stride_bt, stride_ob, stride_oh,
                         qk_scale, out_scale, block_size, split_len, num_splits,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                         PREC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < D
    qh = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        k, v = load_kv_tile(k_ptr, v_ptr, bt_row, tok, tmask, kvh, block_size, stride_k0, stride_k1,
                            stride_k2, stride_v0, stride_v1, stride_v2, d, dmask)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, tmask[None, :], qk_scale, True, PREC)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    omask = gmask[:, None] & dmask[None, :]
    if DIRECT:
        o = acc / l_safe[:, None] * out_scale
        tl.store(out_ptr + b * stride_ob + qh[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials: mid_o [B, Hq, S, D_PAD] fp32, mid_lse [B, Hq, S] fp32 (log2 domain)
        row = (b * (GROUP * tl.num_programs(1)) + qh) * num_splits + split
        tl.store(mid_o_ptr + row[:, None] * D_PAD + d[None, :], acc / l_safe[:, None], mask=omask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
                          out_scale, D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * num_splits
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < num_splits
    lse = tl.load(mid_lse_ptr + row0 + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty: avoid -inf - -inf
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    o = tl.load(mid_o_ptr + (row0 + s)[:, None] * D_PAD + d[None, :],
                mask=smask[:, None] & (d < D)[None, :], other=0.0)
    # an empty context (a CUDA-graph padding row with seq_len 0) gives zeros, not 0/0
    o = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1e-30) * out_scale
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def _num_splits(bsz: int, hk: int, bound_len: int, block_n: int, device, cfg) -> int:
    tiles = max(1, triton.cdiv(bound_len, block_n))
    want = max(1, triton.cdiv(cfg["waves"] * sm_count(device), max(1, bsz * hk)))
    return max(1, min(tiles, want, cfg["max_splits"]))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            kv_scale: float = 1.0, num_splits: int | None = None) -> torch.Tensor:
    """Triton version of :func:`tandem.kernels.attention.decode_attention_ref` (same arguments).

    ``num_splits`` forces the split count (tests and benchmarks); by default it is chosen from the
    batch, the KV heads and the block table's width, without reading ``seq_lens`` on the host.
    """
    q = check_paged_inputs("decode_attention", q, k_cache, v_cache)
    bsz, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    cfg = DECODE_CONFIG["interpret" if interpreting() else "gpu"]
    block_n = cfg["BLOCK_N"]
    group = hq // hk
    bound = block_tables.shape[1] * block_size
    splits = num_splits or _num_splits(bsz, hk, bound, block_n, q.device, cfg)
    split_len = triton.cdiv(triton.cdiv(bound, splits), block_n) * block_n
    splits = max(1, triton.cdiv(bound, split_len))
    d_pad = next_pow2(d)
    direct = splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty((bsz, hq, splits, d_pad), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bsz, hq, splits), dtype=torch.float32, device=q.device)
    qk_scale = float(scale) * float(kv_scale) * math.log2(math.e)
    _decode_split_kernel[(bsz, hk, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), qk_scale, float(kv_scale), block_size, split_len, splits,
        GROUP=group, G_PAD=max(16, next_pow2(group)), D=d, D_PAD=d_pad, BLOCK_N=block_n,
        DIRECT=direct, PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    if not direct:
        _decode_reduce_kernel[(bsz, hq)](mid_o, mid_lse, out, out.stride(0), out.stride(1), splits,
                                         float(kv_scale), D=d, D_PAD=d_pad, S_PAD=next_pow2(splits),
                                         num_warps=4 if not interpreting() else 1)
    return out
