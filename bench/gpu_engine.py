"""Part 3 of the GPU benchmark: the engine on a Llama-3-8B-shaped model with random weights,
against Hugging Face transformers (sdpa) in the same run.

* TTFT: one prompt of 512 / 2k / 8k / 16k tokens, ``max_tokens=1``, prefix caching off, median of
  3 after a warm-up. transformers: one forward over the prompt with a cache and ``logits_to_keep=1``
  (what ``generate`` does for its first token).
* Decode step at batch 1 and 32 (prompts of 512 tokens; ``--batches``, ``--contexts`` for others): the engine's ``step()`` once every
  sequence decodes (on CUDA it replays CUDA graphs, ``EngineConfig.cuda_graphs``), and the model's
  decode forward alone replayed from a graph ("ours graph ms": no scheduler, no sampler);
  transformers: one forward of one token per sequence with its DynamicCache, and
  (``--compile``) ``generate`` with the static cache under torch.compile, the step time taken as
  the slope between two generation lengths.

The model: 32 layers, hidden 4096, 32 q / 8 kv heads of 128, MLP 14336, vocab 128256, bf16; the
engine shares the transformers model's weight tensors (only its fused qkv / gate_up are copies).

    python bench/gpu_engine.py [--compile] [--lengths 512,2048,8192,16384] [--backend triton]
    python bench/gpu_engine.py --dry-run      # a tiny model on the CPU: checks the harness only
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import record, require_cuda, table  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128)
DECODE_ROOM = 256  # tokens past the longest prompt: the decode rows' max_tokens, and KV blocks for them
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16)


class _NullTokenizer:
    """Token ids in, empty text out: the benchmark never looks at text."""

    def decode(self, ids, **_kw):
        return ""

    def encode(self, text):
        return [1] * max(1, len(text) // 4)


def build_models(shape: dict, device, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.worker.engine.loader import LoadedModel, ModelConfig
    cfg = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                      intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                      num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                      max_position_embeddings=32768, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    hf.eval()
    mc = ModelConfig(arch="llama", vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                     intermediate_size=shape["intermediate_size"], num_layers=shape["num_layers"],
                     num_heads=shape["num_heads"], num_kv_heads=shape["num_kv_heads"],
                     head_dim=shape["head_dim"], rms_norm_eps=1e-5, rope_theta=500000.0,
                     max_position_embeddings=32768)
    weights = {k: v.detach() for k, v in hf.state_dict().items()}
    return hf, LoadedModel(config=mc, weights=weights, tokenizer=_NullTokenizer(), path=Path("random-llama"))


def make_engine(loaded, device, dtype_name, backend, max_len, num_blocks, budget, quantization="none"):
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    cfg = EngineConfig(model="random-llama", dtype=dtype_name, block_size=16, max_model_len=max_len,
                       max_num_batched_tokens=budget, max_num_seqs=64, num_kv_blocks=num_blocks,
                       enable_prefix_caching=False, attention_backend=backend, device=device,
                       quantization=quantization)
    return LLMEngine(cfg, loaded=loaded)


def sync(device):
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn, device, reps=3):
    fn()  # warm-up (compilation, allocator)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_ttft(engine, hf, lengths, vocab, device, rows):
    import torch
    for n in lengths:
        ids = torch.randint(0, vocab, (n,)).tolist()
        params = {"temperature": 0, "max_tokens": 1, "ignore_eos": True}
        ours = median_time(lambda: engine.generate([ids], params), device)
        x = torch.tensor([ids], device=device)

        def hf_first_token():
            with torch.inference_mode():
                try:
                    out = hf(x, use_cache=True, logits_to_keep=1)
                except TypeError:  # older transformers
                    out = hf(x, use_cache=True, num_logits_to_keep=1)
                return out.logits[:, -1].argmax(-1)
        theirs = median_time(hf_first_token, device)
        row = {"what": "TTFT", "tokens": n, "ours ms": ours * 1e3, "hf ms": theirs * 1e3,
               "ours/hf": ours / theirs}
        rows.append(row)
        _emit(row)


def bench_decode(engine, hf, batches, prompt_len, vocab, device, rows, steps=12):
    import torch
    for bsz in batches:
        prompts = [torch.randint(0, vocab, (prompt_len,)).tolist() for _ in range(bsz)]
        # room for the tokens the first sequences decode while later ones still prefill (chunked
        # prefill mixes them); too few and they finish inside the timed steps (seqs/step < batch)
        params = {"temperature": 0, "max_tokens": DECODE_ROOM - 8, "ignore_eos": True}
        for i, p in enumerate(prompts):
            engine.add_request(f"dec-{bsz}-{i}", prompt_token_ids=p, params=params)
        while any(s.in_prefill for s in engine.seqs.values()):
            engine.step()
        engine.step()  # first pure decode step (warm-up)
        times, decoded = [], []
        preempted = engine.scheduler.num_preemptions
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            out = engine.step()
            sync(device)
            times.append(time.perf_counter() - t0)
            decoded.append(len(out))
        # a step that decoded fewer than bsz sequences (preemption, a cap) is not a batch-bsz step
        seqs_per_step = statistics.median(decoded)
        preempted = engine.scheduler.num_preemptions - preempted
        for i in range(bsz):
            engine.abort(f"dec-{bsz}-{i}")
        while engine.has_unfinished():
            engine.step()
        ours = statistics.median(times)

        x = torch.tensor(prompts, device=device)
        try:
            theirs = _hf_decode_step(hf, x, device, steps)
            row = {"what": "decode step", "batch": bsz, "context": prompt_len, "ours ms": ours * 1e3,
                   "hf ms": theirs * 1e3, "ours/hf": ours / theirs, "seqs/step": seqs_per_step, "preempted": preempted}
        except torch.OutOfMemoryError:  # HF prefills the whole batch in one forward; ours chunks it
            torch.cuda.empty_cache()
            row = {"what": "decode step", "batch": bsz, "context": prompt_len, "ours ms": ours * 1e3,
                   "hf ms": "n/a (out of memory)", "seqs/step": seqs_per_step, "preempted": preempted}
        graph_ms = graph_decode_step(engine, bsz, prompt_len, device, steps)
        if graph_ms is not None:
            row["ours graph ms"] = graph_ms
            if isinstance(graph_ms, float) and isinstance(row["hf ms"], float):
                row["graph/hf"] = graph_ms / row["hf ms"]
        row["_prompts"] = x
        rows.append(row)
        _emit(row)


def _hf_decode_step(hf, x, device, steps):
    """Median seconds of transformers' one-token forward over its DynamicCache after prefilling ``x``."""
    import torch
    with torch.inference_mode():
        out = hf(x, use_cache=True, logits_to_keep=1) if _has_logits_to_keep(hf) else hf(x, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        t_hf = []
        for i in range(steps + 1):
            sync(device)
            t0 = time.perf_counter()
            out = hf(tok, past_key_values=past, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            sync(device)
            if i:
                t_hf.append(time.perf_counter() - t0)
            past = out.past_key_values
    return statistics.median(t_hf)


def graph_decode_step(engine, bsz, ctx, device, steps):
    """The model's decode forward replayed from a CUDA graph (worker/engine/cuda_graphs.py), batch
    ``bsz`` at context ``ctx``: what a graph-captured engine step costs without the scheduler and
    sampler. None when the module is missing; the error text when capture fails."""
    import torch
    try:
        from tandem.worker.engine.cuda_graphs import DecodeGraphRunner
    except ImportError:
        return None
    runner = engine.runner
    bs = runner.block_size
    nblk = -(-(ctx + 1) // bs)
    if bsz * nblk > runner.num_blocks:
        return None
    graphs = DecodeGraphRunner(runner.model, runner.kv_cache, max_batch=bsz, max_blocks=nblk,
                               device=device, sizes=(bsz,)).capture()
    tables = torch.arange(bsz * nblk, dtype=torch.int32, device=device).view(bsz, nblk)
    pos = torch.full((bsz,), ctx, dtype=torch.int64, device=device)
    slots = tables[:, -1].long() * bs + ctx % bs
    ids = torch.zeros(bsz, dtype=torch.int64, device=device)
    lens = torch.full((bsz,), ctx + 1, dtype=torch.int32, device=device)
    ms = median_time(lambda: graphs.run(ids, pos, slots, tables, lens), device, reps=steps) * 1e3
    if not graphs.graphs and str(device).startswith("cuda"):
        return "n/a (capture failed, see log)"
    replay = graphs.run(ids, pos, slots, tables, lens).clone()
    eager = graphs._forward(bsz)
    diff = float((replay - eager).abs().max())
    record("engine", what="graph replay == eager", batch=bsz, max_abs_diff=diff, ok=diff <= 1e-3)
    print(f"graph replay vs eager decode forward, batch {bsz}: max |diff| {diff:.3g}", flush=True)
    return ms


def bench_decode_compiled(hf, rows, device):
    """Last, since compiling takes the longest: HF static cache + torch.compile per decode row."""
    for row in rows:
        if row.get("what") != "decode step":
            continue
        try:
            row["hf static+compile ms"] = hf_static_compiled_step(hf, row["_prompts"], device) * 1e3
            row["ours/hf-compiled"] = row["ours ms"] / row["hf static+compile ms"]
        except Exception as e:  # a transformers/torch version whose StaticCache or compile differs
            row["hf static+compile ms"] = f"n/a ({type(e).__name__}: {str(e)[:120]})"
        _emit({k: v for k, v in row.items() if k != "_prompts"})


def _emit(row):
    row = {k: v for k, v in row.items() if not k.startswith("_")}
    record("engine", **{k.replace(" ", "_").replace("/", "_over_"): v for k, v in row.items()})
    print(row, flush=True)


def _has_logits_to_keep(hf):
    import inspect
    return "logits_to_keep" in inspect.signature(hf.forward).parameters


def hf_static_compiled_step(hf, x, device, steps=12):
    """Median decode step of transformers with a StaticCache and the one-token forward under
    torch.compile (``reduce-overhead``: CUDA graphs), the recipe of HF's "static cache" docs.
    The prompt is prefilled eagerly; every timed step feeds the previous greedy token."""
    import torch
    from transformers import StaticCache
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    bsz, plen = x.shape
    cache = StaticCache(config=hf.config, max_cache_len=plen + steps + 8)
    mode = "reduce-overhead" if str(device).startswith("cuda") else "default"

    def one_token(tok, pos):
        return hf(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1]
    compiled = torch.compile(one_token, mode=mode, fullgraph=True)
    with torch.inference_mode():
        out = hf(x, past_key_values=cache, cache_position=torch.arange(plen, device=device), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(steps + 3):  # the first calls compile and record the graph
            pos = torch.tensor([plen + i], device=device)
            sync(device)
            t0 = time.perf_counter()
            tok = compiled(tok, pos).argmax(-1, keepdim=True)
            sync(device)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048,8192,16384")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="512", help="decode steps at these prompt lengths (tokens)")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"])
    ap.add_argument("--compile", action="store_true", help="also time HF's static cache + torch.compile")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, torch backend")
    args = ap.parse_args()
    import torch
    if args.dry_run:
        device, dtype, dtype_name, shape, backend = "cpu", torch.float32, "float32", TINY, "torch"
        lengths, batches, contexts = [16, 40], [1, 3], [12]
    else:
        device = str(require_cuda("gpu_engine"))
        dtype, dtype_name, shape, backend = torch.bfloat16, "bfloat16", LLAMA3_8B, args.backend
        lengths = [int(v) for v in args.lengths.split(",")]
        batches = [int(v) for v in args.batches.split(",")]
        contexts = [int(v) for v in args.contexts.split(",")]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hf, loaded = build_models(shape, device, dtype)
    max_len = max(lengths + contexts) + DECODE_ROOM
    blocks = max(max_len // 16 + 8, max(batches) * (max(contexts) + DECODE_ROOM) // 16 + 8)
    engine = make_engine(loaded, device, dtype_name, backend, max_len, blocks, max(lengths),
                         args.quantization)
    print(f"models built in {time.perf_counter() - t0:.1f}s; backend {engine.runner.ops.backend}", flush=True)
    rows = []
    bench_ttft(engine, hf, lengths, shape["vocab_size"], device, rows)
    for prompt_len in contexts:
        bench_decode(engine, hf, batches, prompt_len, shape["vocab_size"], device, rows)
    if args.compile:
        del engine  # frees its KV cache and fused weights before compiling
        bench_decode_compiled(hf, rows, device)
    print("\nengine vs transformers (sdpa), Llama-3-8B shape, random weights")
    print(table(rows, ["what", "tokens", "batch", "context", "seqs/step", "preempted", "ours ms", "ours graph ms", "hf ms", "ours/hf",
                       "graph/hf", "hf static+compile ms", "ours/hf-compiled"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
