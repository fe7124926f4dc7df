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
    original_max_position_embeddings}`` (Llama 3.1), ``{"rope_type": "linear", "factor": f}``, or
    ``{"rope_type": "freq_factors", "factors": [head_dim / 2 floats]}`` (a GGUF's ``rope_freqs``
    tensor: each frequency divided by its factor, as llama.cpp's ``rope_ext`` does).
    Raises ValueError for another rope_type or a factor list of the wrong length.
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
        elif kind == "freq_factors":
            factors = torch.tensor(rope_scaling["factors"], dtype=torch.float64)
            if factors.shape != inv_freq.shape:
                raise ValueError(f"rope freq_factors: {factors.numel()} factors for head_dim {head_dim} "
                                 f"(expected {inv_freq.numel()})")
            inv_freq = inv_freq / factors
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, freq_factors)")
    t = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the angles of ``positions [T]``; returns a new tensor of x's dtype."""
    return _rotate(x, *_angles(positions, cos_sin_cache))


def _angles(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[T, 1, D/2]`` float32, for ``positions [T]``."""
    cos, sin = cos_sin_cache.index_select(0, positions).float().unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


FP8_E4M3_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, kv_scale: float = 1.0) -> torch.Tensor:
    """Cast K or V to the cache dtype: ``x / kv_scale``, saturated to +-448 for an FP8 (e4m3) cache.

    A reader gets the value back as ``cache.to(float) * kv_scale``. With ``kv_scale == 1.0`` and a
    float cache this is a plain cast.
    """
    if kv_scale != 1.0:
        x = x.float() / kv_scale
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Scatter ``k, v [T, Hk, D]`` into the paged caches ``[num_blocks, block_size, Hk, D]``.

    ``slot_mapping [T]`` (int64) holds ``block_id * block_size + offset``; a slot of -1 is skipped
    (padding). Values are cast to the cache dtype by :func:`to_cache_dtype` (divided by
    ``kv_scale``, saturated for an FP8 cache).
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    hk, d = k_cache.shape[-2:]
    # index_copy_, not cache[slots] = ...: the indexed assignment is far slower on CPU (docs/cpu.md);
    # an FP8 cache is copied as its bytes (index_copy_ has no float8 kernel on the CPU)
    raw = k_cache.dtype == torch.float8_e4m3fn
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = to_cache_dtype(x, cache.dtype, kv_scale)
        if raw:
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, hk, d).index_copy_(0, slot_mapping, x)


def rope_and_cache_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to ``q [T, Hq, D]`` and ``k [T, Hk, D]``, then write rotated k and ``v [T, Hk, D]``
    into the paged caches at ``slot_mapping [T]``.

    Args:
        positions: ``[T]`` int64 absolute token positions.
        cos_sin_cache: ``[max_position, D]`` from :func:`build_cos_sin_cache`.
        k_cache, v_cache: ``[num_blocks, block_size, Hk, D]``, written in place; float or
            ``torch.float8_e4m3fn`` (then K/V are stored divided by ``kv_scale``).
        kv_scale: per-tensor scale of an FP8 cache (see :func:`to_cache_dtype`); 1.0 otherwise.

    Returns:
        ``(q_rot [T, Hq, D], k_rot [T, Hk, D])`` in the input dtype.
    """
    angles = _angles(positions, cos_sin_cache)   # once for q and k (a decode step runs ~1,000 small ops)
    q, k = _rotate(q, *angles), _rotate(k, *angles)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    return q, k


# --------------------------------------------------------------------------------------------------
# Triton: one program per token rotates all its q and k heads (float32 math, rounded to the input
# dtype like the reference) and scatters the rotated k and v into the paged cache at its slot.

from ._triton import interpreting, next_pow2, tl, to_fp8_e4m3, triton  # noqa: E402


@triton.jit
def _rope_heads(x_ptr, out_ptr, tok, stride_t, stride_h, H, cos, sin,
                HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < H) & (d < HALF)
    base = x_ptr + tok * stride_t + h * stride_h + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * cos - x2f * sin).to(x1.dtype)
    o2 = (x2f * cos + x1f * sin).to(x1.dtype)
    obase = out_ptr + tok * (H * 2 * HALF) + h * (2 * HALF) + d
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _rope_and_cache_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr,
                           qo_ptr, ko_ptr, HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh,
                           stride_vt, stride_vh, stride_cs, block_size,
                           stride_kc0, stride_kc1, stride_kc2, stride_vc0, stride_vc1, stride_vc2,
                           kv_scale,
                           HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                           HALF_PAD: tl.constexpr, SCALED: tl.constexpr, FP8: tl.constexpr,
                           INTERP: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d1 = tl.arange(0, HALF_PAD)
    dm = d1 < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d1, mask=dm, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d1, mask=dm, other=0.0).to(tl.float32)[None, :]
    _rope_heads(q_ptr, qo_ptr, tok, stride_qt, stride_qh, HQ, cos, sin, HALF, HQ_PAD, HALF_PAD)
    k1, k2 = _rope_heads(k_ptr, ko_ptr, tok, stride_kt, stride_kh, HK, cos, sin, HALF, HK_PAD,
                         HALF_PAD)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, HK_PAD)[:, None]
        d = d1[None, :]
        mask = (h < HK) & (d < HALF)
        v1 = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        v2 = tl.load(v_ptr + tok * stride_vt + h * stride_vh + HALF + d, mask=mask, other=0.0)
        # new names for the cached values: a runtime ``if`` may not change an outer variable's type
        ck1, ck2, cv1, cv2 = k1, k2, v1, v2
        if SCALED:
            ck1 = ck1.to(tl.float32) / kv_scale
            ck2 = ck2.to(tl.float32) / kv_scale
            cv1 = cv1.to(tl.float32) / kv_scale
            cv2 = cv2.to(tl.float32) / kv_scale
        if FP8:
            ck1 = to_fp8_e4m3(ck1, INTERP)
            ck2 = to_fp8_e4m3(ck2, INTERP)
            cv1 = to_fp8_e4m3(cv1, INTERP)
            cv2 = to_fp8_e4m3(cv2, INTERP)
        kdst = kc_ptr + blk * stride_kc0 + off * stride_kc1 + h * stride_kc2 + d
        vdst = vc_ptr + blk * stride_vc0 + off * stride_vc1 + h * stride_vc2 + d
        tl.store(kdst, ck1.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(kdst + HALF, ck2.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vdst, cv1.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(vdst + HALF, cv2.to(vc_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_and_cache_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, kv_scale: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rope_and_cache_ref`; q, k, v may be strided views (e.g. of a fused
    qkv projection) as long as the head dim is contiguous. The caches must have a contiguous last dim.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {d}")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cs = _last_dim_contiguous(cos_sin_cache)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dim must be contiguous")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = d // 2
    hq_pad, hk_pad, half_pad = next_pow2(hq), next_pow2(hk), next_pow2(half)
    warps = 1 if hq_pad * half_pad <= 512 else 4 if hq_pad * half_pad <= 4096 else 8
    _rope_and_cache_kernel[(t,)](
        q, k, v, positions, cs, k_cache, v_cache, slot_mapping, q_out, k_out, hq, hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cs.stride(0),
        k_cache.shape[1], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(kv_scale),
        HALF=half, HQ_PAD=hq_pad, HK_PAD=hk_pad, HALF_PAD=half_pad, SCALED=float(kv_scale) != 1.0,
        FP8=k_cache.dtype == torch.float8_e4m3fn, INTERP=interpreting(), num_warps=warps)
    return q_out, k_out
