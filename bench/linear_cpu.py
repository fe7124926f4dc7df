"""The CPU linear layer's BLAS call per row count: ``F.linear`` against ``(w @ x.T).T`` and oneDNN's
linear, over a weight set the size of SmolLM2-135M's (30 layers of qkv, o, gate/up and down, plus the
LM head: 513 MiB in fp32, far past the caches), interleaved in one run. Prints ms per pass and the
ratio to ``F.linear``; kernels/linear.py picks the fastest per row count. See docs/cpu.md.

    .venv/bin/python bench/linear_cpu.py [--rows 1,2,4,8,16,64] [--repeats 10] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tandem.kernels.linear import linear_ref

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]

VARIANTS = {
    "F.linear": lambda x, w: F.linear(x, w),
    "(w @ x.T).T": lambda x, w: torch.mm(w, x.t()).t().contiguous(),
    "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
    "tandem": linear_ref,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(o, i) for _ in range(LAYERS) for o, i in SHAPES] + [torch.randn(VOCAB, HIDDEN)]
    print(f"{torch.get_num_threads()} threads; {sum(w.numel() * 4 for w in weights) / 2**20:.0f} MiB of fp32 weights")
    print(f"| rows | {' | '.join(VARIANTS)} | speed-up of the best | speed-up of tandem |")
    print("|---" * (len(VARIANTS) + 3) + "|")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats + 2):          # interleaved: a noisy neighbour hits every variant alike
            for name, fn in VARIANTS.items():
                t = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - t)
        med = {n: statistics.median(v[2:]) * 1e3 for n, v in times.items()}
        base = med["F.linear"]
        print(f"| {m} | " + " | ".join(f"{med[n]:.1f} ms" for n in VARIANTS)
              + f" | {base / min(med.values()):.2f}x | {base / med['tandem']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
