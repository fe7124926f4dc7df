"""The CPU linear layer (:mod:`tandem.kernels.linear`): the BLAS call it picks per row count gives
``F.linear``'s values, with and without a bias, in each row range: one row and 6 or more in fp32
(oneDNN), 2 to 5 (``(w @ x.T).T``, 3 rows padded to 4), 64 or more in other dtypes (``F.linear``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.linear import linear_ref
from tandem.kernels.ops import select_ops


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 17, 64, 130])   # each BLAS call and its edges
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(dtype, tol, rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(160, 96, generator=g).to(dtype) / 10
    b = torch.randn(160, generator=g).to(dtype) if bias else None
    out = linear_ref(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (rows, 160) and out.dtype == dtype and out.is_contiguous()
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, err


def test_every_backend_has_the_linear_op():
    for backend in ("torch", "triton"):
        assert select_ops(backend).linear(torch.ones(2, 4), torch.eye(4)).tolist() == [[1.0] * 4] * 2
