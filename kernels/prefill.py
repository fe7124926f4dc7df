"""Paged varlen causal prefill attention in Triton, FlashAttention-2 style (Dao, 2023).

Every query chunk is the tail of its sequence: the chunk's K/V were written to the paged cache by
``rope_and_cache`` just before, and the cached prefix (an earlier chunk, or a prefix-cache hit) sits
in front of it in the same block table. So one kernel serves plain prefill, chunked prefill and
prefix-cache hits: query ``i`` of a chunk of ``q_len`` tokens in a sequence of ``L`` sits at position
``L - q_len + i`` and sees keys ``0 .. L - q_len + i``.

* **Grid without a host sync.** Programs are laid out as ``(ceil(T / BLOCK_M) + B, Hq)``: sequence
  ``b``'s query tiles start at program ``cu_seqlens[b] // BLOCK_M + b``, an upper bound that never
  overlaps the next sequence's. Each program finds its sequence by binary search over
  ``cu_seqlens`` (as vLLM's unified Triton attention does); surplus programs exit at once. Within a
  sequence the tiles run last-first: the long ones (near the end of the causal triangle) start early.
* **Online softmax** in base 2 with the scale folded into one multiply; the row max and sum stay in
  float32 registers, the output tile is normalised once at the end.
* **Two loops per tile**: the KV tiles wholly below the diagonal run without a mask; only the tiles
  that cross the diagonal (at most ``BLOCK_M / BLOCK_N + 1``) pay for the causal mask.
* **Paged reads.** Each K/V tile gathers its rows through the block table, so any block size works;
  for a tile inside one page the addresses are contiguous rows of ``Hk * D``.
* **GQA** maps query head ``h`` to KV head ``h // (Hq / Hk)``; programs of one KV head run side by side
  and share its tiles through L2.
* **FP8 cache**: as in :mod:`tandem.kernels.decode`, ``kv_scale`` is folded into the softmax scale
  and the final normalisation.
"""
from __future__ import annotations

import math

import torch

from ._triton import dot_precision, interpreting, next_pow2, tl, triton
from .paged import check_paged_inputs, load_kv_tile, online_softmax_step

