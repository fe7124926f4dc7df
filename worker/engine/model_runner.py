"""Turns a scheduled batch into tensors, runs the model, and owns the paged KV cache tensor."""
from __future__ import annotations

import logging
import os

import torch

from tandem.kernels.ops import select_ops
from tandem.worker.engine.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from tandem.worker.engine.loader import LoadedModel
from tandem.worker.engine.memory_plan import cpu_activation_bytes, plan_memory, profile_batch
from tandem.worker.engine.scheduler import ScheduledBatch
from tandem.worker.engine.sequence import Sequence
from tandem.worker.models.llama import AttentionMetadata, LlamaModel

log = logging.getLogger(__name__)


def kv_block_bytes(loaded: LoadedModel, config: EngineConfig) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    c = loaded.config
    elem = torch.empty(0, dtype=config.torch_dtype()).element_size()
    return c.num_layers * 2 * config.block_size * c.num_kv_heads * c.head_dim * elem


def device_memory(device: str) -> tuple[int, int]:
    """``(total, free)`` bytes of ``device``: ``torch.cuda.mem_get_info`` on CUDA; on the CPU the host's
    physical memory and its ``MemAvailable`` (/proc/meminfo; free pages where there is none)."""
    if str(device).startswith("cuda"):
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        avail = page * os.sysconf("SC_AVPHYS_PAGES")
    return int(total), int(avail)


