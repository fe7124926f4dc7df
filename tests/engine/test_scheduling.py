"""Prefix caching, chunked prefill and preemption on a tiny random Llama (real engine, CPU)."""
import math

import pytest
import torch

from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import LLMEngine

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
SYSTEM = ("Paris is the capital of France; Berlin is the capital of Germany. The quick brown fox jumps "
          "over the lazy dog. ")


def make(path, **kw):
    kw.setdefault("block_size", 8)
    return LLMEngine(EngineConfig(model=str(path), **kw))


def run(engine, prompts, params=GREEDY, check=None, **kw):
    """Drive the engine step by step, calling ``check()`` after each step; return outputs in order."""
    rids = []
    for i, p in enumerate(prompts):
        rid = f"r{len(engine.seqs)}-{i}-{id(p)}"
        engine.add_request(rid, prompt_token_ids=p, params=params, **kw)
        rids.append(rid)
    done, toks = {}, {r: [] for r in rids}
    while len(done) < len(rids):
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
            if out.finished:
                done[out.request_id] = out
        if check:
            check()
    return [toks[r] for r in rids], [done[r] for r in rids]


def test_prefix_cache_hit_counts_and_identical_output(tiny_llama):
    engine = make(tiny_llama)
    prefix = engine.tokenize(SYSTEM)
    a = prefix + engine.tokenize("Prefill computes")
    b = prefix + engine.tokenize("Paged attention")
    cold = make(tiny_llama, enable_prefix_caching=False)
    cold_b, _ = run(cold, [b])

    before = engine.stats.prompt_tokens_computed
    run(engine, [a])
    assert engine.stats.prompt_tokens_computed - before == len(a)
    before = engine.stats.prompt_tokens_computed
    toks_b, outs = run(engine, [b])
    cached = (len(prefix) // 8) * 8                        # whole blocks of the shared prefix
    assert outs[0].num_cached_tokens == cached > 0
    assert engine.stats.prompt_tokens_computed - before == len(b) - cached
    assert toks_b == cold_b
    assert engine.block_manager.prefix_hits >= cached
    engine.block_manager.check_invariant()


def test_corrupted_cached_blocks_change_the_output(tiny_llama):
    engine = make(tiny_llama)
    prefix = engine.tokenize(SYSTEM)
    prompt = prefix + engine.tokenize("Prefill computes")
    good, _ = run(engine, [prompt])
    # the blocks now sit in the prefix cache; overwrite their KV with noise
    cached = list(engine.block_manager.cached_free)
    assert cached
    idx = torch.tensor(cached)
    engine.runner.kv_cache[:, :, idx] = torch.randn_like(engine.runner.kv_cache[:, :, idx]) * 5
    bad, outs = run(engine, [prompt])
    assert outs[0].num_cached_tokens > 0
    assert bad != good


def test_outputs_identical_under_eviction_pressure(tiny_llama):
    roomy = make(tiny_llama)
    tight = make(tiny_llama, num_kv_blocks=12, max_num_seqs=2)
    prompts = [roomy.tokenize(SYSTEM[: 40 + 7 * i] + f" question {i}") for i in range(8)]
    want, _ = run(roomy, prompts)
    got, _ = run(tight, prompts, check=tight.block_manager.check_invariant)
    assert got == want
    assert tight.block_manager.num_used == 0


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_chunked_prefill_logits_and_step_count(tiny_llama, chunk):
    whole = make(tiny_llama, max_num_batched_tokens=2048, enable_prefix_caching=False)
    prompt = whole.tokenize(SYSTEM * 2)
    assert len(prompt) > 64
    ref = whole.generate([prompt], {"temperature": 0, "max_tokens": 1}, keep_logits=True)
    engine = make(tiny_llama, max_num_batched_tokens=chunk or 2048, enable_prefix_caching=False)
    engine.add_request("c", prompt_token_ids=prompt, params={"temperature": 0, "max_tokens": 1},
                       keep_logits=True)
    seq = engine.seqs["c"]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seq_logits = torch.stack(seq.logits)
    assert steps == math.ceil(len(prompt) / (chunk or len(prompt)))
    assert engine.stats.num_prefill_steps == steps
    whole.add_request("w", prompt_token_ids=prompt, params={"temperature": 0, "max_tokens": 1},
                      keep_logits=True)
    wseq = whole.seqs["w"]
    while whole.has_unfinished():
        whole.step()
    assert (seq_logits - torch.stack(wseq.logits)).abs().max().item() <= 1e-4
    assert ref[0].new_token_ids == [int(seq_logits[-1].argmax())]


def test_preemption_recomputes_without_loss(tiny_llama):
    roomy = make(tiny_llama, block_size=4)
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    prompts = [roomy.tokenize(f"The quick brown fox number {i} jumps") for i in range(6)]
    want, _ = run(roomy, prompts, params)
    # 6 sequences of ~40 tokens need ~60 blocks of 4; give them 24
    tight = make(tiny_llama, block_size=4, num_kv_blocks=24)
    got, outs = run(tight, prompts, params, check=tight.block_manager.check_invariant)
    assert tight.scheduler.num_preemptions >= 1
    assert got == want
    assert all(o.finish_reason == "length" for o in outs)
    assert tight.block_manager.num_used == 0 and tight.kv_usage() == 0


def test_seeded_sampling_survives_preemption(tiny_llama):
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_tokens": 20, "ignore_eos": True, "seed": 7}
    roomy = make(tiny_llama, block_size=4)
    prompts = [roomy.tokenize(f"Paged attention {i}") for i in range(5)]
    want, _ = run(roomy, prompts, params)
    tight = make(tiny_llama, block_size=4, num_kv_blocks=16)
    got, _ = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions >= 1
    assert got == want
