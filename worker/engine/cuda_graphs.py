"""Decode steps replayed from CUDA graphs (``ModelRunner`` uses it on CUDA unless ``cuda_graphs`` is off).

A decode step of a Llama-3-8B launches ~10 kernels per layer; at batch 1 their launch overhead alone
is about as long as reading the weights. :class:`DecodeGraphRunner` captures ``model.forward`` for
pure-decode batches once per batch size and replays it:

* static input buffers at the largest size: token ids, positions, cache slots, block tables padded to
  ``max_blocks`` columns (the decode kernel's split count depends only on that width) and context
  lengths;
* a batch of ``B`` runs in the graph of the smallest captured size ``S >= B``; rows ``B..S`` are
  padding: slot -1 (the cache write skips it) and context length 0 (decode attention returns zeros);
* sizes are captured largest first into one shared memory pool.

On a CPU (or with ``use_graphs=False``) the runner replays by calling ``model.forward`` on the same
padded static buffers, which is how the padding logic is tested without a GPU.

``ModelRunner.execute`` replays a batch with decodes only (and no ``keep_logits``) through
:meth:`DecodeGraphRunner.run`; the runner is built and captured right after the KV cache exists.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphRunner:
    """Captured decode steps of ``model`` over ``kv_cache``, one graph per batch size."""

    def __init__(self, model, kv_cache: torch.Tensor, max_batch: int, max_blocks: int, device: str,
                 sizes: tuple[int, ...] = DEFAULT_SIZES, use_graphs: bool | None = None):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.sizes = sorted({s for s in sizes if s <= max_batch} | {max_batch})
        self.max_blocks = max_blocks
        self.use_graphs = str(device).startswith("cuda") if use_graphs is None else use_graphs
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        from tandem.worker.models.llama import AttentionMetadata
        meta = AttentionMetadata(slot_mapping=self.slots[:size], num_decode_tokens=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_seq_lens=self.seq_lens[:size])
        return self.model.forward(self.input_ids[:size], self.positions[:size], meta, self.kv_cache, None)

    def capture(self) -> "DecodeGraphRunner":
        """Capture every size (largest first, one memory pool). A failure disables graphs (logged)."""
        if not self.use_graphs:
            return self
        try:
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            for size in reversed(self.sizes):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
                    self._forward(size)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
            torch.cuda.synchronize()
            log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)
        except Exception:  # pragma: no cover - depends on the GPU stack
            log.exception("CUDA graph capture failed; decode runs eagerly")
            self.graphs.clear()
            self.outputs.clear()
            self.use_graphs = False
        return self

    def can_run(self, batch_size: int, table_width: int | None = None) -> bool:
        return 0 < batch_size <= self.sizes[-1] and (table_width is None or table_width <= self.max_blocks)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) of a decode-only batch of ``B`` sequences."""
        b, width = block_tables.shape
        if not self.can_run(b, width):
            raise ValueError(f"batch {b} x {width} blocks exceeds the captured {self.sizes[-1]} x {self.max_blocks}")
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.input_ids[b:size].zero_()
        self.positions[:b].copy_(positions)
        self.positions[b:size].zero_()
        self.slots[:b].copy_(slot_mapping)
        self.slots[b:size].fill_(-1)
        self.block_tables[:b, :width].copy_(block_tables)
        self.block_tables[:b, width:].zero_()
        self.block_tables[b:size].zero_()
        self.seq_lens[:b].copy_(seq_lens)
        self.seq_lens[b:size].zero_()
        if self.use_graphs and size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:b]
        return self._forward(size)[:b]
