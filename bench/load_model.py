"""Model load time and peak host RSS: main's loader (every weight as float32 on the host, then cast) against
this one (each tensor read straight into the serving dtype), on a random Llama in bf16, in one run.

Each variant runs in a fresh child process that imports everything first, resets its peak RSS
(``/proc/self/clear_refs``) and then builds the model the way the engine does (load, then the
serving layout); the figure is the peak above the post-import RSS. Variants:

* ``main``: ``worker/engine/loader.py`` and ``worker/models/llama.py`` as of ``--baseline`` (default
  ``main``), read with ``git show`` from ``--repo`` (default /work/main) and imported as modules;
* ``safe_open``: ``safetensors.safe_open`` per tensor into bf16, then the serving layout (why the
  loader reads with ``preadv`` instead: the file's mapped pages stay resident);
* ``tandem``: this tree's ``load_model(path, dtype)`` and ``LlamaModel``.

Both serving dtypes are run by default: bfloat16 (the file's own: no conversion) and float32 (the
CPU default: every tensor converted).

    .venv/bin/python bench/load_model.py [--shape llama-3.2-1b] [--repeats 1] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    # Llama-3.2-1B: 1.24B parameters (tied embeddings), 2.47 GB in bf16
    "llama-3.2-1b": dict(layers=16, hidden=2048, inter=8192, heads=32, kv_heads=8, vocab=128256, tie=True),
    "llama-0.5b": dict(layers=8, hidden=2048, inter=5632, heads=16, kv_heads=4, vocab=32000, tie=False),
}

CHILD = r"""
import importlib.util, json, re, subprocess, sys, time
import torch
from tandem.kernels.ops import select_ops
from tandem.worker.engine.loader import load_model
from tandem.worker.models.llama import LlamaModel

variant, path, repo, rev, dtype_name = sys.argv[1:6]
dtype = getattr(torch, dtype_name)

def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def module_at(rel, name):
    src = subprocess.run(["git", "-C", repo, "show", f"{rev}:{rel}"], check=True, capture_output=True,
                         text=True).stdout
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # dataclasses look their module up
    exec(compile(src, f"{rev}:{rel}", "exec"), mod.__dict__)
    return mod

ops = select_ops("torch", "cpu")
if variant == "main":
    old_loader = module_at("worker/engine/loader.py", "old_loader")
    old_llama = module_at("worker/models/llama.py", "old_llama")
base = rss()
open("/proc/self/clear_refs", "w").write("5")
t0 = time.monotonic()
if variant == "main":
    loaded = old_loader.load_model(path)
    model = old_llama.LlamaModel(loaded.config, loaded.weights, ops, dtype, "cpu", 4096)
elif variant == "safe_open":
    from safetensors import safe_open
    loaded = load_model(path, dtype)          # config and tokenizer; weights replaced below
    loaded.weights.clear()
    with safe_open(f"{path}/model.safetensors", framework="pt", device="cpu") as f:
        for k in f.keys():
            loaded.weights[k] = f.get_tensor(k).to(dtype)
    model = LlamaModel(loaded.config, loaded.weights, ops, dtype, "cpu", 4096)
else:
    loaded = load_model(path, dtype)
    model = LlamaModel(loaded.config, loaded.weights, ops, dtype, "cpu", 4096)
seconds = time.monotonic() - t0

def served_bytes(m):   # main's LlamaModel has no weight_bytes()
    ts = {id(t): t for t in [m.embed, m.lm_head, m.norm] + [v for L in m.layers for v in L.values()]
          if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in ts.values())

print(json.dumps({"variant": variant, "dtype": dtype_name, "served_bytes": served_bytes(model), "seconds": seconds, "peak_above_imports": hwm() - base}))
"""


def run_child(variant: str, path: Path, repo: str, rev: str, dtype: str) -> dict:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, variant, str(path), repo, rev, dtype], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--repo", default="/work/main", help="the git repository of the baseline")
    ap.add_argument("--baseline", default="main", help="the baseline's revision")
    ap.add_argument("--variants", default="main,safe_open,tandem")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="serving dtypes (the file is bf16)")
    ap.add_argument("--keep", default=None, help="write the model here and keep it (default: a temp dir)")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import write_random_llama

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tandem-load-bench-"))
    model = tmp / args.shape
    try:
        if not (model / "config.json").exists():
            nbytes = write_random_llama(model, **SHAPES[args.shape])
        else:
            nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"{args.shape}: {nbytes / 1e9:.2f} GB of bf16 weights in {model}")
        rows = []
        for _ in range(args.repeats):
            for dt in args.dtypes.split(","):
                for v in args.variants.split(","):
                    # read the file once first so every variant starts from a warm page cache
                    subprocess.run(["cat", str(model / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)
                    rows.append(run_child(v, model, args.repo, args.baseline, dt))
        print("| serving dtype | variant | load s | peak RSS above imports, GB | x served weight bytes |")
        print("| --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['dtype']} | {r['variant']} | {r['seconds']:.1f} | {r['peak_above_imports'] / 1e9:.2f} | "
                  f"{r['peak_above_imports'] / r['served_bytes']:.2f} |")
    finally:
        if not args.keep:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