# Tile configurations by head dim and environment; benchmarks may overwrite entries.
PREFILL_CONFIG = {
    # (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs on a GPU, keyed by padded head dim;
    # at d=128, 128x64 / 8 warps / 3 stages compiles for sm_90 to wgmma (HGMMA) with cp.async
    # pipelining, 195 registers, 96 KB shared memory, no spills
    "gpu16": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)},
    # float32 inputs (tf32x3 dots): smaller tiles; chosen so that ptxas reports no spills on sm_90
    # (bench/gpu_compile_check.py)
    "gpu32": {64: (64, 32, 4, 2), 128: (64, 16, 4, 1), 256: (32, 16, 4, 1)},
    "interpret": (16, 16, 1, 1),
    # TMA (tensor-descriptor) loads where the block size allows (block_size % BLOCK_N == 0, so 64 or
    # more tokens per block on GPUs). Off until a GPU run shows it faster: compiled for sm_90 it uses
    # UTMALDG + wgmma with 138 registers instead of 195 (bench/gpu.sh sweep compares both).
    "tma": False,
}


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from ``triton.set_allocator``; its setting
    is per thread (a ContextVar), so install ours in the calling thread unless one is there."""
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)


def _use_tma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, d_pad: int) -> bool:
    """TMA loads apply when every KV tile lies inside one page (``block_size % BLOCK_N == 0``), the
    head dim is a power of two and the tensors are dense; on Hopper or later, or the interpreter."""
    if not PREFILL_CONFIG["tma"] or k_cache.shape[1] % block_n or d_pad != q.shape[-1]:
        return False
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if not interpreting() and (q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9):
        return False
    _ensure_allocator()
    return True


def prefill_config(d_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if interpreting():
        return PREFILL_CONFIG["interpret"]
    table = PREFILL_CONFIG["gpu32" if dtype == torch.float32 else "gpu16"]
    return table.get(d_pad) or table[min(table, key=lambda k: abs(k - d_pad))]


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_src, v_src, bt_row, n0, kvh, q_pos, seq_len, block_size,
                 stride_k0, stride_k1, stride_k2, stride_v0, stride_v1, stride_v2, qk_scale,
                 d, dmask, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                 TMA: tl.constexpr, D: tl.constexpr):
    tok = n0 + tl.arange(0, BLOCK_N)
    tmask = tok < seq_len
    if TMA:  # the tile lies in one page: one bulk copy per tensor, rows (page, offset) of the cache
        row = tl.load(bt_row + n0 // block_size) * block_size + n0 % block_size
        k = k_src.load([row, kvh * D])
        v = v_src.load([row, kvh * D])
        if MASKED:  # rows past the sequence are stale slots: keep a NaN there out of p @ v
            v = tl.where(tmask[:, None], v, 0.0)
    else:
        k, v = load_kv_tile(k_src, v_src, bt_row, tok, tmask, kvh, block_size, stride_k0, stride_k1,
                            stride_k2, stride_v0, stride_v1, stride_v2, d, dmask)
    keep = (tok[None, :] <= q_pos[:, None]) & tmask[None, :]
    return online_softmax_step(acc, m_i, l_i, q, k, v, keep, qk_scale, MASKED, PREC)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, num_seqs,
                    stride_qt, stride_qh, stride_k0, stride_k1, stride_k2,
                    stride_v0, stride_v1, stride_v2, stride_bt, stride_ot, stride_oh,
                    qk_scale, out_scale, block_size, num_tokens, cache_rows, kv_row_len, q_row_len,
                    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                    TMA: tl.constexpr):
    pid = tl.program_id(0)
    qh = tl.program_id(1)
    kvh = qh // GROUP
    # the last sequence b with cu[b] // BLOCK_M + b <= pid
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(cu_ptr + mid) // BLOCK_M + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid - 1)
    b = lo
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    local = pid - (q_start // BLOCK_M + b)
    num_tiles = (q_len + BLOCK_M - 1) // BLOCK_M
    # the last (longest, causal) tiles of a sequence go first, so short ones fill the tail of the grid
    m0 = (num_tiles - 1 - local) * BLOCK_M
    if local < num_tiles:
        seq_len = tl.load(lens_ptr + b)
        prefix = seq_len - q_len
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        q_pos = prefix + rows
        d = tl.arange(0, D_PAD)
        dmask = d < D
        tok_idx = (q_start + rows).to(tl.int64)
        if TMA:  # tensor descriptors (Hopper's TMA): the caches as [blocks * block_size, Hk * D]
            k_src = tl.make_tensor_descriptor(k_ptr, shape=[cache_rows, kv_row_len],
                                              strides=[kv_row_len, 1], block_shape=[BLOCK_N, D])
            v_src = tl.make_tensor_descriptor(v_ptr, shape=[cache_rows, kv_row_len],
                                              strides=[kv_row_len, 1], block_shape=[BLOCK_N, D])
            q_desc = tl.make_tensor_descriptor(q_ptr, shape=[num_tokens, q_row_len],
                                               strides=[q_row_len, 1], block_shape=[BLOCK_M, D])
            q = q_desc.load([q_start + m0, qh * D])  # rows of the next sequence: loaded, never stored
        else:
            k_src = k_ptr
            v_src = v_ptr
            q = tl.load(q_ptr + tok_idx[:, None] * stride_qt + qh * stride_qh + d[None, :],
                        mask=rmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        # keys visible to every row of the tile: [0, prefix + m0 + 1); the diagonal band after it
        n_full = ((prefix + m0 + 1) // BLOCK_N) * BLOCK_N
        n_end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
        for n0 in range(0, n_full, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_src, v_src, bt_row, n0, kvh, q_pos,
                                         seq_len, block_size, stride_k0, stride_k1, stride_k2,
                                         stride_v0, stride_v1, stride_v2, qk_scale, d, dmask,
                                         False, BLOCK_N, PREC, TMA, D)
        for n0 in range(n_full, n_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_src, v_src, bt_row, n0, kvh, q_pos,
                                         seq_len, block_size, stride_k0, stride_k1, stride_k2,
                                         stride_v0, stride_v1, stride_v2, qk_scale, d, dmask,
                                         True, BLOCK_N, PREC, TMA, D)
        o = acc / l_i[:, None] * out_scale
        tl.store(out_ptr + tok_idx[:, None] * stride_ot + qh * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float, kv_scale: float = 1.0
                             ) -> torch.Tensor:
    """Triton version of :func:`tandem.kernels.attention.prefill_attention_ref` (same arguments)."""
    q = check_paged_inputs("prefill_attention", q, k_cache, v_cache)
    t, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    d_pad = next_pow2(d)
    block_m, block_n, warps, stages = prefill_config(d_pad, q.dtype)
    tma = _use_tma(q, k_cache, v_cache, block_n, d_pad)
    grid = (triton.cdiv(t, block_m) + num_seqs, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, num_seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale) * float(kv_scale) * math.log2(math.e),
        float(kv_scale), block_size, t, k_cache.shape[0] * block_size, hk * d, hq * d,
        GROUP=hq // hk, D=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        PREC=dot_precision(q.dtype), TMA=tma, num_warps=warps, num_stages=stages)
    return out
