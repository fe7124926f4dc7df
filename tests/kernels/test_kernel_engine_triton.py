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


def _run(path, backend):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(path), attention_backend=backend, block_size=8,
                                    max_num_batched_tokens=16, num_kv_blocks=64, device="cpu"))
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
