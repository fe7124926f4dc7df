"""Import Triton when it is installed; otherwise give stand-ins so the torch references still import.

Every kernel file does ``from ._triton import triton, tl, ...``. Without Triton, decorating a
kernel works but calling a ``*_triton`` op raises ImportError naming the missing package, so a
torch-only install (the CPU worker) never needs Triton. On a machine without CUDA this module
defaults ``TRITON_INTERPRET=1``, so the Triton ops run (slowly) under Triton's CPU interpreter.
"""
from __future__ import annotations

import os

import torch

# Without a CUDA device Triton can only run under its interpreter. Triton reads TRITON_INTERPRET
# when a kernel is decorated, so set it before the kernel modules define theirs; an explicit
# setting (either way) wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on torch-only installs
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise ImportError("triton is not installed: pip install 'tandem-fleet[triton]' "
                              "or use attentionBackend: torch")

    class _Triton:
        @staticmethod
        def jit(fn=None, **_kw):
            return _MissingKernel(fn) if fn is not None else _MissingKernel

        @staticmethod
        def cdiv(a, b):
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n):
            return 1 << max(0, int(n) - 1).bit_length()

    class _Lang:
        constexpr = object()

    triton = _Triton()
    tl = _Lang()


def interpreting() -> bool:
    """True when kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def dot_precision(dtype) -> str:
    """``tl.dot`` precision for a float dtype. fp32 must stay within 1e-4 of float64, which tf32
    (Triton's default, ~3e-4) misses: compiled kernels use ``tf32x3`` (three tf32 tensor-core products,
    about fp32 accuracy; an IEEE fp32 dot runs on FMA units and spills kilobytes of registers at
    attention tile sizes), the interpreter computes in IEEE fp32 anyway."""
    import torch
    if dtype != torch.float32:
        return "tf32"  # ignored for 16-bit operands
    return "ieee" if interpreting() else "tf32x3"


_SM_COUNT: dict = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (a guess of 4 under the interpreter / on the CPU)."""
    import torch
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@triton.jit
def to_fp8_e4m3(x, INTERP: tl.constexpr):
    """Saturate ``x`` to +-448 and cast to float8 e4m3 with round-to-nearest-even.

    Triton 3.9's interpreter rounds float32 -> fp8 wrongly where rounding crosses a power of two
    (31.9 becomes 16), so under the interpreter the value is first rounded onto the e4m3 grid in
    float32 arithmetic (exact: the quantum is a power of two) and the cast is then exact.
    """
    x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    if INTERP:
        e = tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30)))
        quantum = tl.exp2(tl.maximum(e, -6.0) - 3.0)  # 3 mantissa bits; subnormals below 2**-6
        x = ((x / quantum + 12582912.0) - 12582912.0) * quantum  # 1.5 * 2**23: round half to even
    return x.to(tl.float8e4nv)
