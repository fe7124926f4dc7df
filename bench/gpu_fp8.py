"""FP8 part of the GPU benchmark: ``fp8_linear_triton`` (per-token activation scales, per-channel
weight scales, FP8 tensor cores) against bf16 ``F.linear`` at Llama-3-8B's projection shapes.

TFLOP/s count 2*T*N*K; the FP8 time includes the activation quantization kernel.

    python bench/gpu_fp8.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import SMOKE, cuda_time_ms, record, rel_err, require_cuda, table  # noqa: E402


def main() -> int:
    dev = require_cuda("gpu_fp8")
    import torch
    import torch.nn.functional as F

    from tandem.kernels import fp8
    torch.manual_seed(0)
    rows = []
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    dtype = torch.bfloat16 if not SMOKE else torch.float16
    if SMOKE:
        shapes = {"qkv": (96, 64), "down": (64, 160)}
    for t in ((1, 32, 2048, 8192) if not SMOKE else (1, 20)):
        for name, (n, k) in shapes.items():
            x = torch.randn(t, k, dtype=dtype, device=dev)
            w = torch.randn(n, k, dtype=dtype, device=dev) * 0.02
            w8, ws = fp8.quantize_weight_fp8(w)
            ms8 = cuda_time_ms(lambda: fp8.fp8_linear_triton(x, w8, ws))
            ms16 = cuda_time_ms(lambda: F.linear(x, w))
            err = rel_err(fp8.fp8_linear_triton(x, w8, ws), x.double() @ w.double().t())
            flops = 2.0 * t * n * k
            row = {"tokens": t, "layer": name, "fp8 ms": ms8, "fp8 TF/s": flops / ms8 / 1e9,
                   "bf16 ms": ms16, "bf16 TF/s": flops / ms16 / 1e9, "speedup": ms16 / ms8, "rel_err": err}
            rows.append(row)
            record("fp8", **{k_.replace(" ", "_").replace("/", "_per_"): v for k_, v in row.items()})
    print(table(rows, ["tokens", "layer", "fp8 ms", "fp8 TF/s", "bf16 ms", "bf16 TF/s", "speedup", "rel_err"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
