"""Engine settings, the engine half of the InferencePool spec in plain Python types."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: ``auto`` and the concrete dtypes
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATIONS = ("none", "fp8", "int8")
#: the KV cache of a CPU engine when ``kv_cache_bytes`` is not set
CPU_DEFAULT_KV_BYTES = 256 * 1024 * 1024


@dataclass
class EngineConfig:
    """How one engine runs.

    Attributes:
        model: a model source: a Hugging Face directory, a ``.gguf`` file, or ``package:PKG/FILE``.
        dtype: ``auto`` | ``float32`` | ``float16`` | ``bfloat16`` for weights, activations and the KV
            cache; ``auto`` is resolved once by :meth:`resolved_dtype` (bf16 on GPUs and on CPUs with
            native bf16, fp32 elsewhere).
        block_size: tokens per KV block.
        max_model_len: the longest prompt + output, in tokens (0: the model's own limit).
        max_num_batched_tokens: the token budget of one step; prompts longer than this are prefilled
            in chunks (chunked prefill).
        max_num_seqs: the most sequences running at once.
        kv_cache_bytes: KV cache size in bytes, honoured on every device when set (None: on CUDA
            what ``gpu_memory_fraction`` leaves, on the CPU ``CPU_DEFAULT_KV_BYTES``).
        gpu_memory_fraction: on CUDA, the fraction of device memory for weights, activations, CUDA
            graphs and KV cache (vLLM's ``gpu_memory_utilization``; see
            :mod:`tandem.worker.engine.memory_plan`).
        num_kv_blocks: an explicit block count (tests); overrides the two above.
        enable_prefix_caching: reuse cached KV blocks across requests by block hash.
        attention_backend: ``auto`` | ``triton`` | ``flash-attn`` | ``torch``.
        quantization: ``none`` | ``fp8`` (GPUs: W8A8 e4m3) | ``int8`` (CPUs: weight-only, per output
            channel; :mod:`tandem.kernels.int8`).
        device: ``cpu`` or ``cuda[:N]``; ``auto`` picks CUDA when available.
        model_name: the OpenAI ``model`` name (defaults to the source's file or folder name).
        seed: the global torch seed (requests without their own seed sample from it).
        cuda_graphs: on CUDA, replay pure-decode steps from captured CUDA graphs
            (:mod:`tandem.worker.engine.cuda_graphs`); False runs every step eagerly.
    """
    model: str
    dtype: str = "float32"
    block_size: int = 16
    max_model_len: int = 0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.9
    num_kv_blocks: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    quantization: str = "none"
    device: str = "auto"
    model_name: str = ""
    seed: int = 0
    cuda_graphs: bool = True

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of a resolved ``dtype``; raises ValueError for an unknown name or for
        ``auto`` (resolve it first with :meth:`resolved_dtype`)."""
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}"
                             f"{' (resolved first)' if self.dtype == 'auto' else ''}, got {self.dtype!r}") from None

    def resolved_dtype(self, cpu_has_bf16: Callable[[], bool] | None = None) -> str:
        """The serving dtype this engine runs in, decided here and only here: the weights are loaded
        in it, the KV cache holds it, and the model fingerprint names it (so peers compare the dtype
        actually served).

        ``auto`` becomes ``bfloat16`` on CUDA devices with bf16 (``float16`` on older ones) and on
        CPUs with native bf16 (``cpu_has_bf16()``, default
        :func:`tandem.worker.engine.cpu_features.cpu_has_native_bf16`), ``float32`` on other CPUs.
        Raises ValueError for an unknown dtype or quantization."""
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype != "auto":
            self.torch_dtype()
            return self.dtype
        device = self.resolved_device()
        if device.startswith("cuda"):
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        if cpu_has_bf16 is None:
            from tandem.worker.engine.cpu_features import cpu_has_native_bf16 as cpu_has_bf16
        return "bfloat16" if cpu_has_bf16() else "float32"

    def resolved_device(self) -> str:
        """``device`` with ``auto`` resolved."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device
