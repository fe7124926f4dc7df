"""Seeded traces and datasets: same seed, same requests; parameters in the header; the generators
shape rate and lengths as asked. Also gamma burstiness and `tandem bench compare`."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tandem.worker.bench import datasets as ds
from tandem.worker.bench.arrivals import schedule
from tandem.worker.bench.trace import generate, read_trace, write_trace


def test_trace_generators_are_seeded_and_shaped(tmp_path):
    p1, r1 = generate("step", duration=400, rate=1, prompt_tokens=100, output_tokens=20, seed=4, at=200, to_rate=4)
    p2, r2 = generate("step", duration=400, rate=1, prompt_tokens=100, output_tokens=20, seed=4, at=200, to_rate=4)
    assert r1 == r2 and p1["to_rate"] == 4
    before = sum(r["timestamp"] < 200 for r in r1)
    after = len(r1) - before
    assert 150 < before < 250 and 650 < after < 950          # Poisson counts around 200 and 800
    write_trace(tmp_path / "t.jsonl", "step", p1, r1)
    head, back = read_trace(tmp_path / "t.jsonl")
    assert head["generator"] == "step" and head["params"]["seed"] == 4 and back == r1

    _, r = generate("prompt-shift", duration=300, rate=2, prompt_tokens=100, output_tokens=20, sigma=0.3, seed=1,
                    to_prompt_tokens=400)
    early = np.median([x["prompt_tokens"] for x in r if x["timestamp"] < 150])
    late = np.median([x["prompt_tokens"] for x in r if x["timestamp"] >= 150])
    assert 80 < early < 125 and 320 < late < 500
    _, r = generate("diurnal", duration=600, rate=2, prompt_tokens=10, output_tokens=10, amplitude=0.9, seed=2)
    first_half = sum(x["timestamp"] < 300 for x in r)     # sin > 0 in the first half of the period
    assert first_half > 1.5 * (len(r) - first_half)
    _, r = generate("bursts", duration=300, rate=0.5, burst_rate=10, burst_every=30, burst_length=3,
                    prompt_tokens=10, output_tokens=10, seed=3, prefix_groups=3)
    in_burst = sum((x["timestamp"] % 30) < 3 for x in r)
    assert in_burst > 0.6 * len(r) and {x["prefix_group"] for x in r} == {0, 1, 2}


def test_gamma_burstiness_keeps_the_rate_and_changes_the_spread():
    for b in (0.25, 1.0, 4.0):
        gaps = np.diff(schedule("gamma", 20000, rate=5.0, seed=0, burstiness=b))
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(b), rel=0.1)   # gamma CV = 1/sqrt(shape)
    ramp = np.diff(schedule("ramp", 4000, rate=1.0, ramp_end_rate=9.0, seed=0))
    assert ramp[:400].mean() > 3 * ramp[-400:].mean()


def test_datasets_are_seeded_and_savable(tmp_path):
    from tandem.worker.bench.tokens import PromptMaker, load_tokenizer
    maker = PromptMaker(load_tokenizer())
    a = ds.random_dataset(maker, 6, 40, 8, "lognormal", 0.5, seed=3)
    b = ds.random_dataset(maker, 6, 40, 8, "lognormal", 0.5, seed=3)
    assert [r.messages for r in a.requests] == [r.messages for r in b.requests]
    assert [maker.count(r.messages[0]["content"]) for r in a.requests] == [r.prompt_tokens for r in a.requests]
    a.save(tmp_path / "a.jsonl")
    assert ds.Dataset.load(tmp_path / "a.jsonl").requests == a.requests
    p = ds.prefix_dataset(maker, 3, 64, 4, 8, 4, seed=1)
    systems = {r.prefix_group: r.messages[0]["content"] for r in p.requests}
    assert len(p.requests) == 12 and len(set(systems.values())) == 3
    assert all(r.messages[0]["content"] == systems[r.prefix_group] for r in p.requests)
    assert maker.count(systems[0]) == 64
    m = ds.multiturn_dataset(maker, 2, 3, 16, 4, think_time=1.0, seed=1)
    assert [r.turn for r in m.first_turns()] == [0, 0] and all(r.think_time > 0 for r in m.requests if r.turn)


def test_compare_prints_both_runs_and_ratios(tmp_path):
    a = {"dataset": "x", "request_throughput": 2.0, "ttft_ms": {"p50": 100.0, "count": 3}}
    b = {"dataset": "x", "request_throughput": 3.0, "ttft_ms": {"p50": 50.0, "count": 3}}
    for name, s in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    out = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "bench", "compare",
                          str(tmp_path / "a" / "summary.json"), str(tmp_path / "b" / "summary.json")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1", "COLUMNS": "150"})
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "request_throughput" in x)
    assert "2.00" in line and "3.00" in line and "1.500" in line
    assert "0.500" in next(x for x in out.stdout.splitlines() if "ttft_ms.p50" in x)


def test_a_trace_is_replayed_whole_unless_cut(tmp_path):
    """`tandem bench serve --dataset trace` sends every request of the trace; --num-prompts N the first N.
    (Until the ninth session the drawn datasets' default of 100 cut every trace at 100 requests without
    a word: the sim-vs-real test's 80% replay sent 100 of its 111.) Drawn datasets keep 100."""
    from tandem.worker.bench.cli import build_dataset
    from tandem.worker.cli import build_parser
    params, records = generate("step", duration=100, rate=1.5, prompt_tokens=16, output_tokens=4, seed=2,
                               at=50, to_rate=1.5)
    assert len(records) > 100
    write_trace(tmp_path / "t.jsonl", "step", params, records)
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:1/v1", "--model", "m"]
    whole = build_dataset(build_parser().parse_args(serve + ["--dataset", "trace", "--dataset-path",
                                                             str(tmp_path / "t.jsonl")]))
    assert len(whole.requests) == len(records)
    cut = build_dataset(build_parser().parse_args(serve + ["--dataset", "trace", "--dataset-path",
                                                           str(tmp_path / "t.jsonl"), "--num-prompts", "20"]))
    assert len(cut.requests) == 20
    drawn = build_dataset(build_parser().parse_args(serve + ["--dataset", "random", "--input-len", "8"]))
    assert len(drawn.requests) == 100


@pytest.mark.parametrize("kw, says", [({"duration": 0}, "duration"), ({"rate": float("inf")}, "rate"),
                                      ({"rate": float("nan")}, "rate"), ({"to_rate": -3}, "to-rate"),
                                      ({"prompt_tokens": 0}, "prompt-tokens"), ({"sigma": -1}, "sigma"),
                                      ({"duration": 1e9}, "requests")])
def test_trace_generator_names_the_bad_parameter(kw, says):
    """Bad generator input is a ValueError naming the parameter (a zero duration once wrote an empty
    trace, an infinite rate raised OverflowError, 1e9 s ran out of memory)."""
    args = {"duration": 60, "rate": 1.0, "prompt_tokens": 16, "output_tokens": 4, **kw}
    with pytest.raises(ValueError, match=says):
        generate("step", **args)


def test_a_bad_trace_line_is_named(tmp_path):
    for line, says in (("[1, 2]", "JSON object"), ("garbage", "not JSON"),
                       ('{"timestamp": 1, "prompt_tokens": 0, "output_tokens": 2}', "prompt_tokens"),
                       ('{"timestamp": "a", "prompt_tokens": 3, "output_tokens": 2}', "timestamp")):
        (tmp_path / "t.jsonl").write_text(line + "\n")
        with pytest.raises(ValueError, match=f"t.jsonl:1: .*{says}"):
            read_trace(tmp_path / "t.jsonl")


DATA = os.path.join(os.path.dirname(__file__), "data")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tandem.worker.cli", "bench", "trace", *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONSAFEPATH": "1"}, timeout=120)


