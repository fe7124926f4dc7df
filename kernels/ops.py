"""Choose the implementation of every engine op from the ``attentionBackend`` setting.

The engine never imports an op directly: it asks :func:`select_ops` once and calls through the
returned :class:`Ops`, so a backend is one decision in one place. Functions are looked up on their
modules when ``select_ops`` runs, which lets a test replace a reference op with one that raises.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

BACKENDS = ("auto", "triton", "flash-attn", "torch")

# op name -> (module, attribute stem); the torch reference is f"{stem}_ref", Triton f"{stem}_triton".
_OPS = {
    "rms_norm": ("tandem.kernels.norm", "rms_norm"),
    "rope_and_cache": ("tandem.kernels.rope", "rope_and_cache"),
    "silu_and_mul": ("tandem.kernels.activation", "silu_and_mul"),
    "prefill_attention": ("tandem.kernels.attention", "prefill_attention"),
    "decode_attention": ("tandem.kernels.attention", "decode_attention"),
    "linear": ("tandem.kernels.linear", "linear"),
    "fp8_linear": ("tandem.kernels.fp8", "fp8_linear"),
    "quantize_per_token_fp8": ("tandem.kernels.fp8", "quantize_per_token_fp8"),
}


@dataclass(frozen=True)
class Ops:
    """The op set an engine runs with; see each op's reference for shapes and dtypes."""
    backend: str
    rms_norm: Callable
    rope_and_cache: Callable
    silu_and_mul: Callable
    prefill_attention: Callable
    decode_attention: Callable
    linear: Callable
    fp8_linear: Callable
    quantize_per_token_fp8: Callable


def resolve_backend(backend: str, device: str) -> str:
    """Map ``auto`` to a concrete backend: ``triton`` on CUDA, ``torch`` elsewhere.

    Raises ValueError for an unknown name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attentionBackend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    return backend


def select_ops(backend: str, device: str = "cpu") -> Ops:
    """Build the :class:`Ops` for ``backend`` (one of :data:`BACKENDS`) on ``device``.

    ``triton`` takes every op's ``*_triton`` function; ``flash-attn`` takes the Triton ops but the
    attention functions from :mod:`tandem.kernels.flash`; ``torch`` takes the references.
    Raises ValueError for an unknown backend and ImportError when the backend's package is missing.
    """
    chosen = resolve_backend(backend, device)
    suffix = "_ref" if chosen == "torch" else "_triton"
    fns = {}
    for name, (module, stem) in _OPS.items():
        fns[name] = getattr(importlib.import_module(module), stem + suffix)
    if chosen == "flash-attn":
        flash = importlib.import_module("tandem.kernels.flash")
        flash.require()  # a missing flash-attn fails here, at configuration, not at the first step
        fns["prefill_attention"] = flash.prefill_attention_flash
        fns["decode_attention"] = flash.decode_attention_flash
    return Ops(backend=chosen, **fns)
