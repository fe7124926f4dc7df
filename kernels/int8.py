"""INT8 weight-only linear layers for CPUs: int8 weights with one scale per output channel,
activations left in the serving dtype (the "W8A16" scheme of gpt-fast and torchao's
``int8_weight_only``; LLM.int8(), Dettmers et al. 2022, is the per-channel absmax it starts from).

A weight ``w [N, K]`` is quantized once at load time: ``scale[n] = max_k |w[n, k]| / 127``,
``q = round(w / scale)`` in ``[-127, 127]``. Weight bytes are a quarter of fp32's (half of bf16's).

The product ``x @ w.T`` for float32 activations runs in our own C kernel (``csrc/w8_linear.c``, built
with the host's C compiler on first use and cached, see :func:`native`), which reads each int8 weight
row once: 2.2-2.7x the fp32 linear layer at 1-2 rows on the AVX2 CPU here. torch's own weight-only
kernel (``aten._weight_int8pack_mm``, torchao's on CPUs) ran 9-34x *slower* than fp32 on that CPU
(docs/cpu.md); it stays the path for other activation dtypes and where no compiler is found. From
:data:`DEQUANT_ROWS` rows (long prefills) the weight is widened to fp32 and the fp32 linear layer runs.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from .linear import linear

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "w8_linear.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
#: Rows from which the weight is widened to fp32 for the fp32 linear layer: below, the C kernel
#: (compute-bound there) is faster; at 512 rows widening + oneDNN took 0.73x its time.
DEQUANT_ROWS = 256


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] int8, scale [N])`` with ``q * scale[:, None] ~= w``; ``scale`` in ``w``'s dtype
    (the kernel wants the activation dtype), computed in float32. An all-zero row gets scale 1."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(w.dtype)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "kernels"


def _host_key() -> str:
    """What ``-march=native`` depends on: the CPU's flags (a cache shared by two hosts must not hand one
    the other's build: an instruction it lacks is a SIGILL, not an error)."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


@functools.cache
def native():
    """The C kernel's ``w8_linear_f32`` (ctypes), built on first use into
    ``$XDG_CACHE_HOME/tandem/kernels/`` under a name keyed by the source, the flags, the compiler and the
    CPU's flags (about a second; reused across processes); None, logged once, where it cannot be built
    (no compiler, another compiler's flags) or loaded."""
    cc = os.environ.get("CC", "cc")
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode() + _host_key().encode()).hexdigest()[:16]
    so = _cache_dir() / f"w8_linear-{key}.so"
    try:
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
            os.close(fd)
            try:
                subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE)], check=True, capture_output=True,
                               text=True, timeout=120)
                os.replace(tmp, so)     # atomic: workers starting together may build it at once
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        fn = ctypes.CDLL(str(so)).w8_linear_f32
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("int8: the C kernel could not be built or loaded (%s); using torch's "
                    "_weight_int8pack_mm (9-34x slower than fp32 on an AVX2 CPU, docs/cpu.md)",
                    str(detail).strip()[:300])
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return fn


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T (+ bias)``.

    Args:
        x: ``[M, K]`` float32, bfloat16 or float16 activations, on the CPU.
        q: ``[N, K]`` int8 weights, contiguous; scale: ``[N]`` in ``x``'s dtype (cast if not).
        bias: ``[N]`` or None.

    Returns:
        ``[M, N]`` in ``x``'s dtype, contiguous. float32: the C kernel's sums are in float32, in another
        order than a BLAS call's (equal to ``F.linear`` over the dequantized weight to ~1e-6 relative).
    """
    fn = native() if x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" else None
    if fn is None:
        out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale.to(x.dtype))
        return out if bias is None else out + bias
    m = x.shape[0]
    if m >= DEQUANT_ROWS:
        return linear(x, q.float().mul_(scale.float()[:, None]), bias)
    x, q = x.contiguous(), q.contiguous()
    s = scale.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    out = torch.empty(m, q.shape[0], dtype=torch.float32)
    fn(x.data_ptr(), q.data_ptr(), s.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
       m, q.shape[0], q.shape[1], torch.get_num_threads())
    return out
