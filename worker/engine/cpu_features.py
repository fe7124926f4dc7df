"""What the host CPU can run natively, read once from the kernel: used to resolve ``dtype: auto``.

A CPU "has native bf16" when it has AVX-512-BF16 (``avx512_bf16``: bf16 dot products) or AMX
(``amx_bf16``: bf16 tile matmuls). Without them torch still computes in bf16, but by converting to
fp32 in software, which is slower than fp32 itself; so ``auto`` picks fp32 there.

:data:`CPU_BF16_ENV` overrides the probe either way (tests run the dtype-sensitive cases as both CPU
kinds on one machine; an operator can pin what ``auto`` means on mixed nodes).
"""
from __future__ import annotations

import functools
import os

BF16_FLAGS = ("avx512_bf16", "amx_bf16")

#: Forces the CPU-bf16 probe: ``1`` answers as a CPU with native bf16 would, ``0`` as one without;
#: unset or empty reads the CPU's flags. Inherited by the worker processes a fleet starts.
CPU_BF16_ENV = "TANDEM_CPU_BF16"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (Linux ``/proc/cpuinfo``); an empty set when
    the file is missing or has no ``flags`` line (other operating systems)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def _flags_have_bf16() -> bool:
    return bool(cpu_flags() & set(BF16_FLAGS))


def cpu_has_native_bf16(environ=None) -> bool:
    """True when the host CPU has AVX-512-BF16 or AMX (see :data:`BF16_FLAGS`), unless
    :data:`CPU_BF16_ENV` in ``environ`` (default ``os.environ``) forces the answer. Raises ValueError
    for a forcing value other than ``0``, ``1`` or empty."""
    forced = (os.environ if environ is None else environ).get(CPU_BF16_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{CPU_BF16_ENV} must be 0, 1 or empty, got {forced!r}")
    return forced == "1" if forced else _flags_have_bf16()


# The variable is set by whoever starts the worker (tandem.worker.api.config.cpu_threads says from what)
from tandem.worker.api.names import CPU_THREADS_ENV  # noqa: E402


def apply_cpu_threads(environ=None) -> int | None:
    """Set torch's intra-op threads from :data:`CPU_THREADS_ENV` when it holds a positive integer;
    returns the count set, or None (unset, empty or 0: torch's default is kept). Call before the engine
    loads. Raises ValueError for a value that is not an integer."""
    import os

    import torch
    raw = (os.environ if environ is None else environ).get(CPU_THREADS_ENV, "").strip()
    if not raw or int(raw) <= 0:
        return None
    torch.set_num_threads(int(raw))
    return int(raw)
