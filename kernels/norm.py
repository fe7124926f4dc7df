"""RMSNorm with an optional fused residual add.

RMSNorm is from Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); the fused
residual form follows vLLM's ``fused_add_rms_norm``.
"""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Torch reference of RMSNorm, optionally adding ``residual`` first.

    Args:
        x: ``[T, H]`` activations, any float dtype.
        weight: ``[H]`` scale, same dtype as ``x``.
        eps: variance epsilon.
        residual: optional ``[T, H]``; when given, ``x + residual`` is normalised.

    Returns:
        ``out [T, H]`` (dtype of ``x``) when ``residual`` is None, else ``(out, x + residual)``.
        The statistics are computed in float32, as Hugging Face's ``LlamaRMSNorm`` does.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)
