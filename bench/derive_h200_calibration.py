"""Write bench/calibrations/llama3-8b-h200.yaml: a GPU-shaped calibration DERIVED from published H200
figures, not measured by tandem (no GPU runs tandem's engine in this project's CI).

    PYTHONSAFEPATH=1 .venv/bin/python bench/derive_h200_calibration.py [-o FILE]

Sources (the project's design notes, "Reference figures", measured on one H200 with torch 2.11 and
triton 3.6, Llama-3-8B shapes with random weights), copied into FIGURES below. Every step from those
figures to a coefficient is in ASSUMPTIONS, which the file carries under ``derived.assumptions``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

from tandem.worker.api.calibration import fit

OUT = Path(__file__).resolve().parent / "calibrations" / "llama3-8b-h200.yaml"

# Llama-3-8B: 32 layers, 8 KV heads of 128 dims, K and V, bf16
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
FIGURES = {
    "prefill_ttft_s": {512: 0.029, 2048: 0.062, 8192: 0.260, 16384: 0.584},   # HF transformers, one prompt
    "decode_step_s": {1: 0.0087, 32: 0.0150},            # HF generate, static KV cache, torch.compile
    "decode_attention": {"batch": 64, "context": 4096, "seconds": 0.51e-3, "kv_read_bytes_per_s": 2.09e12},
    "attention_tflops_16k": 337.0,                         # causal attention, SDPA flash, 16k tokens
    "memory_copy_bytes_per_s": 4.23e12,                    # read + write
    "gpu_memory_gib": 139,
}
DECODE_CONTEXT = 128          # assumed context of the decode-step figures
LINK_BYTES_PER_S = 50e9       # assumed prefill -> decode link: 400 Gb/s RDMA
LINK_SETUP_S = 0.002          # assumed handshake per transfer
BLOCK = 16
GPU_MEMORY_UTILIZATION = 0.9
WEIGHTS_BYTES = 16.06e9       # 8.03 B parameters in bf16
ACTIVATION_RESERVE_BYTES = 4e9

ASSUMPTIONS = [
    "DERIVED, NOT MEASURED by tandem: every coefficient comes from the H200 reference figures below, which were "
    "measured with Hugging Face transformers and torch on Llama-3-8B shapes with random weights, not with "
    "tandem's engine.",
    "prefill a + b*n + c*n^2 is fitted (non-negative least squares, relative) to the HF prefill TTFT of one "
    "prompt at 512 / 2048 / 8192 / 16384 tokens: 29 / 62 / 260 / 584 ms. tandem's engine is taken to prefill as "
    "fast as HF eager does (no chunked prefill, one prompt per forward at these sizes).",
    "prefill d (new tokens x cached tokens): attention of n new tokens over k cached ones costs 4*n*k*4096*32 "
    "FLOPs; at the 337 TFLOP/s the SDPA flash kernel reaches at 16k tokens, d = 524288 / 3.37e14 s.",
    "decode_step d + e*batch + f*batch*context with g = 0: on a GPU the batch-1 step is a weight read like "
    "any other batch (no matrix-vector to matrix-matrix jump as on the CPU).",
    "decode f: a sequence's step reads its whole KV, 131072 bytes per token (32 layers x 8 KV heads x 128 "
    "x K,V x bf16), at the 2.09 TB/s measured for decode attention at batch 64, context 4096; f = 131072 / "
    "2.09e12 s per token of context.",
    "decode d and e: the torch.compile static-cache step, 8.7 ms at batch 1 and 15.0 ms at batch 32, at an "
    f"assumed context of {DECODE_CONTEXT} tokens (the figure does not say); the eager HF step (21.9 / 38.4 ms) "
    "is Python overhead a serving engine with CUDA graphs does not pay.",
    f"kv_transfer g + h*bytes: the table has no network figure; a {LINK_BYTES_PER_S * 8 / 1e9:g} Gb/s RDMA link "
    f"between prefill and decode GPUs and {LINK_SETUP_S * 1e3:g} ms per transfer are assumed. The KV streams "
    "while the prefill computes, so a remote prefill takes the longer of the two (capacity.PerfModel); at these "
    "figures it is the compute. The decode side's write into its cache runs at the 4.23 TB/s copy bandwidth, "
    "under 1 ms for 16k tokens, and is left out.",
    f"engine.num_blocks: one H200 ({FIGURES['gpu_memory_gib']} GiB usable) at {GPU_MEMORY_UTILIZATION:g} memory "
    f"utilization, less {WEIGHTS_BYTES / 1e9:g} GB of bf16 weights and {ACTIVATION_RESERVE_BYTES / 1e9:g} GB of "
    f"activations, in blocks of {BLOCK} tokens of 131072 bytes each.",
    "One GPU per replica, tensor parallelism 1.",
]


def build() -> dict:
    pre = fit("prefill", [[n, 0.0, s] for n, s in FIGURES["prefill_ttft_s"].items()])
    a, b, c, _ = (float(x) for x in pre.coef)
    d_cached = 4 * 4096 * 32 / (FIGURES["attention_tflops_16k"] * 1e12)
    f = KV_BYTES_PER_TOKEN / FIGURES["decode_attention"]["kv_read_bytes_per_s"]
    s1, s32 = FIGURES["decode_step_s"][1], FIGURES["decode_step_s"][32]
    e = (s32 - s1 - 31 * f * DECODE_CONTEXT) / 31
    d = s1 - e - f * DECODE_CONTEXT
    usable = FIGURES["gpu_memory_gib"] * 2**30 * GPU_MEMORY_UTILIZATION - WEIGHTS_BYTES - ACTIVATION_RESERVE_BYTES
    blocks = int(usable // (BLOCK * KV_BYTES_PER_TOKEN))
    pre_samples = [[float(n), 0.0, s] for n, s in FIGURES["prefill_ttft_s"].items()]
    dec_samples = [[1.0, float(DECODE_CONTEXT), s1], [32.0, float(DECODE_CONTEXT), s32]]
    pred = [a + b * n + c * n * n for n, _, _ in pre_samples]
    rel = [abs(p - s[2]) / s[2] for p, s in zip(pred, pre_samples)]
    return {
        "apiVersion": "bench.tandem.dev/v1", "kind": "Calibration", "model": "llama-3-8b",
        "measured": {"derived_not_measured": True, "host": "none (derived from published H200 figures)",
                     "command": "python bench/derive_h200_calibration.py"},
        "derived": {"source": "H200 reference figures (torch 2.11, triton 3.6; Llama-3-8B shapes)",
                    "figures": {k: ({str(kk): vv for kk, vv in v.items()} if isinstance(v, dict) else v)
                                for k, v in FIGURES.items()},
                    "assumptions": ASSUMPTIONS},
        "engine": {"role": "both", "block_size": BLOCK, "max_model_len": 16384, "num_blocks": blocks,
                   "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "gpus": 1},
        "prefill": {"formula": "a + b*n + c*n^2 + d*n*k", "unit": "seconds",
                    "coefficients": {"a": a, "b": b, "c": c, "d": d_cached},
                    "fit": {"points": 4, "mean_abs_rel_err": round(float(np.mean(rel)), 4),
                            "max_abs_rel_err": round(float(np.max(rel)), 4)},
                    "range": {"n": [512.0, 16384.0], "k": [0.0, 0.0]}, "samples": pre_samples},
        "decode_step": {"formula": "d + g*(batch>1) + e*batch + f*batch*context", "unit": "seconds",
                        "coefficients": {"d": d, "g": 0.0, "e": e, "f": f},
                        "fit": {"points": 2, "mean_abs_rel_err": 0.0, "max_abs_rel_err": 0.0},
                        "range": {"batch": [1.0, 32.0], "context": [float(DECODE_CONTEXT)] * 2},
                        "samples": dec_samples},
        "kv_transfer": {"formula": "g + h*bytes", "unit": "seconds",
                        "coefficients": {"g": LINK_SETUP_S, "h": 1.0 / LINK_BYTES_PER_S},
                        "range": {"bytes": [512.0 * KV_BYTES_PER_TOKEN, 16384.0 * KV_BYTES_PER_TOKEN]},
                        "samples": []},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=str(OUT))
    args = ap.parse_args()
    head = ("# DERIVED, NOT MEASURED: a GPU-shaped performance model for the simulator, from published H200\n"
            "# figures (see derived.assumptions). Regenerate: python bench/derive_h200_calibration.py\n")
    Path(args.output).write_text(head + yaml.safe_dump(build(), sort_keys=False, width=110))
    print(args.output)


if __name__ == "__main__":
    main()
