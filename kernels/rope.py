"""Rotary position embedding fused with the paged KV-cache write.

RoPE is from Su et al., "RoFormer" (2021), in the GPT-NeoX "rotate half" layout that Hugging Face's
Llama uses; Llama-3 frequency scaling is applied when the cos/sin cache is built
(:func:`build_cos_sin_cache`). The fused cache write follows vLLM's ``reshape_and_cache``.
"""
from __future__ import annotations

import math

import torch


def build_cos_sin_cache(head_dim: int, max_position: int, base: float,
                        rope_scaling: dict | None = None,
                        dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """Precompute ``[max_position, head_dim]``: cos in the first half of the last dim, sin in the second.

    ``rope_scaling`` may be None, ``{"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}`` (Llama 3.1), or ``{"rope_type": "linear", "factor": f}``.
    Raises ValueError for another rope_type.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind == "llama3":
            factor = rope_scaling["factor"]
            low = rope_scaling.get("low_freq_factor", 1.0)
            high = rope_scaling.get("high_freq_factor", 4.0)
            old_ctx = rope_scaling.get("original_max_position_embeddings", 8192)
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv_freq = torch.where(medium, smoothed, scaled)
        elif kind == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    t = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the angles of ``positions [T]``; returns a new tensor of x's dtype."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.float(), sin.float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Scatter ``k, v [T, Hk, D]`` into the paged caches ``[num_blocks, block_size, Hk, D]``.

    ``slot_mapping [T]`` (int64) holds ``block_id * block_size + offset``; a slot of -1 is skipped
    (padding). Values are cast to the cache dtype.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    hk, d = k_cache.shape[-2:]
    k_cache.view(-1, hk, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, hk, d)[slot_mapping] = v.to(v_cache.dtype)


def rope_and_cache_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to ``q [T, Hq, D]`` and ``k [T, Hk, D]``, then write rotated k and ``v [T, Hk, D]``
    into the paged caches at ``slot_mapping [T]``.

    Args:
        positions: ``[T]`` int64 absolute token positions.
        cos_sin_cache: ``[max_position, D]`` from :func:`build_cos_sin_cache`.
        k_cache, v_cache: ``[num_blocks, block_size, Hk, D]``, written in place.

    Returns:
        ``(q_rot [T, Hq, D], k_rot [T, Hk, D])`` in the input dtype.
    """
    q = apply_rope_ref(q, positions, cos_sin_cache)
    k = apply_rope_ref(k, positions, cos_sin_cache)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k
