"""Write bench/calibrations/llama3-8b-h200.yaml: a GPU-shaped calibration DERIVED from published H200
figures, not measured by tandem (no GPU runs tandem's engine in this project's CI).

    PYTHONSAFEPATH=1 .venv/bin/python bench/derive_h200_calibration.py [-o FILE]
    PYTHONSAFEPATH=1 .venv/bin/python bench/derive_h200_calibration.py \
        --measured bench/gpu_runs/2026-12-04-h200-engine.jsonl     # -> llama3-8b-h200-tandem.yaml

``--measured`` takes the prefill TTFT and decode step of tandem's own engine instead (the ``engine``
rows that ``bench/gpu_engine.py --lengths ... --batches ... --contexts ...`` writes on an H200): the
engine alone, in-process, random Llama-3-8B weights, no HTTP server or router in the path. The
cached-prefix attention term, the KV link and the memory plan stay the derived assumptions below.

Sources (the project's design notes, "Reference figures", measured on one H200 with torch 2.11 and
triton 3.6, Llama-3-8B shapes with random weights), copied into FIGURES below. Every step from those
figures to a coefficient is in ASSUMPTIONS, which the file carries under ``derived.assumptions``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import yaml

from tandem.worker.api.calibration import fit

OUT = Path(__file__).resolve().parent / "calibrations" / "llama3-8b-h200.yaml"
OUT_MEASURED = OUT.with_name("llama3-8b-h200-tandem.yaml")

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


def _rel_errors(f, samples) -> dict:
    rel = [abs(f.predict(*row[:-1]) - row[-1]) / row[-1] for row in samples]
    return {"points": len(samples), "mean_abs_rel_err": round(float(np.mean(rel)), 4),
            "max_abs_rel_err": round(float(np.max(rel)), 4)}


def measured_samples(path: Path) -> tuple[list, list, dict]:
    """``(prefill rows [n, 0, s], decode rows [batch, context, s], provenance)`` from the ``engine``
    rows of a ``bench/gpu_engine.py`` results file. Raises ValueError when either kind is missing."""
    pre, dec, rows = [], [], [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        if r.get("what") == "TTFT" and isinstance(r.get("ours_ms"), (int, float)):
            pre.append([float(r["tokens"]), 0.0, r["ours_ms"] / 1e3])
        elif r.get("what") == "decode step" and isinstance(r.get("ours_ms"), (int, float)):
            dec.append([float(r["batch"]), float(r.get("context", 512)), r["ours_ms"] / 1e3])
    if len(pre) < 3 or len(dec) < 4:
        raise ValueError(f"{path}: {len(pre)} TTFT and {len(dec)} decode-step rows; need 3 and 4")
    first = rows[0]
    return pre, dec, {k: first.get(k) for k in ("gpu", "torch", "triton", "commit", "date")}


def build(measured: Path | None = None) -> dict:
    if measured is None:
        pre_samples = [[float(n), 0.0, s] for n, s in FIGURES["prefill_ttft_s"].items()]
    else:
        pre_samples, dec_samples, provenance = measured_samples(measured)
    pre = fit("prefill", pre_samples)
    a, b, c, _ = (float(x) for x in pre.coef)
    d_cached = 4 * 4096 * 32 / (FIGURES["attention_tflops_16k"] * 1e12)
    if measured is None:
        f = KV_BYTES_PER_TOKEN / FIGURES["decode_attention"]["kv_read_bytes_per_s"]
        s1, s32 = FIGURES["decode_step_s"][1], FIGURES["decode_step_s"][32]
        e = (s32 - s1 - 31 * f * DECODE_CONTEXT) / 31
        d = s1 - e - f * DECODE_CONTEXT
        g = 0.0
        dec_samples = [[1.0, float(DECODE_CONTEXT), s1], [32.0, float(DECODE_CONTEXT), s32]]
        dec_fit = {"points": 2, "mean_abs_rel_err": 0.0, "max_abs_rel_err": 0.0}
    else:
        dec = fit("decode_step", dec_samples)
        d, g, e, f = (float(x) for x in dec.coef)
        dec_fit = _rel_errors(dec, dec_samples)
    usable = FIGURES["gpu_memory_gib"] * 2**30 * GPU_MEMORY_UTILIZATION - WEIGHTS_BYTES - ACTIVATION_RESERVE_BYTES
    blocks = int(usable // (BLOCK * KV_BYTES_PER_TOKEN))
    if measured is None:
        head = {"measured": {"derived_not_measured": True, "host": "none (derived from published H200 figures)",
                             "command": "python bench/derive_h200_calibration.py"},
                "derived": {"source": "H200 reference figures (torch 2.11, triton 3.6; Llama-3-8B shapes)",
                            "figures": {k: ({str(kk): vv for kk, vv in v.items()} if isinstance(v, dict) else v)
                                        for k, v in FIGURES.items()},
                            "assumptions": ASSUMPTIONS}}
    else:
        head = {"measured": {"derived_not_measured": False, "host": f"{provenance['gpu']} (device machine)",
                             "what": "tandem's engine in-process (bench/gpu_engine.py): prefill TTFT of one "
                                     "prompt and the decode step, Llama-3-8B shape, random bf16 weights, "
                                     "Triton attention, CUDA-graph decode",
                             **provenance,
                             "command": f"python bench/derive_h200_calibration.py --measured {measured}"},
                "derived": {"assumptions": [
                    "prefill a + b*n + c*n^2 and decode d + g*(batch>1) + e*batch + f*batch*context are fitted "
                    "(non-negative least squares, relative) to the measured rows in the samples below.",
                    ASSUMPTIONS[2], ASSUMPTIONS[6], ASSUMPTIONS[7], ASSUMPTIONS[8]]}}
    return {
        "apiVersion": "bench.tandem.dev/v1", "kind": "Calibration", "model": "llama-3-8b",
        **head,
        "engine": {"role": "both", "block_size": BLOCK, "max_model_len": 16384, "num_blocks": blocks,
                   "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "gpus": 1},
        "prefill": {"formula": "a + b*n + c*n^2 + d*n*k", "unit": "seconds",
                    "coefficients": {"a": a, "b": b, "c": c, "d": d_cached},
                    "fit": _rel_errors(pre, pre_samples),
                    "range": {"n": [min(r[0] for r in pre_samples), max(r[0] for r in pre_samples)],
                              "k": [0.0, 0.0]}, "samples": pre_samples},
        "decode_step": {"formula": "d + g*(batch>1) + e*batch + f*batch*context", "unit": "seconds",
                        "coefficients": {"d": d, "g": g, "e": e, "f": f},
                        "fit": dec_fit,
                        "range": {"batch": [min(r[0] for r in dec_samples), max(r[0] for r in dec_samples)],
                                  "context": [min(r[1] for r in dec_samples), max(r[1] for r in dec_samples)]},
                        "samples": dec_samples},
        "kv_transfer": {"formula": "g + h*bytes", "unit": "seconds",
                        "coefficients": {"g": LINK_SETUP_S, "h": 1.0 / LINK_BYTES_PER_S},
                        "range": {"bytes": [512.0 * KV_BYTES_PER_TOKEN, 16384.0 * KV_BYTES_PER_TOKEN]},
                        "samples": []},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output")
    ap.add_argument("--measured", type=Path, help="results.jsonl of bench/gpu_engine.py on an H200")
    args = ap.parse_args()
    if args.measured is None:
        head = ("# DERIVED, NOT MEASURED: a GPU-shaped performance model for the simulator, from published H200\n"
                "# figures (see derived.assumptions). Regenerate: python bench/derive_h200_calibration.py\n")
    else:
        head = ("# MEASURED on an H200 with tandem's engine in-process (see measured); the cached-prefix term, the\n"
                f"# KV link and the memory plan are derived. Regenerate: "
                f"python bench/derive_h200_calibration.py --measured {args.measured}\n")
    args.output = args.output or str(OUT if args.measured is None else OUT_MEASURED)
    Path(args.output).write_text(head + yaml.safe_dump(build(args.measured), sort_keys=False, width=110))
    print(args.output)
    # the measured prefill factor belongs to these fits, so a regenerated file is without it until then
    print(f"then measure its prefill capacity factor: PYTHONSAFEPATH=1 python bench/capacity_by_size.py --role "
          f"prefill --seed 3 --counts 2,4,8 --duration 1800 --calibration {args.output} --write")


if __name__ == "__main__":
    main()
