"""The INT8 weight-only linear layer (:mod:`tandem.kernels.int8`): the C kernel, built here with the
host's compiler, gives the product over the dequantized weight in every row range and shape edge; where
no compiler is found it says so once and torch's kernel gives the same values."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import int8


def _case(rows: int, n: int, k: int, bias: bool):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g) / 10
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    q, s = int8.quantize_weight_int8(w)
    ref = F.linear(x.double(), q.double() * s.double()[:, None], None if b is None else b.double())
    return x, q, s, b, ref


def test_the_c_kernel_builds_here():
    assert int8.native() is not None     # a compiler is on this machine: the fast path must be the one run
    assert list(int8._cache_dir().glob("w8_linear-*.so"))


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, int8.DEQUANT_ROWS])   # decode rows, prefill, dequant
@pytest.mark.parametrize("n,k", [(160, 96), (157, 100)])               # N off the 4-row tile, K off 8 lanes
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_the_product_over_the_dequantized_weight(rows, n, k, bias):
    x, q, s, b, ref = _case(rows, n, k, bias)
    out = int8.int8_linear(x, q, s, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err


def test_int8_linear_on_two_threads_equals_one():
    x, q, s, b, _ = _case(4, 1030, 576, True)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8.int8_linear(x, q, s, b)
        torch.set_num_threads(2)
        two = int8.int8_linear(x, q, s, b)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)     # rows are split among threads, each row's sum is the same code


def test_without_a_compiler_torch_kernel_takes_over(monkeypatch, tmp_path, caplog):
    """A host without a C compiler (stand-in: CC names a missing program, and an empty cache)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    int8.native.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.kernels.int8"):
            assert int8.native() is None
        assert "could not be built" in caplog.text
        x, q, s, b, ref = _case(3, 160, 96, True)
        err = ((int8.int8_linear(x, q, s, b).double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, err
    finally:
        int8.native.cache_clear()


def test_a_broken_build_is_not_cached(monkeypatch, tmp_path):
    """A compiler that fails after writing part of its output leaves no library for the next process
    to load (stand-in: a script that writes to its ``-o`` file, then fails)."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && printf half > "$2"; shift; done\n'
                  "echo 'cc: error: no' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    int8.native.cache_clear()
    try:
        assert int8.native() is None
        assert not list((tmp_path / "cache").rglob("*.so"))
    finally:
        int8.native.cache_clear()
