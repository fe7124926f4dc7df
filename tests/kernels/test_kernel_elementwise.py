"""RMSNorm, SiLU-and-mul and RoPE + KV-cache write: Triton against the float64 reference."""
import pytest
import torch

from kernel_helpers import DTYPES, TOL, assert_close
from tandem.kernels import activation, norm, rope

SHAPES = [(1, 64), (7, 96), (33, 576), (5, 1000)]  # a single token, odd widths, SmolLM2's hidden


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(poison, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.rand(shape[1], dtype=dtype) + 0.5
    out = norm.rms_norm_triton(x, w, 1e-6)
    assert_close(out, norm.rms_norm_ref(x.double(), w.double(), 1e-6), TOL[dtype], "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_residual(poison, dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    r = torch.randn(shape, dtype=dtype)
    w = torch.rand(shape[1], dtype=dtype) + 0.5
    out, res = norm.rms_norm_triton(x, w, 1e-5, residual=r)
    ref_out, ref_res = norm.rms_norm_ref(x.double(), w.double(), 1e-5, residual=r.double())
    assert_close(out, ref_out, TOL[dtype], "rms_norm out")
    assert_close(res, ref_res, TOL[dtype], "rms_norm residual")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (9, 2 * 1536), (4, 2 * 100)])
def test_silu_and_mul(poison, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 2
    out = activation.silu_and_mul_triton(x)
    assert_close(out, activation.silu_and_mul_ref(x.double()), TOL[dtype], "silu_and_mul")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d,scaling,fused", [
    (9, 3, 64, None, True),      # SmolLM2's heads, q/k/v as views of one qkv projection
    (8, 1, 128, LLAMA3, False),  # GQA 8, Llama-3 frequency scaling
    (4, 4, 32, {"rope_type": "linear", "factor": 2.0}, True),
])
def test_rope_and_cache(dtype, hq, hk, d, scaling, fused):
    t, bs, nblocks, max_pos = 11, 4, 8, 200
    if fused:  # strided views, as the engine gets them from a fused projection
        qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    else:
        q, k, v = (torch.randn(t, h, d, dtype=dtype) for h in (hq, hk, hk))
    cs = rope.build_cos_sin_cache(d, max_pos, 10000.0, scaling)
    positions = torch.randint(0, max_pos, (t,))
    slots = torch.randperm(nblocks * bs)[:t]
    slots[3] = -1  # padding: skipped
    slots[7] = -1
    kc = torch.full((nblocks, bs, hk, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    kc_ref, vc_ref = kc.double(), vc.double()
    q_out, k_out = rope.rope_and_cache_triton(q, k, v, positions, cs, kc, vc, slots)
    q_ref, k_ref = rope.rope_and_cache_ref(q.double(), k.double(), v.double(), positions,
                                           cs.double(), kc_ref, vc_ref, slots)
    assert_close(q_out, q_ref, TOL[dtype], "q")
    assert_close(k_out, k_ref, TOL[dtype], "k")
    written = ~torch.isnan(kc_ref)
    assert torch.equal(written, ~torch.isnan(kc)), "wrong cache slots written"
    assert torch.equal(~torch.isnan(vc_ref), ~torch.isnan(vc)), "wrong cache slots written"
    assert int(written.sum()) == (t - 2) * hk * d
    assert_close(kc[written], kc_ref[written], TOL[dtype], "k cache")
    assert_close(vc[written], vc_ref[written], TOL[dtype], "v cache")


@pytest.mark.parametrize("kv_scale", [1.0, 0.05])
def test_rope_and_cache_fp8(kv_scale):
    """An FP8 cache stores k/kv_scale and v/kv_scale, saturated at +-448: bit-equal to the reference."""
    t, hq, hk, d, bs = 6, 4, 2, 64, 4
    q, k, v = (torch.randn(t, h, d) * 8 for h in (hq, hk, hk))
    cs = rope.build_cos_sin_cache(d, 64, 10000.0)
    positions = torch.randint(0, 64, (t,))
    slots = torch.tensor([0, 5, -1, 9, 2, 15])
    kc = torch.zeros(4, bs, hk, d, dtype=torch.float8_e4m3fn)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    rope.rope_and_cache_triton(q, k, v, positions, cs, kc, vc, slots, kv_scale=kv_scale)
    rope.rope_and_cache_ref(q, k, v, positions, cs, kc_ref, vc_ref, slots, kv_scale=kv_scale)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    assert not torch.isnan(kc.float()).any()
