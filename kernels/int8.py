"""INT8 weight-only linear layers for CPUs: int8 weights with one scale per output channel,
activations left in the serving dtype (the "W8A16" scheme of gpt-fast and torchao's
``int8_weight_only``; LLM.int8(), Dettmers et al. 2022, is the per-channel absmax it starts from).

A weight ``w [N, K]`` is quantized once at load time: ``scale[n] = max_k |w[n, k]| / 127``,
``q = round(w / scale)`` in ``[-127, 127]``. The product ``x @ w.T`` is computed by torch's
``aten._weight_int8pack_mm`` (the kernel torchao uses on CPUs), which reads the int8 weights and
applies the scales to the output. Weight bytes are a quarter of fp32's (half of bf16's).
"""
from __future__ import annotations

import torch


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] int8, scale [N])`` with ``q * scale[:, None] ~= w``; ``scale`` in ``w``'s dtype
    (the kernel wants the activation dtype), computed in float32. An all-zero row gets scale 1."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(w.dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T (+ bias)``.

    Args:
        x: ``[M, K]`` float32, bfloat16 or float16 activations.
        q: ``[N, K]`` int8 weights; scale: ``[N]`` in ``x``'s dtype (cast if not).
        bias: ``[N]`` or None.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale.to(x.dtype))
    return out if bias is None else out + bias
