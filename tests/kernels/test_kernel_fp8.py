"""FP8 (e4m3) per-token quantization and the FP8 linear layer: Triton against the references."""
import pytest
import torch

from kernel_helpers import FP8_TOL_SAME_QUANT, FP8_TOL_UNQUANT, TOL, assert_close, poison_allocations
from tandem.kernels import fp8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (13, 300), (4, 1024)])
def test_quantize_per_token_bit_exact(poison, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * torch.logspace(-3, 2, shape[0], dtype=dtype)[:, None]
    if shape[0] > 1:
        x[1] = 0  # an all-zero row: finite scale, zero codes
    q, s = fp8.quantize_per_token_fp8_triton(x)
    q_ref, s_ref = fp8.quantize_per_token_fp8_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (shape[0],)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert_close(q.double() * s.double()[:, None], x.double(), FP8_TOL_UNQUANT, "dequantized")


@pytest.mark.parametrize("fp8_dot", [False, True], ids=["upcast-dot", "fp8-dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,k,n,bias", [(1, 64, 48, False), (19, 200, 70, True), (40, 96, 33, True)])
def test_fp8_linear(poison, monkeypatch, dtype, t, k, n, bias, fp8_dot):
    # fp8-dot: the e4m3 x e4m3 tensor-core path GPUs from sm_89 take (the interpreter runs it too)
    monkeypatch.setattr(fp8, "_fp8_dot_supported", lambda device: fp8_dot)
    x = torch.randn(t, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) * 0.1
    b = torch.randn(n, dtype=dtype) if bias else None
    w8, ws = fp8.quantize_weight_fp8(w)
    assert w8.shape == (n, k) and ws.shape == (n,)
    out = fp8.fp8_linear_triton(x, w8, ws, b)
    assert out.dtype == dtype and out.shape == (t, n)
    xq, xs = fp8.quantize_per_token_fp8_ref(x)
    same_quant = (xq.double() @ w8.double().t()) * xs.double()[:, None] * ws.double()[None, :]
    exact = x.double() @ w.double().t()
    if b is not None:
        same_quant, exact = same_quant + b.double(), exact + b.double()
    assert_close(out, same_quant, max(FP8_TOL_SAME_QUANT, TOL[dtype]), "fp8 linear vs same quantization")
    assert_close(out, exact, FP8_TOL_UNQUANT, "fp8 linear vs unquantized")
    ref = fp8.fp8_linear_ref(x.double(), w8, ws, None if b is None else b.double())
    assert_close(ref, same_quant, 1e-12, "reference")


def test_fp8_linear_leading_dims():
    x = torch.randn(2, 3, 64)
    w8, ws = fp8.quantize_weight_fp8(torch.randn(32, 64))
    out = fp8.fp8_linear_triton(x, w8, ws)
    assert out.shape == (2, 3, 32)
    assert_close(out, fp8.fp8_linear_ref(x, w8, ws).double(), 1e-5, "leading dims")


def test_poison_catches_an_unwritten_output(monkeypatch):
    """The harness itself: a kernel that leaves an element unwritten must fail."""
    poison_allocations(monkeypatch)
    out = torch.empty(4, 4)
    out[:, :3] = 1.0
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(out, torch.ones(4, 4, dtype=torch.float64), 1e-4, "partial")