@pytest.mark.timeout(120)
def test_import_azure_and_mooncake(tmp_path):
    """`tandem bench trace import`: an Azure CSV (the first lines of the real code trace) and a Mooncake
    JSONL (our own fixture) become tandem traces: seconds from the first request, the lengths as given,
    Mooncake's hash_ids kept with the block size in the header; the simulator's reader takes them."""
    out = _cli("import", "--format", "azure", os.path.join(DATA, "azure2023_code_head.csv"), "-o", str(tmp_path / "a.jsonl"))
    assert out.returncode == 0, out.stderr
    head, recs = read_trace(tmp_path / "a.jsonl")
    assert head["generator"] == "import" and head["params"]["format"] == "azure"
    assert [r["prompt_tokens"] for r in recs][:4] == [4808, 3180, 110, 7433]
    assert recs[0]["timestamp"] == 0 and recs[1]["timestamp"] == pytest.approx(0.052, abs=1e-6)
    assert recs[-1]["timestamp"] == pytest.approx(1.016041, abs=1e-6) and recs[-1]["output_tokens"] == 23
    out = _cli("import", "--format", "mooncake", os.path.join(DATA, "mooncake_small.jsonl"), "-o", str(tmp_path / "m.jsonl"))
    assert out.returncode == 0, out.stderr
    head, recs = read_trace(tmp_path / "m.jsonl")
    assert head["params"]["block_tokens"] == 512 and head["params"]["duration"] == 3.0
    assert [r["timestamp"] for r in recs] == [0, 0.25, 0.9, 1.5, 2.1, 3.0]
    assert recs[1]["hash_ids"] == [0, 1, 3] and recs[1]["prompt_tokens"] == 1300


