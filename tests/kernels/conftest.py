"""Kernel tests run Triton under its CPU interpreter; set it before anything imports Triton kernels."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_helpers import poison_allocations  # noqa: E402


@pytest.fixture
def poison(monkeypatch):
    """Fill every float tensor that torch.empty / empty_like hand out with NaN during the test."""
    poison_allocations(monkeypatch)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
