"""`tandem bench calibrate` against a real `tandem serve --role both` worker (SmolLM2 on the CPU): the
fitted model predicts a fresh run's prefill and decode latencies, at sizes it was not fitted on (the
level within 2x, the shape within 1.5x: see test_calibration_predicts_a_fresh_run)."""
import asyncio
import signal
import subprocess
import sys
import os

import pytest

from fleet_utils import MODEL, start_worker
from tandem.worker.bench.calibrate import calibrate, verify
from tandem.worker.api.calibration import Calibration

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def worker():
    # one torch thread: the example's decode requests one CPU, and start_worker gives the worker the
    # thread budget a fleet's would have (on a shared 2-core machine a 2-thread matmul waits for its
    # slower thread whenever another process runs, which makes latencies jump)
    proc, url = start_worker("both", name="calibrate")
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def calibrate_and_verify(worker, tmp_path):
    """Fit a small calibration, check its shape, then measure a fresh run at unfitted sizes: the
    verify rows, a report of them and of the fit, and what the fit's shape missed (a list of lines; a
    neighbour's burst during the fit can bend it, so these are measured again like the rows' misses)."""
    cal = asyncio.run(calibrate(worker, MODEL, prefill_sizes=(32, 128, 256, 512), cached=(256,),
                                cached_sizes=(32, 128), batches=(1, 2, 4, 8), contexts=(32, 160), decode_tokens=10,
                                repeats=3))
    print({k: f.quality() for k, f in cal.fits.items()})
    path = tmp_path / "cal.yaml"
    cal.save(path)
    back = Calibration.load(path)
    assert back.prefill_seconds(300, 0) == pytest.approx(cal.prefill_seconds(300, 0))
    # prefill grows with the prompt, a cached prefix makes it cheaper than computing it all, and a
    # bigger decode batch costs more per step
    shape = [(cal.prefill_seconds(512) > 2 * cal.prefill_seconds(64),
              f"fit: prefill of 512 tokens {cal.prefill_seconds(512):.3f} s, not over 2x 64 tokens' "
              f"{cal.prefill_seconds(64):.3f} s"),
             (cal.prefill_seconds(256 + 128, 256) < cal.prefill_seconds(256 + 128, 0),
              f"fit: 384 tokens with 256 cached {cal.prefill_seconds(256 + 128, 256):.3f} s, not under "
              f"{cal.prefill_seconds(256 + 128, 0):.3f} s uncached"),
             (cal.decode_step_seconds(8, 200) > cal.decode_step_seconds(1, 200),
              f"fit: a batch-8 decode step {cal.decode_step_seconds(8, 200):.4f} s, not over batch 1's "
              f"{cal.decode_step_seconds(1, 200):.4f} s")]
    rows = asyncio.run(verify(back, worker, MODEL, prefill_points=[(96, 0), (384, 0), (64, 256)],
                              decode_points=[(3, 96), (6, 64)], decode_tokens=10, repeats=3))
    report = "\n".join(f"{r['what']} {r['inputs']}: measured {r['measured'] * 1000:.1f} ms, predicted "
                       f"{r['predicted'] * 1000:.1f} ms ({r['rel_err']:+.1%})" for r in rows)
    fitted = "\n".join(f"{k}: {f.quality()} samples {f.samples}" for k, f in cal.fits.items())
    return rows, report + "\n" + fitted, [why for ok, why in shape if not ok]


def misses(rows: list[dict]) -> list[str]:
    """What a fresh run's rows say against the calibration: each measurement within a factor of 2 of
    its prediction (the level), and, per kind (prefill, decode step), the measured/predicted ratios
    within 2x of each other (the shape: points measured in the same run, so a machine that got slower
    or faster since the fit moves them together)."""
    out = [f"{r['what']} {r['inputs']}: measured/predicted {r['measured'] / r['predicted']:.2f}"
           for r in rows if not 0.5 <= r["measured"] / r["predicted"] <= 2.0]
    for what in ("prefill", "decode_step"):
        ratios = [r["measured"] / r["predicted"] for r in rows if r["what"] == what]
        if max(ratios) > 2.0 * min(ratios):
            out.append(f"{what}: measured/predicted from {min(ratios):.2f} to {max(ratios):.2f}")
    return out


def test_calibration_predicts_a_fresh_run(worker, tmp_path):
    """Protects: the fitted model predicts latencies at sizes it was not fitted on. A wrong model (a
    term missing, a coefficient off) misses the shape by 2-4x across these sizes (384 prompt tokens
    cost about 4x 96), or the level by more than 2x. The bounds are 3x away from what a loaded 2-core
    machine measures: CPU latency shifts by up to 27% when another process starts between the fit and
    the check (a clean-clone run: a fresh batch-3 decode step 27% above a fit made a minute earlier),
    hence the level's factor of 2; beside 7 other test runs the prefill ratios of one run spread by
    1.34x (1.13 to 1.52), hence the shape's 2x (3x the 34% excess).
    The precise error (within 25% on a quiet machine) is a benchmark figure (bench/RESULTS.md). A miss
    is measured again from scratch, up to three attempts in all, each printed: a neighbour's minute-long
    burst can slow a whole attempt, fit or check (a clean-clone run, seventeenth session: a batch-6
    step 2.5x its prediction, then a fit whose 512-token prefill took 2.06 s against 1.19 s a minute
    before; one beside two simulator processes, twenty-third session: a fit in which 384 tokens with 256
    cached cost 0.886 s against 0.642 s uncached); a wrong model misses every attempt."""
    reports = []
    for attempt in range(3):
        rows, report, bent = calibrate_and_verify(worker, tmp_path)
        missed = bent + misses(rows)
        reports.append(f"attempt {attempt + 1}:\n{report}\n" + "\n".join(missed))
        print(reports[-1])
        if not missed:
            return
    pytest.fail("\n".join(reports))


def test_calibrate_cli_writes_the_file_and_configmap_form_loads(worker, tmp_path):
    out = tmp_path / "c.yaml"
    p = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "bench", "calibrate", "--base-url", worker,
                        "--model", MODEL, "-o", str(out), "--prefill-sizes", "16,48,96,160", "--cached", "64",
                        "--cached-prompt-sizes", "16", "--decode-batches", "1,2,4", "--decode-contexts", "32,64",
                        "--decode-tokens", "8", "--repeats", "1", "--statistic", "median"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "R^2" in p.stdout
    cal = Calibration.load(out)
    assert cal.fits["prefill"].quality()["points"] == 5 and cal.engine["block_size"] == 16
    assert cal.measured["statistic"] == "median"
    # --verify measures fresh points against that file, with the same statistic
    v = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "bench", "calibrate", "--base-url", worker,
                        "--model", MODEL, "--verify", str(out), "--prefill-sizes", "48", "--decode-batches", "2",
                        "--decode-contexts", "32", "--decode-tokens", "8", "--repeats", "1", "--statistic", "median"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert v.returncode == 0, v.stdout + v.stderr
    assert "prefill" in v.stdout and "decode_step" in v.stdout and "%" in v.stdout, v.stdout
    # the Kubernetes form: a ConfigMap with the file under the key calibration.yaml
    import yaml
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "smollm2-calibration"},
          "data": {"calibration.yaml": out.read_text()}}
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump(cm))
    assert Calibration.load(tmp_path / "cm.yaml").decode_step_seconds(2, 40) == \
        pytest.approx(cal.decode_step_seconds(2, 40))