def test_import_window_and_scale():
    """--window cuts a span and starts it at 0; --scale K gives K x the requests over the same duration,
    each copy shifted and wrapped inside it, with hash_ids of its own (copies share no prefix blocks)."""
    from tandem.worker.bench.trace_import import import_trace
    path = os.path.join(DATA, "mooncake_small.jsonl")
    p, w = import_trace("mooncake", path, window=(0.5, 2.5))
    assert [r["timestamp"] for r in w] == [0.4, 1.0, 1.6] and p["duration"] == 2.0
    p, s = import_trace("mooncake", path, k=3)
    assert len(s) == 18 and max(r["timestamp"] for r in s) <= p["duration"]
    assert sorted(r["timestamp"] for r in s) == [r["timestamp"] for r in s]
    per_copy = {}
    for r in s:
        per_copy.setdefault(min(r["hash_ids"]) // 9, set()).update(r["hash_ids"])   # ids 0..8 per copy
    assert len(per_copy) == 3 and not (per_copy[0] & per_copy[1]) and not (per_copy[1] & per_copy[2])
    # the same lengths, three times over
    _, one = import_trace("mooncake", path)
    assert sorted(r["prompt_tokens"] for r in s) == sorted(3 * [r["prompt_tokens"] for r in one])
    # copy 0 is the trace unchanged: its last request stays at the end (it wrapped to 0 before)
    copy0 = [r["timestamp"] for r in s if min(r["hash_ids"]) < 9]
    assert copy0 == [r["timestamp"] for r in one] and copy0[-1] == p["duration"] == 3.0
    # an open window's end is null in the header (JSON has no Infinity)
    p, _ = import_trace("mooncake", path, window=(1.0, math.inf))
    assert p["window"] == [1.0, None]
    json.dumps(p, allow_nan=False)


def test_import_azure_saved_by_a_spreadsheet(tmp_path):
    """A CSV with a UTF-8 byte-order mark (as spreadsheets save it) reads as the same trace: the mark is
    not part of the first column's name."""
    from tandem.worker.bench.trace_import import read_azure
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,3\n2023-11-16 18:17:04.5,7,2\n"
    (tmp_path / "plain.csv").write_text(text)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_azure(tmp_path / "bom.csv") == read_azure(tmp_path / "plain.csv")


def test_fit_lengths_maps_a_trace_onto_other_medians_and_clips():
    """A trace mapped onto a calibration measured at other lengths: every length scaled by one factor per
    kind so that the medians are the given ones, prompts clipped to the calibrated range, outputs to at
    least 2 and to the context left; timing kept, prefix blocks dropped."""
    import statistics

    from tandem.worker.bench.trace_import import fit_lengths, import_trace
    _, one = import_trace("mooncake", os.path.join(DATA, "mooncake_small.jsonl"))
    fitted = fit_lengths(one, 64, 8, prompt_range=(32, 100), max_len=120)
    assert [r["timestamp"] for r in fitted] == [r["timestamp"] for r in one]
    assert all("hash_ids" not in r for r in fitted) and all("hash_ids" in r for r in one)
    assert statistics.median(r["prompt_tokens"] for r in fitted) == pytest.approx(64, abs=1)
    assert statistics.median(r["output_tokens"] for r in fitted) == pytest.approx(8, abs=1)
    assert all(32 <= r["prompt_tokens"] <= 100 for r in fitted)
    assert all(2 <= r["output_tokens"] <= 120 - r["prompt_tokens"] for r in fitted)
    # one factor per kind: the order of the lengths is kept where nothing was clipped
    fp = 64 / statistics.median(r["prompt_tokens"] for r in one)
    assert [r["prompt_tokens"] for r in fitted] == [min(100, max(32, round(r["prompt_tokens"] * fp))) for r in one]
    with pytest.raises(ValueError, match="medians must be > 0"):
        fit_lengths(one, 0, 8)
    with pytest.raises(ValueError, match="no room"):
        fit_lengths(one, 64, 8, prompt_range=(100, 32))


@pytest.mark.parametrize("fmt, text, says", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,3\n2023-11-16 18:17:04.0,x,3\n",
     r":3: ContextTokens: "),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n", r":2: TIMESTAMP: "),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,0\n", r":2: GeneratedTokens: "),
    ("azure", "TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:17:03.97,12,3\n", r":1: ContextTokens: missing"),
    ("azure", "", r":1: empty file"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12\n", r":2: GeneratedTokens: missing"),
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n{"timestamp": 5}\n',
     r":2: input_length: "),
    ("mooncake", '{"timestamp": -1, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n', r":1: timestamp: "),
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0, 1]}\n', r":1: hash_ids: "),
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": ["a"]}\n', r":1: hash_ids.0: "),
    ("mooncake", '\n[1]\n', r":2: a record is a JSON object"),
])
def test_import_names_the_bad_row(tmp_path, fmt, text, says):
    """A bad row of either format is a ValueError `FILE:LINE: FIELD: why`, and the CLI exits 2 with it
    (writing nothing)."""
    from tandem.worker.bench.trace_import import import_trace
    src = tmp_path / ("t.csv" if fmt == "azure" else "t.jsonl")
    src.write_text(text)
    with pytest.raises(ValueError, match=r"t\.(csv|jsonl)" + says):
        import_trace(fmt, src)


