"""Decode batches padded to a captured CUDA-graph size give the unpadded logits.

On the CPU the graph runner replays eagerly over the same padded static buffers, so this checks the
padding contract of the ops (slot -1 writes nothing, context length 0 is harmless, wider block
tables change nothing) through the real model, on both backends.
"""
import pytest
import torch


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_matches_unpadded(tiny_llama, backend):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.cuda_graphs import DecodeGraphRunner
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.models.llama import AttentionMetadata
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), attention_backend=backend, block_size=8,
                                    num_kv_blocks=32, device="cpu"))
    runner = engine.runner
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    lens = [5, 17, 9]                                       # context lengths, the new token included
    tables = torch.tensor([[3, 0, 0], [7, 1, 12], [20, 4, 0]], dtype=torch.int32)
    pos = torch.tensor([n - 1 for n in lens])
    slots = tables.long().gather(1, (pos // 8)[:, None])[:, 0] * 8 + pos % 8
    ids = torch.tensor([11, 42, 7])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=3, decode_block_tables=tables,
                             decode_seq_lens=seq_lens)
    want = runner.model.forward(ids, pos, meta, runner.kv_cache, None)
    cache_after = runner.kv_cache.clone()
    graphs = DecodeGraphRunner(runner.model, runner.kv_cache, max_batch=4, max_blocks=6,
                               device="cpu", sizes=(1, 2, 4)).capture()
    got = graphs.run(ids, pos, slots, tables, seq_lens)      # padded to 4 rows, 6 table columns
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4
    # the real rows rewrite their slots (equal up to the batch-size-dependent rounding of the matmuls);
    # nothing else may change: the padding row's slot is -1
    written = torch.zeros(runner.kv_cache.shape[2] * 8, dtype=torch.bool)
    written[slots] = True
    written = written.view(-1, 8)
    flat_now, flat_before = (c.permute(2, 3, 0, 1, 4, 5) for c in (runner.kv_cache, cache_after))
    assert torch.equal(flat_now[~written], flat_before[~written]), "a padding row wrote the cache"
    assert (flat_now[written] - flat_before[written]).abs().max() <= 1e-5
    one = graphs.run(ids[:1], pos[:1], slots[:1], tables[:1, :1], seq_lens[:1])
    assert (one - want[:1]).abs().max() <= 1e-4
