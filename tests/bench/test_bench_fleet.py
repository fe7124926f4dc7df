"""`tandem bench serve` against a real `tandem up` fleet of SmolLM2 (router, 1 prefill, 1 decode; real
processes on loopback): a short run of every dataset kind, through the real command line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fleet_utils import MODEL, prefix_cache_hits, start_fleet

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def fleet():
    f = start_fleet(name="bench")
    yield f
    f.stop(grace=10)


def bench(fleet, out, *args):
    cmd = [sys.executable, "-m", "tandem.worker.cli", "bench", "serve", "--base-url", fleet.endpoint + "/v1",
           "--model", MODEL, "--output-dir", str(out), "--no-progress", "--fail-on-error", "--seed", "1", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    summary = json.loads((out / "summary.json").read_text())
    reqs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert summary["failed"] == 0 and summary["completed"] == len(reqs) > 0
    for r in reqs:
        assert r["status"] == "ok"
        assert r["completion_tokens"] == r["output_tokens_asked"], r
        assert r["send"] <= r["first_token"] <= r["end"] and len(r["token_times"]) >= 1
    assert (out / "latency_cdf.png").stat().st_size > 10_000
    return summary, reqs


def test_random_and_sharegpt_runs(fleet, tmp_path):
    s, reqs = bench(fleet, tmp_path / "random", "--dataset", "random", "--num-prompts", "5", "--input-len", "32",
                    "--output-len", "6", "--length-dist", "uniform", "--length-spread", "0.5",
                    "--request-rate", "4", "--slo", "ttft=5", "tpot=1", "--save-dataset", str(tmp_path / "r.jsonl"))
    assert len({r["output_tokens_asked"] for r in reqs}) > 1        # uniform lengths really vary
    assert s["tpot_ms"]["count"] == 5 and s["ttft_ms"]["p50"] > 0 and s["goodput"] > 0
    # the PNG shows four CDF panels: each panel's curve leaves dark pixels across the figure's width
    import matplotlib.image as mpimg
    img = mpimg.imread(tmp_path / "random" / "latency_cdf.png")
    dark = (img[..., :3].mean(axis=2) < 0.5)
    cols = np.flatnonzero(dark.any(axis=0))
    assert img.shape[1] > 1000 and cols.size > 0.5 * img.shape[1]
    # the saved dataset replays the same requests
    s2, reqs2 = bench(fleet, tmp_path / "again", "--load-dataset", str(tmp_path / "r.jsonl"),
                      "--concurrency", "2")
    assert [r["output_tokens_asked"] for r in reqs2] == [r["output_tokens_asked"] for r in reqs]
    assert s2["load"]["mode"] == "closed"

    conv = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i} in one sentence."},
                               {"from": "gpt", "value": f"The number {i} is a small whole number, {i} > 0."}]}
            for i in range(1, 5)]
    (tmp_path / "sharegpt.json").write_text(json.dumps(conv))
    s, reqs = bench(fleet, tmp_path / "sharegpt", "--dataset", "sharegpt", "--dataset-path",
                    str(tmp_path / "sharegpt.json"), "--num-prompts", "4", "--request-rate", "4",
                    "--endpoint", "completions")
    assert s["completed"] == 4


def test_prefix_sharing_raises_prefix_cache_hits(fleet, tmp_path):
    before = prefix_cache_hits(fleet)
    s, reqs = bench(fleet, tmp_path / "prefix", "--dataset", "prefix", "--num-prefixes", "2", "--prefix-len", "96",
                    "--questions-per-prefix", "3", "--input-len", "8", "--output-len", "4", "--concurrency", "1")
    assert s["completed"] == 6
    # each later question of a group finds at least the group's full 16-token blocks of the prompt cached.
    # One at a time: a question sent while its group's first prefill is still running cannot hit (blocks
    # enter the prefix cache once computed, as in vLLM), and at an open-loop rate that happened on a busy CI.
    assert prefix_cache_hits(fleet) - before >= 2 * 2 * 80


def test_multiturn_sessions_resend_the_conversation(fleet, tmp_path):
    before = prefix_cache_hits(fleet)
    s, reqs = bench(fleet, tmp_path / "multi", "--dataset", "multiturn", "--sessions", "2", "--turns", "3",
                    "--input-len", "24", "--output-len", "5", "--think-time", "0.2", "--request-rate", "2")
    assert s["completed"] == 6
    # later turns are follow-ups, not on the schedule; their prompts carry the conversation so far
    assert s["send_lag"]["count"] == 2
    by = {(r["session"], r["turn"]): r for r in reqs}
    for sess in (0, 1):
        p = [by[(sess, t)]["prompt_tokens"] for t in range(3)]
        assert p[0] + 24 + 5 <= p[1] and p[1] + 24 + 5 <= p[2], p
        for t in (1, 2):
            assert by[(sess, t)]["send"] >= by[(sess, t - 1)]["end"]
    # each turn re-reads the previous turns from the prefix cache
    assert prefix_cache_hits(fleet) - before >= 2 * 2 * 32


def test_trace_replay(fleet, tmp_path):
    trace = tmp_path / "trace.jsonl"
    subprocess.run([sys.executable, "-m", "tandem.worker.cli", "bench", "trace", "bursts", "-o", str(trace),
                    "--duration", "3", "--rate", "1", "--burst-rate", "4", "--burst-every", "2", "--burst-length",
                    "0.5", "--prompt-tokens", "24", "--output-tokens", "4", "--prefix-groups", "2", "--seed", "5"],
                   check=True, env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True)
    n = len(trace.read_text().splitlines()) - 1
    assert n >= 2
    s, reqs = bench(fleet, tmp_path / "trace", "--dataset", "trace", "--dataset-path", str(trace),
                    "--prefix-len", "16")
    assert s["completed"] == n and s["load"]["arrival"] == "trace"

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")
    # strict JSON: the open-loop rate is null (it was written as Infinity, which JSON has not)
    json.loads((tmp_path / "trace" / "summary.json").read_text(), parse_constant=strict)
    assert s["load"]["request_rate"] is None