@pytest.mark.timeout(180)
def test_import_cli_errors_and_serve_shares_prefix_blocks(tmp_path):
    """The CLI reports a bad row and a bad --window with exit 2 and writes nothing; `bench serve
    --dataset trace` on an imported Mooncake trace gives requests that share hash_ids the same leading
    text, one block per id, and different text where the ids differ."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 0, "output_length": 2}\n')
    out = _cli("import", "--format", "mooncake", str(bad), "-o", str(tmp_path / "x.jsonl"))
    assert out.returncode == 2 and "bad.jsonl:1: input_length" in out.stderr and not (tmp_path / "x.jsonl").exists()
    out = _cli("import", "--format", "mooncake", os.path.join(DATA, "mooncake_small.jsonl"), "-o",
               str(tmp_path / "x.jsonl"), "--window", "3:1")
    assert out.returncode == 2 and "window" in out.stderr
    from tandem.worker.bench.tokens import PromptMaker, load_tokenizer
    from tandem.worker.bench.trace_import import import_trace
    params, recs = import_trace("mooncake", os.path.join(DATA, "mooncake_small.jsonl"))
    write_trace(tmp_path / "m.jsonl", "import", params, recs)
    maker = PromptMaker(load_tokenizer())
    d = ds.trace_dataset(maker, str(tmp_path / "m.jsonl"))
    text = [r.messages[0]["content"] for r in d.requests]
    common = os.path.commonprefix([text[0], text[1], text[3]])
    assert 900 <= maker.count(common) <= 1030                          # blocks 0 and 1: 1024 tokens
    assert text[3].startswith(common) and maker.count(text[3]) in range(1020, 1029)
    assert maker.count(os.path.commonprefix([text[2], text[4]])) >= 500   # block 4
    assert maker.count(os.path.commonprefix([text[0], text[2]])) < 5       # nothing shared
    assert [r.prompt_tokens for r in d.requests] == [1100, 1300, 600, 1024, 700, 520]
    # a block shorter than block_tokens (the prompt's last) is the head of its id's text, so an id seen
    # at 300 and at 480 tokens shares the first 300 (each length had a text of its own)
    part = tmp_path / "part.jsonl"
    part.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": [7]}) + "\n"
                            for t, n in ((0, 300), (500, 480), (900, 512))))
    params, recs = import_trace("mooncake", part)
    write_trace(tmp_path / "p.jsonl", "import", params, recs)
    text = [r.messages[0]["content"] for r in ds.trace_dataset(maker, str(tmp_path / "p.jsonl")).requests]
    assert maker.count(os.path.commonprefix(text)) >= 295 and text[2].startswith(os.path.commonprefix(text[1:]))
    assert maker.count(os.path.commonprefix(text[1:])) >= 475
    # a raw Mooncake file and a saved dataset given as a trace say what they are and what to run
    with pytest.raises(ValueError, match="a Mooncake record.*trace import --format mooncake"):
        ds.trace_dataset(maker, str(part))
    d.save(tmp_path / "saved.jsonl")
    with pytest.raises(ValueError, match="a saved dataset.*--load-dataset"):
        ds.trace_dataset(maker, str(tmp_path / "saved.jsonl"))
    # an empty trace, and a trace path that does not exist, are one-line errors naming them
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl: no requests"):
        ds.trace_dataset(maker, str(tmp_path / "empty.jsonl"))
    out = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "bench", "serve", "--base-url",
                          "http://127.0.0.1:9/v1", "--model", "m", "--dataset", "trace", "--dataset-path",
                          str(tmp_path / "nope.jsonl")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}, timeout=120)
    assert out.returncode == 2 and "--dataset-path" in out.stderr and "no such file" in out.stderr, out.stderr
