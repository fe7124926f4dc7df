"""The dense linear layer ``x @ w.T (+ bias)``, with the BLAS call chosen for small-batch decode on CPUs.

A decode step's matmuls have few rows (one per running sequence) against weights far bigger than the
caches, so each one should read its weight once, at memory bandwidth. ``F.linear`` on a CPU does that
for one row (a matrix-vector product), but from two rows on it goes through MKL's GEMM with the weight
as the transposed operand, which on the CPUs measured here (AMD EPYC, AVX2, MKL 2024.2) takes about as
long for 2 rows as for 8 and 2x as long as for one: a batch-2 decode step cost 2x a batch-1 step.
Asking for the same product the other way round, ``(w @ x.T).T``, puts the weight in the non-transposed
operand, and for 2 to 128 rows it runs 1.3-2.5x faster; for one row, oneDNN's linear
(``mkldnn._linear_pointwise``, the op Inductor emits for CPU linears) beats MKL's matrix-vector product
by about 1.3x. Figures and the command that measures them: docs/cpu.md.

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
    if x.shape[0] == 1 and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    out = torch.mm(w, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)

