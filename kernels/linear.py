"""The dense linear layer ``x @ w.T (+ bias)``, with the BLAS call chosen for small-batch decode on CPUs.

A decode step's matmuls have few rows (one per running sequence) against weights far bigger than the
caches, so each one should read its weight once, at memory bandwidth. ``F.linear`` on a CPU does that
for one row (a matrix-vector product), but from two rows on it goes through MKL's GEMM with the weight
as the transposed operand, which on the CPUs measured here (AMD EPYC, AVX2, MKL 2024.2) takes about as
long for 2 rows as for 8 and 2x as long as for one: a batch-2 decode step cost 2x a batch-1 step.
Asking for the same product the other way round, ``(w @ x.T).T``, puts the weight in the non-transposed
operand, and for 2 to 5 rows it runs 1.5-2x faster. For one row, and from 6 rows on (larger decode
batches and prefill), oneDNN's linear (``mkldnn._linear_pointwise``, the op Inductor emits for CPU
linears) is the fastest: 1.3x MKL's matrix-vector product at one row, 1.1-1.6x F.linear above. The
transposed product must be copied back to row-major, and at prefill sizes that copy made it slower than
F.linear (0.84x at 512 rows). Figures and the command that measures them: docs/cpu.md.

GPUs keep ``F.linear`` (cuBLAS picks its own kernel per shape).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)``: :func:`linear` (the reference and the Triton backends share it)."""
    return linear(x, w, bias)


def linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton backends' linear: ``F.linear`` on a GPU (cuBLAS picks its kernel per shape), the CPU
    choice of :func:`linear` elsewhere."""
    return linear(x, w, bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)``.

    Args:
        x: ``[M, K]`` activations (float32, bfloat16 or float16).
        w: ``[N, K]`` weight, same dtype and device.
        bias: ``[N]`` or None.

    Returns:
        ``[M, N]``, contiguous, in ``x``'s dtype: the same values as ``F.linear`` up to summation order.
    """
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, w, bias)
    m = x.shape[0]
    if x.dtype == torch.float32 and not SMALL_BATCH[0] <= m < SMALL_BATCH[1]:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if m >= PREFILL_ROWS:
        return F.linear(x, w, bias)
    pad = PAD_ROWS.get(m, m) - m
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.mm(w, x.t()).t()
    out = (out[:m] if pad else out).contiguous()
    return out if bias is None else out.add_(bias)


#: fp32 row counts ``[lo, hi)`` that take ``(w @ x.T).T``; oneDNN's linear takes the rest. Below ``hi``
#: the transposed product wins (2.2x F.linear at 2 rows, where oneDNN gives 1.7x); from ``hi`` rows on,
#: oneDNN is as fast or faster (6 and 7 rows: 67 and 72 ms against 78 and 91 ms a pass over the
#: weights), and from 64 rows (prefill) the transposed product's copy back to row-major makes it slower
#: than F.linear (0.84x at 512 rows). Measured with bench/linear_cpu.py.
SMALL_BATCH = (2, 6)
#: Row counts run as more rows (zeros, sliced off): MKL's GEMM with 3 columns took 1.4x its time with
#: 4 on one thread (97 against 69 ms a pass over the weights) and 1.1x on two; 5 and 7 do not gain.
PAD_ROWS = {3: 4}
#: Rows from which other dtypes take F.linear (the transposed product's copy costs more than it saves).
PREFILL_ROWS = 64

