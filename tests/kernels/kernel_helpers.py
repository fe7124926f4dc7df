"""Shared helpers of the kernel tests: tolerances, error measure, NaN-poisoned allocations."""
from __future__ import annotations

import torch

# docs/architecture.md, relative error ||out - ref|| / ||ref|| against a float64 reference
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
FP8_TOL_SAME_QUANT = 1e-3
FP8_TOL_UNQUANT = 5e-2
DTYPES = [torch.float32, torch.float16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; NaN (an unwritten, poisoned element) makes it NaN, which fails every <=."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out.double()).any(), f"{what}: NaN in output (unwritten element?)"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _nan_fill(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and t.numel():
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        else:
            t.fill_(float("nan"))
    return t


def poison_allocations(monkeypatch) -> None:
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*a, **kw):
        return _nan_fill(real_empty(*a, **kw))

    def empty_like(*a, **kw):
        return _nan_fill(real_empty_like(*a, **kw))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
