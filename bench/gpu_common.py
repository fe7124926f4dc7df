"""Shared pieces of the GPU benchmark parts (bench/gpu_*.py): CUDA check, timing, result records.

Each part runs alone (``python bench/gpu_kernels.py``) or through ``bench/gpu.sh``. Results go to
stdout as a table and, as JSON lines, to ``$OUT/results.jsonl`` (``bench/out/`` when OUT is unset),
with the GPU, the commit and the date, for bench/RESULTS.md.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


# BENCH_CPU_SMOKE=1: run a part's code paths on the CPU under the Triton interpreter, at toy sizes,
# to check the harness itself before spending GPU time. Its figures mean nothing.
SMOKE = os.environ.get("BENCH_CPU_SMOKE", "0") not in ("", "0")


def require_cuda(part: str) -> torch.device:
    """Exit with a clear message (status 2) when there is no CUDA device."""
    if SMOKE:
        os.environ["TRITON_INTERPRET"] = "1"
        print(f"{part}: CPU smoke run (BENCH_CPU_SMOKE=1): toy sizes, meaningless figures", file=sys.stderr)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{part}: needs a CUDA GPU (torch {torch.__version__} sees none); "
              f"these figures can only be measured on a GPU machine", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(f"{part}: unset TRITON_INTERPRET to benchmark compiled kernels", file=sys.stderr)
        sys.exit(2)
    return torch.device("cuda")


def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    d.mkdir(parents=True, exist_ok=True)
    if d == ROOT / "bench" / "out" and not (d / ".gitignore").exists():
        (d / ".gitignore").write_text("*\n")  # results are copied into bench/RESULTS.md by hand
    return d


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        commit = "unknown"
    import triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke/dry run)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def record(part: str, **fields) -> None:
    """Append one result line (with the environment) to results.jsonl."""
    if "env" not in _ENV_CACHE:
        _ENV_CACHE["env"] = environment()
    row = {"part": part, **fields, **_ENV_CACHE["env"]}
    with open(out_dir() / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


_ENV_CACHE: dict = {}


def cuda_time_ms(fn, warmup: int = 3, reps: int = 20, budget_s: float = 2.0) -> float:
    """Median milliseconds of ``fn()`` with CUDA events, each rep timed alone (L2 not flushed:
    inputs here are far larger than the 60 MB L2 at the sizes that matter)."""
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    t_end = time.monotonic() + budget_s
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if i >= 4 and time.monotonic() > t_end:
            break
    times.sort()
    return times[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def table(rows: list[dict], cols: list[str]) -> str:
    """A plain fixed-width table of ``rows`` (dicts) over ``cols``."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def paged_cache(lens: list[int], hk: int, d: int, block_size: int, dtype, device, shuffle=True):
    """A KV cache ``[N, block_size, Hk, D]`` pair with random contents holding ``lens`` tokens, and
    its block table: scattered blocks, as a serving engine's allocator leaves them."""
    need = [(n + block_size - 1) // block_size for n in lens]
    total = sum(need)
    kc = torch.randn(total, block_size, hk, d, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    ids = torch.randperm(total, device=device) if shuffle else torch.arange(total, device=device)
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    off = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = ids[off:off + nb].int()
        off += nb
    return kc, vc, tables


@contextlib.contextmanager
def prefill_tma():
    """Prefill with TMA loads (``PREFILL_CONFIG["tma"]``) inside the block, the path set before it after."""
    from tandem.kernels import prefill as prefill_mod
    before = prefill_mod.PREFILL_CONFIG["tma"]
    prefill_mod.PREFILL_CONFIG["tma"] = True
    try:
        yield
    finally:
        prefill_mod.PREFILL_CONFIG["tma"] = before
