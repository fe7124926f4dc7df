"""Compile every Triton kernel for a GPU target on any machine (no GPU needed) and report resources.

Triton's wheel ships ptxas and cuobjdump, so the kernels can be compiled for sm_90 (H100/H200) here:
that catches what the CPU interpreter cannot (compile-mode type rules, shared-memory overflow) and
shows registers, spills (LOCAL/STACK bytes), shared memory, and whether the matrix products became
Hopper's ``HGMMA``/``QGMMA`` (wgmma) instructions or older ``HMMA``.

    python bench/gpu_compile_check.py [--arch 90] [--sass DIR]

Exit status 1 if a kernel fails to compile, or a 16-bit / FP8 variant spills registers (the fp32
variants, a correctness mode on GPUs, may spill a little: Triton 3.6 spills 216 B on fp32 prefill).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before any kernel module is imported: real JIT functions
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def variants(arch: int):
    """(name, kernel, pointer/float overrides, constexprs, launch options) of every kernel we ship,
    at the engine's GPU configurations (Llama-3-8B / SmolLM2 shapes)."""
    from tandem.kernels import activation, decode, fp8, norm, prefill, rope
    bf = "*bf16"
    out = [
        ("rms_norm+res h4096", norm._rms_norm_kernel, {"eps": "fp32"}, dict(HAS_RES=True, BLOCK=4096), dict(num_warps=8)),
        ("silu_and_mul", activation._silu_and_mul_kernel, {}, dict(BLOCK=1024), dict(num_warps=4)),
    ]
    rope_types = {"pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64", "kv_scale": "fp32"}
    rope_c = dict(HALF=64, HQ_PAD=32, HK_PAD=8, HALF_PAD=64, SCALED=False, FP8=False, INTERP=False)
    out.append(("rope_and_cache 32/8 d128", rope._rope_and_cache_kernel, rope_types, rope_c, dict(num_warps=8)))
    out.append(("rope_and_cache fp8 cache", rope._rope_and_cache_kernel,
                {**rope_types, "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"},
                {**rope_c, "SCALED": True, "FP8": True}, dict(num_warps=8)))
    attn_types = {"bt_ptr": "*i32", "cu_ptr": "*i32", "lens_ptr": "*i32", "qk_scale": "fp32",
                  "out_scale": "fp32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"}
    for d, (bm, bn, warps, stages) in sorted(prefill.PREFILL_CONFIG["gpu16"].items()):
        if d > 128:
            continue
        for tma in (False, True):
            out.append((f"prefill d{d} bf16 {bm}x{bn}" + (" TMA" if tma else ""), prefill._prefill_kernel,
                        attn_types, dict(GROUP=4, D=d, D_PAD=d, BLOCK_M=bm, BLOCK_N=bn, PREC="tf32", TMA=tma),
                        dict(num_warps=warps, num_stages=stages)))
    bm, bn, warps, stages = prefill.PREFILL_CONFIG["gpu16"][128]
    out.append(("prefill d128 fp8 kv", prefill._prefill_kernel,
                {**attn_types, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"},
                dict(GROUP=4, D=128, D_PAD=128, BLOCK_M=bm, BLOCK_N=bn, PREC="tf32", TMA=False),
                dict(num_warps=warps, num_stages=stages)))
    f32 = {**attn_types, "q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "out_ptr": "*fp32"}
    for d in (64, 128):
        bm, bn, warps, stages = prefill.PREFILL_CONFIG["gpu32"][d]
        out.append((f"prefill d{d} fp32 (tf32x3)", prefill._prefill_kernel, f32,
                    dict(GROUP=4, D=d, D_PAD=d, BLOCK_M=bm, BLOCK_N=bn, PREC="tf32x3", TMA=False),
                    dict(num_warps=warps, num_stages=stages)))
    dc = decode.DECODE_CONFIG["gpu"]
    for direct in (False, True):
        out.append((f"decode split d128 direct={direct}", decode._decode_split_kernel, attn_types,
                    dict(GROUP=4, G_PAD=16, D=128, D_PAD=128, BLOCK_N=dc["BLOCK_N"], DIRECT=direct, PREC="tf32"),
                    dict(num_warps=dc["num_warps"], num_stages=dc["num_stages"])))
    out.append(("decode split d64 group3 (SmolLM2)", decode._decode_split_kernel, attn_types,
                dict(GROUP=3, G_PAD=16, D=64, D_PAD=64, BLOCK_N=dc["BLOCK_N"], DIRECT=False, PREC="tf32"),
                dict(num_warps=dc["num_warps"], num_stages=dc["num_stages"])))
    out.append(("decode split fp8 kv", decode._decode_split_kernel,
                {**attn_types, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"},
                dict(GROUP=4, G_PAD=16, D=128, D_PAD=128, BLOCK_N=dc["BLOCK_N"], DIRECT=False, PREC="tf32"),
                dict(num_warps=dc["num_warps"], num_stages=dc["num_stages"])))
    out.append(("decode split d128 fp32 (tf32x3)", decode._decode_split_kernel, f32,
                dict(GROUP=4, G_PAD=16, D=128, D_PAD=128, BLOCK_N=dc["BLOCK_N"], DIRECT=False, PREC="tf32x3"),
                dict(num_warps=dc["num_warps"], num_stages=dc["num_stages"])))
    out.append(("decode reduce", decode._decode_reduce_kernel, {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_scale": "fp32"},
                dict(D=128, D_PAD=128, S_PAD=64), dict(num_warps=4)))
    out.append(("quantize_per_token_fp8", fp8._quantize_rows_kernel,
                {"x_ptr": bf, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "min_scale": "fp32"},
                dict(BLOCK=4096, INTERP=False), dict(num_warps=4)))
    mm = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "as_ptr": "*fp32", "bs_ptr": "*fp32", "bias_ptr": bf}
    out.append(("fp8 matmul 128x128x128", fp8._fp8_matmul_kernel, mm,
                dict(HAS_BIAS=True, FP8_DOT=arch >= 89, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
                dict(num_warps=8, num_stages=4)))
    out.append(("fp8 matmul 16x64x128 (decode)", fp8._fp8_matmul_kernel, mm,
                dict(HAS_BIAS=False, FP8_DOT=arch >= 89, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8),
                dict(num_warps=4, num_stages=4)))
    return out


# Integer arguments the JIT would see as multiples of 16 at the engine's shapes (it specializes on
# that, which enables 16-byte vector loads); pointers from torch allocations are 16-byte aligned too.
DIV16 = {"block_size", "H", "I", "K", "N", "cache_rows", "kv_row_len", "q_row_len"}


def divisibility(kernel, sig: dict) -> dict:
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
            if sig[p.name].startswith("*") or p.name in DIV16
            or (p.name.startswith("stride_") and p.name != "stride_bt")}


def signature(kernel, types: dict, constexprs: dict) -> dict:
    sig = {}
    for p in kernel.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        else:
            sig[name] = "i32"
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"constexprs missing: {missing}")
    return sig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sass", help="write each kernel's SASS into this folder")
    ap.add_argument("--only", help="compile only variants whose name contains this")
    args = ap.parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    target = GPUTarget("cuda", args.arch, 32)
    rows, failed = [], 0
    for name, kernel, types, constexprs, opts in variants(args.arch):
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            sig = signature(kernel, types, constexprs)
            src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=divisibility(kernel, sig))
            compiled = triton.compile(src, target=target, options=opts)
        except Exception as e:
            failed += 1
            msg = str(e).strip().splitlines()
            print(f"FAIL {name}: {type(e).__name__}: {msg[-1] if msg else ''}\n{str(e)[:3000]}", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            res = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", str(cubin)],
                                 capture_output=True, text=True).stdout
            sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(cubin)],
                                  capture_output=True, text=True).stdout
        usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
        mma = {k: len(re.findall(rf"\b{k}\b", sass)) for k in ("HGMMA", "QGMMA", "HMMA", "UTMALDG")}
        spills = int(usage.get("LOCAL", 0)) + int(usage.get("STACK", 0))
        if spills and "fp32" not in name:  # fp32 is a correctness mode on GPUs; 16-bit/FP8 must not spill
            failed += 1
        if args.sass:
            Path(args.sass).mkdir(parents=True, exist_ok=True)
            (Path(args.sass) / (re.sub(r"[^A-Za-z0-9]+", "_", name) + ".sass")).write_text(sass)
        rows.append((name, usage.get("REG"), compiled.metadata.shared, spills,
                     " ".join(f"{k}:{v}" for k, v in mma.items() if v) or "-", f"{time.perf_counter() - t0:.1f}s"))
        print(f"ok   {name}", flush=True)
    print(f"\nsm_{args.arch}, triton {triton.__version__}")
    head = ("kernel", "regs", "shared B", "spill B", "matrix instructions", "compile")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    print(f"\n{len(rows)} compiled, {failed} failed or spilled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
