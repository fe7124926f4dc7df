"""FP8 (e4m3) linear layers: per-token activation scales, per-output-channel weight scales.

The scheme is the "dynamic per-token, static per-channel" W8A8 of vLLM's ``fp8`` quantization:

* a weight ``w [N, K]`` is quantized once at load time, each output row with its own scale
  ``w_scale[n] = max|w[n, :]| / 448`` (:func:`quantize_weight_fp8`);
* each step's activations ``x [T, K]`` are quantized per token, ``x_scale[t] = max|x[t, :]| / 448``;
* ``y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n] (+ bias[n])``, accumulated in
  float32 and returned in ``x``'s dtype.

448 is the largest finite e4m3 value; quantized values are saturated to +-448, never NaN.
The FP8 KV cache uses a per-tensor ``kv_scale`` instead: see ``tandem.kernels.rope.to_cache_dtype``.
"""
from __future__ import annotations

import torch

from ._triton import interpreting, next_pow2, tl, to_fp8_e4m3, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_INV_FP8_MAX = 1.0 / FP8_MAX
_MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row gets a tiny scale, not a division by zero


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    # times the float32 reciprocal, not a division: PyTorch on CUDA divides by a scalar that way,
    # so this one expression gives the same bits on the CPU, on CUDA and in the Triton kernel
    scale = (xf.abs().amax(dim=-1) * _INV_FP8_MAX).clamp(min=_MIN_SCALE)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_token_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x [T, K]``: returns ``(x_fp8 [T, K] float8_e4m3fn, scale [T] float32)``
    with ``x ~= x_fp8.float() * scale[:, None]``.
    """
    return _quantize_rows(x)


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight ``w [N, K]`` per output channel: ``(w_fp8 [N, K], scale [N] float32)``.

    Runs once at load time, so it is plain torch on every backend.
    """
    return _quantize_rows(w)


def fp8_linear_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(w_fp8 [N, K]).T (+ bias)`` with ``x`` quantized per token; ``[..., N]``
    in ``x``'s dtype. The product of the quantized values is accumulated in float32 (float64 when
    ``x`` is float64, for tests).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_per_token_fp8_ref(x.reshape(-1, k))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = (xq.to(acc) @ w_fp8.to(acc).t()) * xs.to(acc)[:, None] * w_scale.to(acc)[None, :]
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype).reshape(*lead, w_fp8.shape[0])


# --------------------------------------------------------------------------------------------------
# Triton

@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, min_scale,
                          BLOCK: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) * (1.0 / 448.0), min_scale)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        # div_rn: on a GPU Triton's float32 `/` is the approximate div.full, torch's is IEEE-rounded
        tl.store(q_ptr + row * K + cols, to_fp8_e4m3(tl.math.div_rn(x, scale), INTERP), mask=cols < K)


def quantize_per_token_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`quantize_per_token_fp8_ref` (bit-identical results)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    q = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((t,), dtype=torch.float32, device=x.device)
    if t > 0:
        block = min(4096 if not interpreting() else 256, next_pow2(k))
        _quantize_rows_kernel[(t,)](x, q, s, k, x.stride(0), _MIN_SCALE, BLOCK=block,
                                    INTERP=interpreting(), num_warps=4 if block >= 1024 else 1)
    return q, s


@triton.jit
def _fp8_matmul_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                       stride_am, stride_bn, stride_cm,
                       HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    # grouped ordering of the output tiles, so neighbouring programs share weight tiles in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_bn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if FP8_DOT:
            acc = tl.dot(a, tl.trans(b), acc)
        else:  # the interpreter and pre-Ada GPUs: e4m3 values are exact in float32
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    a_s = tl.load(as_ptr + rm, mask=rm < M, other=0.0)
    b_s = tl.load(bs_ptr + rn, mask=rn < N, other=0.0)
    c = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], c.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _fp8_dot_supported(device: torch.device) -> bool:
    if interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear_triton(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`fp8_linear_ref`: per-token quantization, then an FP8 GEMM (tensor
    cores on sm_89+) with both scales and the bias applied in the epilogue.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = w_fp8.shape[0]
    xq, xs = quantize_per_token_fp8_triton(x.reshape(-1, k))
    m = xq.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        if w_fp8.stride(-1) != 1:
            w_fp8 = w_fp8.contiguous()
        if interpreting():
            bm, bn, bk, warps, stages = 32, 64, 64, 1, 1  # few, larger programs: the interpreter pays per program
        else:
            bm = min(128, max(16, next_pow2(m)))
            bn, bk = (128, 128) if m > 64 else (64, 128)
            warps, stages = (8, 4) if bm >= 128 else (4, 4)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _fp8_matmul_kernel[grid](xq, w_fp8, xs, w_scale, bias if bias is not None else xs, out,
                                 m, n, k, xq.stride(0), w_fp8.stride(0), out.stride(0),
                                 HAS_BIAS=bias is not None, FP8_DOT=_fp8_dot_supported(x.device),
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                 num_warps=warps, num_stages=stages)
    return out.reshape(*lead, n)
