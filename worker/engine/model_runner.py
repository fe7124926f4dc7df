"""Turns a scheduled batch into tensors, runs the model, and owns the paged KV cache tensor."""
from __future__ import annotations

import logging

import torch

from tandem.kernels.ops import select_ops
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.loader import LoadedModel
from tandem.worker.engine.scheduler import ScheduledBatch
from tandem.worker.engine.sequence import Sequence
from tandem.worker.models.llama import AttentionMetadata, LlamaModel

log = logging.getLogger(__name__)


def kv_block_bytes(loaded: LoadedModel, config: EngineConfig) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    c = loaded.config
    elem = torch.empty(0, dtype=config.torch_dtype()).element_size()
    return c.num_layers * 2 * config.block_size * c.num_kv_heads * c.head_dim * elem


class ModelRunner:
    """Runs :class:`LlamaModel` steps over the KV cache
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int):
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.torch_dtype()
        self.block_size = config.block_size
        self.ops = select_ops(config.attention_backend, self.device)
        c = loaded.config
        self.model = LlamaModel(c, loaded.weights, self.ops, self.dtype, self.device, max_model_len,
                                config.quantization)
        self.block_bytes = kv_block_bytes(loaded, config)   # one block, every layer, K and V
        self.num_blocks = self._num_blocks(loaded)
        self.kv_cache = torch.zeros(c.num_layers, 2, self.num_blocks, config.block_size,
                                    c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB), backend %s", self.num_blocks,
                 config.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
                 self.ops.backend)
        self.graphs = None
        if self.device.startswith("cuda") and config.cuda_graphs:
            from tandem.worker.engine.cuda_graphs import DecodeGraphRunner
            self.graphs = DecodeGraphRunner(self.model, self.kv_cache, max_batch=config.max_num_seqs,
                                            max_blocks=-(-max_model_len // config.block_size),
                                            device=self.device).capture()

    def _num_blocks(self, loaded: LoadedModel) -> int:
        cfg = self.config
        per_block = self.block_bytes
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        if self.device.startswith("cuda"):
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cfg.gpu_memory_fraction - (total - free)
        else:
            budget = cfg.kv_cache_bytes
        n = int(budget // per_block)
        if n < 1:
            raise ValueError(f"kvCache too small: {budget / 2**20:.1f} MiB holds no block "
                             f"of {per_block} bytes")
        return n

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step. Returns the sequences that reach their last token (to be sampled) and their
        logits ``[S, vocab]`` float32. Sequences with ``keep_logits`` get every computed row appended
        to ``seq.logits``."""
        bs = self.block_size
        dev = self.device
        ids, positions, slots, sample_rows, sample_seqs = [], [], [], [], []
        keep = []
        offset = 0
        for seq, n in batch.items:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            pos = torch.arange(start, start + n)
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if start + n == seq.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_seqs.append(seq)
            if seq.keep_logits:
                keep.append((seq, offset, n))
            offset += n
        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev), num_decode_tokens=len(batch.decodes))
        if batch.decodes:
            meta.decode_block_tables = self._tables([s for s, _ in batch.decodes])
            meta.decode_seq_lens = torch.tensor([s.num_computed_tokens + 1 for s, _ in batch.decodes],
                                                dtype=torch.int32, device=dev)
        if batch.prefills:
            meta.prefill_block_tables = self._tables([s for s, _ in batch.prefills])
            lens = [n for _, n in batch.prefills]
            cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(lens).cumsum(0)
            meta.prefill_cu_seqlens_q = cu.to(dev)
            meta.prefill_seq_lens = torch.tensor([s.num_computed_tokens + n for s, n in batch.prefills],
                                                 dtype=torch.int32, device=dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.cat(positions).to(dev)
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
        t = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            t[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        return t.to(self.device)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A CPU copy of blocks: ``[num_layers, 2, len(block_ids), block_size, Hk, D]``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.kv_cache.index_select(2, idx).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (shape as :meth:`read_blocks` returns) into ``block_ids``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.kv_cache.index_copy_(2, idx, data.to(device=self.device, dtype=self.dtype))
