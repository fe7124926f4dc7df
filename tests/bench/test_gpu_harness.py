"""The GPU benchmark's harness on the CPU, and the H200 calibration measured with it.

No GPU runs in CI, so these check what a GPU run's figures go through here: the engine part's code paths
(``bench/gpu_engine.py --dry-run``: a tiny random Llama on the CPU, the torch attention backend) and the
fit that turns the committed H200 engine figures into ``bench/calibrations/llama3-8b-h200-tandem.yaml``.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "bench/gpu_runs/2026-12-04-h200-engine.jsonl"
MEASURED = ROOT / "bench/calibrations/llama3-8b-h200-tandem.yaml"


def test_the_measured_h200_calibration_is_the_fit_of_the_committed_engine_figures():
    """Regenerating from the committed figures gives the committed coefficients, and the fit predicts
    every measured TTFT and decode step within 15% (its worst point is 11.7%): a hand-edited or stale
    calibration file fails here."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import derive_h200_calibration as D
    finally:
        sys.path.remove(str(ROOT / "bench"))
    built = D.build(FIGURES)
    committed = yaml.safe_load(MEASURED.read_text())
    for part in ("prefill", "decode_step"):
        for name, value in committed[part]["coefficients"].items():
            assert built[part]["coefficients"][name] == pytest.approx(value, rel=1e-9, abs=1e-15), (part, name)
    assert committed["measured"]["derived_not_measured"] is False
    from tandem.worker.api.calibration import Calibration
    cal = Calibration.load(MEASURED)
    rows = [json.loads(line) for line in FIGURES.read_text().splitlines()]
    ttft = [r for r in rows if r["what"] == "TTFT"]
    steps = [r for r in rows if r["what"] == "decode step"]
    assert len(ttft) >= 6 and len(steps) >= 7
    for r in ttft:
        assert cal.prefill_seconds(r["tokens"]) * 1e3 == pytest.approx(r["ours_ms"], rel=0.15), r
    for r in steps:
        assert cal.decode_step_seconds(r["batch"], r["context"]) * 1e3 == pytest.approx(r["ours_ms"], rel=0.15), r
    # the point of measuring: the derived file's decode step (transformers' compiled step) is slower
    derived = Calibration.load(ROOT / "bench/calibrations/llama3-8b-h200.yaml")
    assert all(derived.decode_step_seconds(r["batch"], r["context"]) > 1.3 * r["ours_ms"] / 1e3 for r in steps)


def test_the_engine_benchmark_decodes_whole_batches(tmp_path):
    """``bench/gpu_engine.py --dry-run`` runs every code path of the GPU engine part and writes its rows;
    each decode row's timed steps decoded the whole batch with no preemption (on the first H200 run a
    batch of 64 at context 4096 decoded 8.5 sequences a step: sequences that had finished prefill first
    ran out of ``max_tokens`` inside the timed steps), and the graph runner's forward equals the eager one."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONSAFEPATH": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu_engine.py"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    decode = [r for r in rows if r.get("what") == "decode step" and "seqs_over_step" in r]
    assert {r["batch"] for r in decode} == {1, 3}, rows
    for r in decode:
        assert r["seqs_over_step"] == r["batch"] and r["preempted"] == 0, r
        assert r["ours_ms"] > 0
    assert [r for r in rows if r.get("what") == "TTFT"], rows
    graphs = [r for r in rows if r.get("what") == "graph replay == eager"]
    assert graphs and all(r["ok"] for r in graphs), graphs
