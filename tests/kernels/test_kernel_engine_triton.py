"""The engine on Triton: ``attention_backend: triton`` forced, the whole engine runs under the
interpreter on a tiny random Llama and must produce the torch path's greedy tokens. Every torch
reference op raises during the Triton run, which proves the Triton kernels did the work.

The workload mixes the paths the kernels serve: chunked prefill (a token budget smaller than the
prompts), a prefix-cache hit (the second round shares whole blocks with the first), and steps with
decodes and prefill chunks together.
"""
import pytest

from tandem.kernels import ops

pytest.importorskip("transformers")

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
SHARED = "Paris is the capital of France; Berlin is the capital of Germany. "
PROMPTS_1 = [SHARED + "The quick brown fox", "Prefill computes the prompt"]
PROMPTS_2 = [SHARED + "Paged attention keeps", "héllo wörld"]


def _run(path, backend, quantization="none"):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(path), attention_backend=backend, block_size=8,
                                    max_num_batched_tokens=16, num_kv_blocks=64, device="cpu",
                                    quantization=quantization))
    assert engine.runner.ops.backend == backend
    first = [o.new_token_ids for o in engine.generate(PROMPTS_1, GREEDY)]
    second = engine.generate(PROMPTS_2, GREEDY)
    assert second[0].num_cached_tokens > 0, "the shared prefix should hit the prefix cache"
    return first + [o.new_token_ids for o in second], engine.stats


def _forbid_reference_ops(monkeypatch):
    import importlib
    for module, stem in ops._OPS.values():
        mod = importlib.import_module(module)

        def boom(*a, _name=stem, **kw):
            raise AssertionError(f"torch reference {_name}_ref called on the triton backend")
        monkeypatch.setattr(mod, stem + "_ref", boom)


@pytest.mark.timeout(600)
def test_engine_on_triton_matches_torch(tiny_llama, monkeypatch):
    want, _ = _run(tiny_llama, "torch")
    _forbid_reference_ops(monkeypatch)
    with pytest.raises(AssertionError, match="torch reference"):  # the trap is armed
        ops.select_ops("torch").rms_norm(None, None, 0.0)
    got, stats = _run(tiny_llama, "triton")
    assert stats.num_prefill_steps > 2  # the prompts really were chunked
    assert got == want


@pytest.mark.timeout(600)
def test_engine_fp8_on_triton_matches_torch(tiny_llama, monkeypatch):
    """``quantization: fp8``: the FP8 linear layers (per-token activation scales, per-channel weight
    scales) give the same greedy tokens through the Triton kernels as through the references."""
    want, _ = _run(tiny_llama, "torch", "fp8")
    _forbid_reference_ops(monkeypatch)
    got, _ = _run(tiny_llama, "triton", "fp8")
    assert got == want


def test_fp8_model_stays_close_to_unquantized(tiny_llama):
    """The FP8 model's logits stay near the unquantized model's (torch path).

    docs/architecture.md's 5e-2 bounds one FP8 op against its unquantized result (tests/kernels/test_kernel_fp8.py
    checks that); a model compounds 8 of them (4 projections x 2 layers, ~3.5% each on this tiny model's
    large random weights: ~13% measured), so the bound here is a sanity bound that catches a wrong
    scale or layout (relative error ~1), not a precision claim."""
    import torch

    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.models.llama import AttentionMetadata
    logits = {}
    for q in ("none", "fp8"):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), attention_backend="torch", block_size=8,
                                        num_kv_blocks=16, device="cpu", quantization=q))
        ids = engine.tokenize(SHARED)
        n = len(ids)
        runner = engine.runner
        tables = torch.arange((n + 7) // 8, dtype=torch.int32)[None]
        meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode_tokens=0,
                                 prefill_block_tables=tables,
                                 prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                                 prefill_seq_lens=torch.tensor([n], dtype=torch.int32))
        logits[q] = runner.model.forward(torch.tensor(ids), torch.arange(n), meta, runner.kv_cache, None)
        if q == "fp8":
            assert isinstance(runner.model.layers[0]["qkv"], tuple)
            assert runner.model.layers[0]["qkv"][0].dtype == torch.float8_e4m3fn
    a, b = logits["fp8"].double(), logits["none"].double()
    assert float((a - b).norm() / b.norm()) <= 0.25


@pytest.mark.timeout(900)
def test_smollm2_answers_through_the_triton_kernels(smollm2_path, monkeypatch):
    """The real SmolLM2-135M (30 layers, 9 q / 3 kv heads of 64) through the Triton kernels under the
    interpreter, with the references trapped: the same greedy answer as the torch path (~1 min). Six
    tokens: "The capital of France is Paris" (each interpreted decode step is seconds)."""
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = {"temperature": 0, "max_tokens": 6}
    answers = {}
    for backend in ("torch", "triton"):
        if backend == "triton":
            _forbid_reference_ops(monkeypatch)
        engine = LLMEngine(EngineConfig(model=str(smollm2_path), attention_backend=backend,
                                        device="cpu", num_kv_blocks=64))
        out = engine.generate([engine.tokenize_chat(chat)], params)[0]
        answers[backend] = (out.new_token_ids, out.text)
    assert answers["triton"] == answers["torch"]
    assert "Paris" in answers["triton"][1]
