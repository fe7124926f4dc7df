"""The router process's footprint: start-up time (spawn to listening) and resident memory (RSS).

The router tokenizes and routes; it should load neither torch nor the engine. This starts
`tandem serve --role router` on the example manifest (static discovery with no workers), waits for
its port, and reads its RSS and the modules it imported. As a baseline in the same run it starts a
bare Python process that imports aiohttp (the floor for any aiohttp server).

    python bench/router_footprint.py [--manifest examples/smollm2.yaml] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tandem.operator.local import free_port
from tandem.operator.spec import load_manifest, worker_config


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_router(cfg_path: Path) -> tuple[float, float, bool]:
    """(seconds to a /health answer, RSS MiB, torch imported?)."""
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "router", "--config",
                          str(cfg_path), "--port", str(port)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                if p.poll() is not None:
                    raise SystemExit("router exited during start-up")
                time.sleep(0.05)
        t = time.monotonic() - t0
        rss = rss_mib(p.pid)
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        return t, rss, "libtorch" in maps
    finally:
        p.terminate()
        p.wait(10)


def baseline() -> tuple[float, float]:
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", "import aiohttp.web, sys; print(1, flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    t = time.monotonic() - t0
    rss = rss_mib(p.pid)
    p.stdin.close()
    p.wait(10)
    return t, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default="examples/smollm2.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    pool = load_manifest(a.manifest)
    cfg = worker_config(pool, "router", {"mode": "static", "prefill": [], "decode": []})
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "router.yaml"
        path.write_text(cfg.to_yaml())
        runs = [start_router(path) for _ in range(a.repeats)]
    base = [baseline() for _ in range(a.repeats)]
    t = statistics.median(r[0] for r in runs)
    rss = statistics.median(r[1] for r in runs)
    bt = statistics.median(b[0] for b in base)
    brss = statistics.median(b[1] for b in base)
    print(f"{'what':<34}{'start-up s':>12}{'RSS MiB':>10}")
    print(f"{'router (tandem serve --role router)':<34}{t:>12.2f}{rss:>10.0f}")
    print(f"{'baseline: python + aiohttp.web':<34}{bt:>12.2f}{brss:>10.0f}")
    print(f"ratio router/baseline: start-up {t / bt:.1f}x, RSS {rss / brss:.1f}x; "
          f"torch loaded in the router: {any(r[2] for r in runs)}")


if __name__ == "__main__":
    main()
