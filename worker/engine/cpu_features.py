"""What the host CPU can run natively, read once from the kernel: used to resolve ``dtype: auto``.

A CPU "has native bf16" when it has AVX-512-BF16 (``avx512_bf16``: bf16 dot products) or AMX
(``amx_bf16``: bf16 tile matmuls). Without them torch still computes in bf16, but by converting to
fp32 in software, which is slower than fp32 itself; so ``auto`` picks fp32 there.
"""
from __future__ import annotations

import functools

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


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
def cpu_has_native_bf16() -> bool:
    """True when the host CPU has AVX-512-BF16 or AMX (see :data:`BF16_FLAGS`)."""
    return bool(cpu_flags() & set(BF16_FLAGS))


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
