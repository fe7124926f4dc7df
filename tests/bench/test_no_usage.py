"""`tandem bench serve` against a server that streams no usage: tests/bench/no_usage_server.py, a
STAND-IN (real aiohttp on loopback, the real SmolLM2 tokenizer, no model) that streams real token
pieces and records what it sent and how many prompt tokens it would prefill. The counts the load
generator reports must match the stand-in's; the requests that did carry usage keep usage's numbers;
a stream cut short is `incomplete` with the stand-in's words."""
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tandem.operator.local import free_port
from tandem.worker.bench.client import Target
from tandem.worker.bench.datasets import Dataset
from tandem.worker.bench.metrics import summarize
from tandem.worker.bench.runner import LoadShape, run
from tandem.worker.bench.tokens import DEFAULT_TOKENIZER

pytestmark = pytest.mark.timeout(180)
HERE = Path(__file__).parent


@pytest.fixture
def stand_in():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "no_usage_server.py"), "--port", str(port),
                             "--tokenizer", DEFAULT_TOKENIZER, "--usage-every", "3", "--cut", "1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_counts_without_usage_match_the_tokenizer(stand_in, tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tandem.worker.cli", "bench", "serve", "--base-url", stand_in + "/v1",
           "--model", "stand-in", "--dataset", "random", "--num-prompts", "9", "--input-len", "24",
           "--output-len", "14", "--length-dist", "uniform", "--length-spread", "0.5", "--concurrency", "1",
           "--tokenizer", DEFAULT_TOKENIZER, "--save-dataset", str(tmp_path / "ds.jsonl"),
           "--output-dir", str(out), "--no-plots", "--no-progress", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={"PYTHONSAFEPATH": "1",
                                                                              "PATH": "/usr/bin:/bin",
                                                                              "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout)
    seen = requests.get(stand_in + "/_seen", timeout=5).json()
    recs = {r["id"]: r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())}
    assert len(recs) == len(seen) == 9
    by_kind = {"usage": 0, "tokenizer": 0}
    for rid, s in seen.items():
        r = recs[rid]
        if s["cut"]:
            assert r["status"] == "error" and r["error_kind"] == "incomplete"
            assert "stand-in: generation interrupted" in r["error"], r["error"]
            continue
        assert r["status"] == "ok", r
        by_kind[r["token_source"]] += 1
        assert r["completion_tokens"] == len(s["ids"])          # every streamed piece, counted once
        if s["usage"]:
            assert r["token_source"] == "usage" and r["prompt_tokens"] == 1000 + s["arrival"]
        else:
            assert r["token_source"] == "tokenizer" and r["prompt_tokens"] == s["prompt_tokens"]
    # arrivals 0, 3, 6 carried usage; arrival 1 was cut; 2, 4, 5, 7, 8 were counted
    assert by_kind == {"usage": 3, "tokenizer": 5}
    assert summary["token_counts"] == by_kind and summary["tokenizer"] == DEFAULT_TOKENIZER
    assert summary["errors_by_kind"] == {"incomplete": 1}
    assert summary["output_tokens"] == sum(len(s["ids"]) for s in seen.values() if not s["cut"])
    assert summary["tpot_ms"]["count"] == 8
    assert "tokens counted by" in p.stderr and "tokenizer (package:" in p.stderr

    # without a tokenizer, and a server that is not tandem's, the same streams are no_usage errors
    ds = Dataset.load(tmp_path / "ds.jsonl")
    res = asyncio.run(run(Target(stand_in, "stand-in"), ds, LoadShape(concurrency=1)))
    s = summarize(res)
    # the stand-in's arrivals go on from 9: 9, 12 and 15 carry usage, none is cut
    assert s["errors_by_kind"] == {"no_usage": 6}
    assert all("pass --tokenizer" in r.error for r in res.records if not r.ok)
    assert s["token_counts"] == {"usage": 3} and s["tokenizer"] is None

    # `tandem bench compare` recomputes goodput at a stated SLO from requests.jsonl, and plots the CDFs
    from tandem.worker.cli import main
    png = tmp_path / "cdf.png"
    assert main(["bench", "compare", str(out), str(out), "--names", "loose", "strict", "--markdown",
                 "--cdf", str(png)]) == 0
    assert main(["bench", "compare", str(out), "--slo", "ttft=60", "--markdown"]) == 0
    assert main(["bench", "compare", str(out), "--slo", "ttft=0.000001", "--markdown"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ")]
    assert "| server |" in lines[0] and len(lines) == 4 + 3 + 3    # header, separator, rows
    loose, strict = lines[6].split(" | "), lines[9].split(" | ")
    col = lines[0].split(" | ").index("goodput (req/s)")
    assert float(loose[col]) == pytest.approx(8 / summary["duration_s"], rel=0.01) and float(strict[col]) == 0
    assert "8 / 1" in lines[2] and "usage 3, tokenizer 5" in lines[2]
    assert png.stat().st_size > 10_000
