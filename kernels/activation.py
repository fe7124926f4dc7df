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
