"""SiLU-and-mul, the gated activation of Llama's MLP (Shazeer, "GLU Variants Improve Transformer", 2020)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``silu(x[..., :I]) * x[..., I:]``.

    Args:
        x: ``[T, 2*I]``, the fused gate and up projections (gate first).

    Returns:
        ``[T, I]`` in the dtype of ``x``.
    """
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# --------------------------------------------------------------------------------------------------
# Triton: a 2-D grid (rows x column blocks); silu in float32, the product rounded once per step as
# the reference does.

from ._triton import next_pow2, tl, triton  # noqa: E402


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * I + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_ref`: ``[T, 2*I] -> [T, I]``."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t > 0 and d > 0:
        block = min(1024, next_pow2(d))
        _silu_and_mul_kernel[(t, triton.cdiv(d, block))](x2, out, d, x2.stride(0), BLOCK=block,
                                                         num_warps=4)
    return out.view(*x.shape[:-1], d)
