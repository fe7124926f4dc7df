"""How a worker's memory is split: weights, activations, CUDA graphs, and what is left for the KV cache.

:func:`plan_memory` is a pure function of measured figures, as vLLM's ``determine_available_memory``
(``gpu_worker.py``) is of its ``profile_run``:

* **budget** = ``total * gpu_memory_fraction`` of the device;
* **in use before load** = ``total - free`` when the worker started (the CUDA context, other
  processes): never ours to take;
* **weights** = the bytes of the placed model;
* **activations** = the peak of one forward pass of a full ``maxNumBatchedTokens`` step at the largest
  batch (``maxNumSeqs`` sequences), measured by running it before the cache exists (on the CPU,
  :func:`cpu_activation_bytes` estimates it; tests/engine/test_memory_plan.py measures that a real
  step stays inside it);
* **graphs** = the CUDA graph pool of the decode graphs (one pure-decode step of ``maxNumSeqs``
  sequences, profiled the same way; 0 without graphs);
* **KV cache** = ``kvCache.bytes`` when set (on every device; refused when it does not fit what is
  free after the rest), else budget - in use - weights - activations - graphs.

The plan is logged as one line (:meth:`MemoryPlan.describe`); with illustrative figures for an H200
serving Llama-3-8B in bf16 (not measured: no GPU run yet)::

    memory plan (cuda): budget 125.8 GiB (0.90 of 139.8 GiB), in use before load 0.6 GiB; weights
    15.0 GiB; activations 1.9 GiB (profiled: 2048 tokens, 256 seqs); CUDA graphs 0.2 GiB; KV cache
    108.1 GiB (gpuMemoryFraction) = 55358 blocks x 16 tokens = 885728 tokens max concurrent
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


class MemoryPlanError(ValueError):
    """The parts do not fit: the message names every figure of the plan."""


@dataclass(frozen=True)
class MemoryPlan:
    """One worker's memory plan; all sizes in bytes."""
    device: str
    total: int
    budget: int
    in_use_before: int
    weights: int
    activations: int
    activation_source: str       # "profiled: ..." or "estimated: ..."
    graphs: int
    kv_bytes: int                # num_blocks * block_bytes
    kv_source: str               # kvCache.bytes | gpuMemoryFraction | numKvBlocks | cpu default
    block_bytes: int
    block_size: int
    num_blocks: int

    @property
    def max_tokens(self) -> int:
        """The most tokens the KV cache holds at once, across all sequences."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """The plan as one log line (see the module docstring)."""
        g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        head = (f"budget {g(self.budget)} ({self.budget / self.total:.2f} of {g(self.total)}), "
                if self.total else "")
        return (f"memory plan ({self.device}): {head}in use before load {g(self.in_use_before)}; "
                f"weights {g(self.weights)}; activations {g(self.activations)} ({self.activation_source}); "
                f"CUDA graphs {g(self.graphs)}; KV cache {g(self.kv_bytes)} ({self.kv_source}) = "
                f"{self.num_blocks} blocks x {self.block_size} tokens = {self.max_tokens} tokens max concurrent")


def plan_memory(*, device: str, total: int, free_before: int, weights: int, activations: int,
                graphs: int, block_bytes: int, block_size: int, gpu_memory_fraction: float = 0.9,
                kv_cache_bytes: int | None = None, num_kv_blocks: int = 0,
                activation_source: str = "profiled", default_kv_bytes: int | None = None) -> MemoryPlan:
    """Split a device's memory (see the module docstring). Pure: no device is touched.

    Args:
        device: a name for the log (``cuda:0``, ``cpu``).
        total, free_before: the device's memory and what was free before this worker loaded anything,
            in bytes (``torch.cuda.mem_get_info``; on the CPU the host's total and available memory).
        weights, activations, graphs: measured bytes (see the module docstring).
        block_bytes, block_size: one KV block's bytes (all layers, K and V) and tokens.
        gpu_memory_fraction: the share of ``total`` this worker may use when ``kv_cache_bytes`` is None.
        kv_cache_bytes: ``kvCache.bytes``: the KV cache size, whatever the device.
        num_kv_blocks: an explicit block count (tests); wins over both.
        default_kv_bytes: used when neither ``kv_cache_bytes`` nor ``num_kv_blocks`` is given instead of
            the fraction rule (the CPU's default cache size).

    Raises:
        MemoryPlanError: the KV cache would hold no block, or ``kvCache.bytes`` does not fit in what is
            free after weights, activations and graphs; the message names every figure.
    """
    if not 0 < gpu_memory_fraction <= 1:
        raise MemoryPlanError(f"gpuMemoryFraction must be in (0, 1], got {gpu_memory_fraction}")
    budget = int(total * gpu_memory_fraction)
    in_use = max(0, total - free_before)
    rest = weights + activations + graphs
    if num_kv_blocks:
        kv, source = num_kv_blocks * block_bytes, "numKvBlocks"
    elif kv_cache_bytes is not None:
        kv, source = int(kv_cache_bytes), "kvCache.bytes"
    elif default_kv_bytes is not None:
        kv, source = int(default_kv_bytes), "default"
    else:
        kv, source = budget - in_use - rest, "gpuMemoryFraction"
    plan = MemoryPlan(device=device, total=total, budget=budget, in_use_before=in_use, weights=weights,
                      activations=activations, activation_source=activation_source, graphs=graphs,
                      kv_bytes=max(0, kv // block_bytes) * block_bytes, kv_source=source,
                      block_bytes=block_bytes, block_size=block_size, num_blocks=max(0, kv // block_bytes))
    if source in ("kvCache.bytes", "numKvBlocks") and total and kv > free_before - rest:
        raise MemoryPlanError(f"{source} asks for {kv / GiB:.2f} GiB of KV cache but only "
                              f"{max(0, free_before - rest) / GiB:.2f} GiB is free after the rest: "
                              f"{plan.describe()}")
    if plan.num_blocks < 1:
        raise MemoryPlanError(f"the KV cache holds no block of {block_bytes} bytes: {plan.describe()}"
                              + (" (raise gpuMemoryFraction, lower maxNumBatchedTokens or maxNumSeqs, "
                                 "or use a larger device)" if source == "gpuMemoryFraction" else ""))
    return plan


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """The prompt lengths of the profiling step: ``maxNumBatchedTokens`` tokens over
    ``min(maxNumSeqs, maxNumBatchedTokens)`` sequences, as even as possible (vLLM's ``profile_run``
    shape: the largest batch at the full token budget)."""
    n = max(1, min(max_num_seqs, max_num_batched_tokens))
    q, r = divmod(max_num_batched_tokens, n)
    return [q + (i < r) for i in range(n)]


#: what the CPU runtime allocates on a first step whatever its size (oneDNN and SDPA scratch, thread
#: pools): ~35 MiB measured beside a 1024-token SmolLM2 step, rounded up
CPU_RUNTIME_BYTES = 64 * 2**20


def cpu_activation_bytes(cfg, num_tokens: int, num_seqs: int, elem: int, max_seq_len: int) -> int:
    """An upper bound of one step's activation peak on the CPU (torch ops), in bytes.

    ``cfg`` is a :class:`tandem.worker.engine.loader.ModelConfig`; ``elem`` the serving dtype's size.
    The widest point of a layer holds the hidden state, the residual and the norm output ``3 * H``,
    the fused QKV and the attention output, and then the MLP's gate/up ``2 * I`` plus its product ``I``
    (per token); norms upcast one ``H`` row to fp32; attention gathers each sequence's K and V
    (at most ``max_seq_len`` tokens) and SDPA's flash path keeps per-block softmax state; the head
    writes ``[seqs, vocab]`` logits and their fp32 copy. A factor of 1.5 covers the allocator's
    X/engine/test_memory_plan.py measures a real
    step against it.
    """
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    per_token = elem * (3 * h + (q + 2 * kv) + q + 3 * i) + 4 * h
    attention = 2 * min(max_seq_len, num_tokens) * (kv + q) * max(elem, 4)
    head = num_seqs * cfg.vocab_size * (elem + 4)
    return int(2 * (num_tokens * per_token + attention + head)) + CPU_RUNTIME_BYTES