class ModelRunner:
    """Runs :class:`LlamaModel` steps over the KV cache
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Startup order (vLLM's): place the model, profile one full ``max_num_batched_tokens`` step at the
    largest batch (and one decode step of ``max_num_seqs`` for the CUDA graph pool), plan memory
    (:func:`tandem.worker.engine.memory_plan.plan_memory`), allocate the KV cache, capture graphs.

    Args:
        memory_before: ``(total, free)`` device bytes measured before the weights were loaded (None:
            measured now, with weights already on the device counted as free).
        owns_weights: ``loaded.weights`` may be consumed (emptied) while building the model.
        progress: ``progress(phase, done, total)`` for phases converting, profiling, capturing.
    Raises:
        MemoryPlanError: the memory does not fit (see :func:`plan_memory`).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int,
                 memory_before: tuple[int, int] | None = None, owns_weights: bool = False,
                 progress=None):
        progress = progress or (lambda phase, done, total: None)
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.torch_dtype()
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.ops = select_ops(config.attention_backend, self.device)
        c = loaded.config
        if memory_before is None:
            total, free = device_memory(self.device)
            on_dev = sum(t.numel() * t.element_size() for t in loaded.weights.values()
                         if str(t.device).startswith(self.device.split(":")[0]))
            memory_before = (total, free + on_dev)
        self.model = LlamaModel(c, loaded.weights if owns_weights else dict(loaded.weights), self.ops,
                                self.dtype, self.device, max_model_len, config.quantization, progress)
        self.block_bytes = kv_block_bytes(loaded, config)   # one block, every layer, K and V
        activations, act_source, graphs = self._profile(progress)
        self.plan = plan_memory(
            device=self.device, total=memory_before[0], free_before=memory_before[1],
            weights=self.model.weight_bytes(), activations=activations, activation_source=act_source,
            graphs=graphs, block_bytes=self.block_bytes, block_size=config.block_size,
            gpu_memory_fraction=config.gpu_memory_fraction, kv_cache_bytes=config.kv_cache_bytes,
            num_kv_blocks=config.num_kv_blocks,
            default_kv_bytes=None if self._cuda else CPU_DEFAULT_KV_BYTES)
        log.info("%s", self.plan.describe())
        self.num_blocks = self.plan.num_blocks
        self.kv_cache = torch.zeros(c.num_layers, 2, self.num_blocks, config.block_size,
                                    c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB), backend %s", self.num_blocks,
                 config.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
                 self.ops.backend)
        self.graphs = None
        if self._cuda and config.cuda_graphs:
            from tandem.worker.engine.cuda_graphs import DecodeGraphRunner
            progress("capturing", 0, 1)
            free0 = torch.cuda.mem_get_info(self.device)[0]
            self.graphs = DecodeGraphRunner(self.model, self.kv_cache, max_batch=config.max_num_seqs,
                                            max_blocks=-(-max_model_len // config.block_size),
                                            device=self.device).capture()
            used = free0 - torch.cuda.mem_get_info(self.device)[0]
            (log.warning if used > graphs else log.info)(
                "CUDA graphs: %.1f MiB used of %.1f MiB planned", used / 2**20, graphs / 2**20)
            progress("capturing", 1, 1)

    @property
    def _cuda(self) -> bool:
        return self.device.startswith("cuda")

    def _profile(self, progress) -> tuple[int, str, int]:
        """``(activation bytes, how they were found, CUDA graph pool bytes)``.

        On CUDA: run the profiling step (:func:`profile_batch`) over a scratch KV cache just large
        enough for it and take the allocator's peak above what was allocated before (the scratch cache
        excluded); the graph pool is profiled the same way with a pure-decode step of ``max_num_seqs``.
        On the CPU: :func:`cpu_activation_bytes` (torch has no CPU allocator statistics)."""
        cfg = self.config
        lens = profile_batch(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        progress("profiling", 0, 1)
        if not self._cuda:
            elem = torch.empty(0, dtype=self.dtype).element_size()
            act = cpu_activation_bytes(self.model.config, sum(lens), len(lens), elem, self.max_model_len)
            progress("profiling", 1, 1)
            return act, f"estimated: {sum(lens)} tokens, {len(lens)} seqs", 0
        act = self._profile_step(lens)
        graphs = self._profile_step([1] * cfg.max_num_seqs, decode=True) if cfg.cuda_graphs else 0
        torch.cuda.empty_cache()
        progress("profiling", 1, 1)
        return act, f"profiled: {sum(lens)} tokens, {len(lens)} seqs", graphs

    @torch.inference_mode()
    def _profile_step(self, lens: list[int], decode: bool = False) -> int:
        """Peak bytes allocated above the baseline while running one step of sequences ``lens``
        (prefills from position 0, or single-token decodes) over a scratch KV cache."""
        c, bs, dev = self.model.config, self.block_size, self.device
        nblocks = [-(-n // bs) for n in lens]
        scratch = torch.zeros(c.num_layers, 2, sum(nblocks), bs, c.num_kv_heads, c.head_dim,
                              dtype=self.dtype, device=dev)
        width = max(nblocks)
        tables = torch.zeros(len(lens), width, dtype=torch.int32)
        slots, first = [], 0
        for i, (n, k) in enumerate(zip(lens, nblocks)):
            tables[i, :k] = torch.arange(first, first + k, dtype=torch.int32)
            slots.append(torch.arange(first * bs, first * bs + n))
            first += k
        tables = tables.to(dev)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        total = sum(lens)
        if decode:
            meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev), num_decode_tokens=len(lens),
                                     decode_block_tables=tables, decode_seq_lens=seq_lens)
        else:
            cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(lens).cumsum(0)
            meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev), num_decode_tokens=0,
                                     prefill_block_tables=tables, prefill_cu_seqlens_q=cu.to(dev),
                                     prefill_seq_lens=seq_lens)
        ids = torch.zeros(total, dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
        rows = (torch.tensor(lens).cumsum(0) - 1).to(dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        self.model.forward(ids, pos, meta, scratch, None if decode else rows)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del scratch
        return int(peak)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step. Returns the sequences that reach their last token (to be sampled) and their
        logits ``[S, vocab]`` float32. Sequences with ``keep_logits`` get every computed row appended
        to ``seq.logits``."""
        bs = self.block_size
        dev = self.device
        # plain Python lists, one tensor each at the end: per-sequence small tensors cost more than
        # the decode step's own ops on a CPU (docs/cpu.md)
        ids, positions, slots, sample_rows, sample_seqs = [], [], [], [], []
        keep = []
        offset = 0
        for seq, n in batch.items:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            table = seq.block_table
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_seqs.append(seq)
            if seq.keep_logits:
                keep.append((seq, offset, n))
            offset += n
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                                 num_decode_tokens=len(batch.decodes))
        if batch.decodes:
            meta.decode_block_tables = self._tables([s for s, _ in batch.decodes])
            meta.decode_seq_lens = torch.tensor([s.num_computed_tokens + 1 for s, _ in batch.decodes],
                                                dtype=torch.int32, device=dev)
        if batch.prefills:
            meta.prefill_block_tables = self._tables([s for s, _ in batch.prefills])
            cu = [0]
            for _, n in batch.prefills:
                cu.append(cu[-1] + n)
            meta.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta.prefill_seq_lens = torch.tensor([s.num_computed_tokens + n for s, n in batch.prefills],
                                                 dtype=torch.int32, device=dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        if (self.graphs is not None and not batch.prefills and not keep
                and self.graphs.can_run(len(batch.decodes), meta.decode_block_tables.shape[1])):
            return sample_seqs, self.graphs.run(input_ids, pos_t, meta.slot_mapping, meta.decode_block_tables,
                                                meta.decode_seq_lens)
        if keep:
            logits = self.model.forward(input_ids, pos_t, meta, self.kv_cache, None)
            for seq, off, n in keep:
                seq.logits.extend(logits[off:off + n].cpu())
            return sample_seqs, logits[sample_rows]
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
        return sample_seqs, self.model.forward(input_ids, pos_t, meta, self.kv_cache, rows)

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A CPU copy of blocks: ``[num_layers, 2, len(block_ids), block_size, Hk, D]``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.kv_cache.index_select(2, idx).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (shape as :meth:`read_blocks` returns) into ``block_ids``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.kv_cache.index_copy_(2, idx, data.to(device=self.device, dtype=self.dtype))
