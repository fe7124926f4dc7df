"""Part 2 of the GPU benchmark: kernel timings against torch SDPA's flash and cuDNN backends.

* Prefill attention, causal, 32 q / 8 kv heads, d=128, bf16, one sequence of 1k..32k tokens:
  ours reads K/V through a block table (block size 16, scattered blocks); SDPA gets contiguous
  [1, H, L, D] tensors with K/V expanded to 32 heads (its flash and cuDNN kernels take no GQA).
  TFLOP/s count the causal half: 2 * L^2 * Hq * D (QK^T and PV, 2 flops per MAC, halved).
  Also ours with half the sequence as a cached prefix (the chunked-prefill shape), and with
  128-token blocks through the same gathers and through TMA tensor descriptors (PREFILL_CONFIG["tma"]).
* Decode attention, batch 1/16/64 over contexts of 1k..32k: bandwidth = bytes of K and V read
  (B * ctx * Hk * D * 2 * 2 bytes) over the median time; SDPA (enable_gqa) gets contiguous caches.

CUDA events, median of up to 20 reps. ``--quick`` runs a subset (for a first look, ~30 s);
``--sweep`` times alternative tile configurations of both kernels (to pick PREFILL_CONFIG /
DECODE_CONFIG on a new GPU).

    python bench/gpu_kernels.py [--quick] [--only prefill|decode] [--sweep]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import SMOKE, cuda_time_ms, paged_cache, prefill_tma, record, require_cuda, table  # noqa: E402


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def bench_prefill(dev, lengths, rows):
    import torch
    dtype = torch.bfloat16 if not SMOKE else torch.float16
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from tandem.kernels.prefill import prefill_attention_triton
    hq, hk, d, bs = 32, 8, 128, 16
    scale = d ** -0.5
    for n in lengths:
        flops = 2.0 * n * n * hq * d
        kc, vc, tables = paged_cache([n], hk, d, bs, dtype, dev)
        q = torch.randn(n, hq, d, dtype=dtype, device=dev)
        seq_lens = torch.tensor([n], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        row = {"op": "prefill", "tokens": n}
        ms = cuda_time_ms(lambda: prefill_attention_triton(q, kc, vc, tables, cu, seq_lens, scale))
        row["ours ms"], row["ours TF/s"] = ms, flops / ms / 1e9
        # 128-token blocks: the same gather kernel, then tensor-descriptor (TMA) loads, one per tile
        kc128, vc128, tables128 = paged_cache([n], hk, d, 128, dtype, dev)
        ms_g = cuda_time_ms(lambda: prefill_attention_triton(q, kc128, vc128, tables128, cu, seq_lens, scale))
        row["bs128 TF/s"] = flops / ms_g / 1e9
        try:
            with prefill_tma():
                ms_t = cuda_time_ms(lambda: prefill_attention_triton(q, kc128, vc128, tables128, cu, seq_lens, scale))
            row["bs128 TMA TF/s"] = flops / ms_t / 1e9
        except Exception as e:
            row["bs128 TMA TF/s"] = f"n/a ({type(e).__name__}: {str(e)[:80]})"
        del kc128, vc128
        # the same total keys, half of them a cached prefix: the query half costs 3/4 of the full causal work
        half = n // 2
        cu_h = torch.tensor([0, n - half], dtype=torch.int32, device=dev)
        qh = q[:n - half].contiguous()
        ms_p = cuda_time_ms(lambda: prefill_attention_triton(qh, kc, vc, tables, cu_h, seq_lens, scale))
        row["prefix½ TF/s"] = 0.75 * flops / ms_p / 1e9
        # SDPA on contiguous tensors, K/V expanded for GQA
        idx = tables[0].long()
        k = kc[idx].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(hq // hk, 0)[None]
        v = vc[idx].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(hq // hk, 0)[None]
        qs = q.transpose(0, 1)[None].contiguous()
        k, v = k.contiguous(), v.contiguous()
        for name, backend in sdpa_backends().items():
            try:
                with sdpa_kernel(backend):
                    ms_b = cuda_time_ms(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale))
                row[f"{name} TF/s"] = flops / ms_b / 1e9
            except Exception as e:  # a backend not built in this torch
                row[f"{name} TF/s"] = f"n/a ({type(e).__name__})"
        cudnn = row.get("sdpa-cudnn TF/s")
        if isinstance(cudnn, float):
            row["ours/cudnn"] = row["ours TF/s"] / cudnn
        rows.append(row)
        record("kernels", **{k_.replace(" ", "_"): v_ for k_, v_ in row.items()})
        print(row, flush=True)
        del kc, vc, k, v


def bench_decode(dev, batches, contexts, rows):
    import torch
    dtype = torch.bfloat16 if not SMOKE else torch.float16
    import torch.nn.functional as F

    from tandem.kernels.decode import decode_attention_triton
    hq, hk, d, bs = 32, 8, 128, 16
    scale = d ** -0.5
    for bsz in batches:
        for ctx in contexts:
            if bsz * ctx > 64 * 32768:
                continue
            nbytes = bsz * ctx * hk * d * 2 * 2
            kc, vc, tables = paged_cache([ctx] * bsz, hk, d, bs, dtype, dev)
            q = torch.randn(bsz, hq, d, dtype=dtype, device=dev)
            seq_lens = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
            row = {"op": "decode", "batch": bsz, "ctx": ctx}
            ms = cuda_time_ms(lambda: decode_attention_triton(q, kc, vc, tables, seq_lens, scale))
            row["ours ms"], row["ours TB/s"] = ms, nbytes / ms / 1e9
            # SDPA on contiguous [B, Hk, ctx, D] caches (the layout HF's static cache has)
            kk = torch.randn(bsz, hk, ctx, d, dtype=dtype, device=dev)
            vv = torch.randn_like(kk)
            qs = q[:, :, None]
            ms_s = cuda_time_ms(lambda: F.scaled_dot_product_attention(qs, kk, vv, scale=scale, enable_gqa=True))
            row["sdpa ms"], row["sdpa TB/s"] = ms_s, nbytes / ms_s / 1e9
            row["speedup"] = ms_s / ms
            rows.append(row)
            record("kernels", **{k_.replace(" ", "_"): v_ for k_, v_ in row.items()})
            print(row, flush=True)
            del kc, vc, kk, vv


def sweep(dev):
    """Time tile configurations: prefill at 8k/16k (d=128, bf16), decode at batch 1 and 64, ctx 8k."""
    import torch

    from tandem.kernels import decode, prefill
    hq, hk, d, bs = 32, 8, 128, 16
    dtype = torch.bfloat16 if not SMOKE else torch.float16
    rows = []
    base_p = dict(prefill.PREFILL_CONFIG["gpu16"])
    if SMOKE:  # the interpreter takes its own tiles; point it at the table being swept
        prefill.PREFILL_CONFIG["interpret"] = None
        prefill.prefill_config = lambda d_pad, dtype: prefill.PREFILL_CONFIG["gpu16"][d_pad]
    for cfg in [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                (128, 32, 4, 4), (256, 64, 8, 2)]:
        prefill.PREFILL_CONFIG["gpu16"][128] = cfg
        for n, page, tma in [(n, p, t) for n in ((8192, 16384) if not SMOKE else (40,))
                             for p, t in ((bs, False), (128, True))]:
            if tma and 128 % cfg[1]:
                continue
            prefill.PREFILL_CONFIG["tma"] = tma
            kc, vc, tables = paged_cache([n], hk, d, page, dtype, dev)
            q = torch.randn(n, hq, d, dtype=dtype, device=dev)
            lens = torch.tensor([n], dtype=torch.int32, device=dev)
            cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
            try:
                ms = cuda_time_ms(lambda: prefill.prefill_attention_triton(q, kc, vc, tables, cu, lens, d ** -0.5))
                tf = 2.0 * n * n * hq * d / ms / 1e9
            except Exception as e:  # out of shared memory, say
                ms, tf = float("nan"), f"{type(e).__name__}"
            prefill.PREFILL_CONFIG["tma"] = False
            row = {"kernel": "prefill", "config (BM,BN,warps,stages)": str(cfg) + (" TMA bs128" if tma else ""),
                   "size": n, "ms": ms, "TF/s": tf}
            rows.append(row)
            record("sweep", **{k.replace(" ", "_"): v for k, v in row.items()})
    prefill.PREFILL_CONFIG["gpu16"].clear()
    prefill.PREFILL_CONFIG["gpu16"].update(base_p)
    base_d = dict(decode.DECODE_CONFIG["gpu"])
    for block_n, warps, stages in [(64, 4, 2), (32, 4, 3), (128, 4, 2), (128, 8, 2), (64, 4, 4)]:
        decode.DECODE_CONFIG["gpu"].update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        for bsz in (1, 64):
            ctx = 8192 if not SMOKE else 40
            kc, vc, tables = paged_cache([ctx] * bsz, hk, d, bs, dtype, dev)
            q = torch.randn(bsz, hq, d, dtype=dtype, device=dev)
            lens = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
            ms = cuda_time_ms(lambda: decode.decode_attention_triton(q, kc, vc, tables, lens, d ** -0.5))
            row = {"kernel": "decode", "config (BN,warps,stages)": str((block_n, warps, stages)),
                   "size": f"b{bsz} ctx{ctx}", "ms": ms, "TB/s": bsz * ctx * hk * d * 4 / ms / 1e9}
            rows.append(row)
            record("sweep", **{k.replace(" ", "_"): v for k, v in row.items()})
    decode.DECODE_CONFIG["gpu"].update(base_d)
    print(table([r for r in rows if r["kernel"] == "prefill"], ["config (BM,BN,warps,stages)", "size", "ms", "TF/s"]))
    print(table([r for r in rows if r["kernel"] == "decode"], ["config (BN,warps,stages)", "size", "ms", "TB/s"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["prefill", "decode"])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    dev = require_cuda("gpu_kernels")
    import torch
    torch.manual_seed(0)
    if args.sweep:
        sweep(dev)
        return 0
    rows_p, rows_d = [], []
    lengths = [1024, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    batches = [1, 64] if args.quick else [1, 16, 64]
    contexts = [4096] if args.quick else [1024, 4096, 8192, 16384, 32768]
    if SMOKE:
        lengths, batches, contexts = [48, 100], [1, 3], [40, 70]
    if args.only in (None, "prefill"):
        bench_prefill(dev, lengths, rows_p)
    if args.only in (None, "decode"):
        bench_decode(dev, batches, contexts, rows_d)
    if rows_p:
        print("\nprefill attention, causal, 32/8 heads, d=128, bf16 (TFLOP/s)")
        print(table(rows_p, ["tokens", "ours ms", "ours TF/s", "bs128 TF/s", "bs128 TMA TF/s",
                             "prefix½ TF/s", "sdpa-flash TF/s", "sdpa-cudnn TF/s", "ours/cudnn"]))
    if rows_d:
        print("\ndecode attention, 32/8 heads, d=128, bf16 (TB/s of KV read)")
        print(table(rows_d, ["batch", "ctx", "ours ms", "ours TB/s", "sdpa ms", "sdpa TB/s", "speedup"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
