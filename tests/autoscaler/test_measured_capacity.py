"""The calibration's measured prefill capacity factor (``capacity.prefill_factor``): what it is, how
``bench/capacity_by_size.py --role prefill --write`` stores it, and that every shipped calibration's
factor still matches a fresh measurement on the simulator (issue 25, thirty-fifth session). No mocks:
the shipped files, the simulator and the script's own functions."""
import re
import sys
from pathlib import Path

import pytest

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.simulate import scenarios as S
from tandem.worker.api.calibration import Calibration

ROOT = Path(__file__).resolve().parents[2]
CALS = ROOT / "bench" / "calibrations"
pytestmark = pytest.mark.timeout(300)


def _script():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import capacity_by_size
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return capacity_by_size


@pytest.mark.parametrize("name", ["smollm2-cpu.yaml", "smollm2-cpu-scenarios.yaml", "llama3-8b-h200.yaml",
                                  "llama3-8b-h200-tandem.yaml"])
def test_every_shipped_calibration_carries_its_measured_factor(name):
    cal = Calibration.load(CALS / name)
    factor = cal.capacity.get("prefill_factor")
    assert isinstance(factor, float) and 0.3 < factor < 4, (name, cal.capacity)
    assert "capacity_by_size.py --role prefill" in cal.capacity["measured"], cal.capacity
    assert PerfModel.of(cal).prefill_factor == factor


@pytest.mark.parametrize("bad", [0, -1.2, "1.2", True, float("inf"), None])
def test_a_factor_that_is_not_a_positive_number_is_refused_by_name(bad):
    d = Calibration.load(CALS / "smollm2-cpu-scenarios.yaml").to_dict()
    d["capacity"] = {"prefill_factor": bad}
    if bad is None:   # absent is allowed: the probe keeps its own ceiling
        assert PerfModel.of(Calibration.from_dict(d)).prefill_factor is None
        return
    with pytest.raises(ValueError, match=r"capacity\.prefill_factor"):
        Calibration.from_dict(d)
    d["capacity"] = [1.2]
    with pytest.raises(ValueError, match="capacity"):
        Calibration.from_dict(d)


def test_write_replaces_the_section_and_keeps_every_other_line(tmp_path):
    path = tmp_path / "cal.yaml"
    # a calibration as `tandem bench calibrate` writes it (no capacity section), with comments
    text = re.sub(r"^capacity:.*?(?=^\S|\Z)", "", (CALS / "smollm2-cpu-scenarios.yaml").read_text(),
                  flags=re.S | re.M).rstrip("\n")
    assert text.startswith("#")
    path.write_text(text + "\n")
    script = _script()
    script.write_factor(str(path), 1.234, "first")
    script.write_factor(str(path), 0.987, 'second "run"')
    cal = Calibration.load(path)
    assert cal.capacity == {"prefill_factor": 0.987, "measured": 'second "run"'}
    now = path.read_text()
    assert now.startswith(text + "\ncapacity:\n") and now.count("capacity:") == 1, now[len(text):]
    # the loader's own writer keeps it too
    cal.save(tmp_path / "again.yaml")
    assert Calibration.load(tmp_path / "again.yaml").capacity == cal.capacity
    # a section followed by other keys is replaced in place
    mid = tmp_path / "mid.yaml"
    mid.write_text(text.replace("\nprefill:\n", "\ncapacity:\n  prefill_factor: 1.5\n  measured: x\nprefill:\n", 1))
    script.write_factor(str(mid), 1000.0, "third")
    got = Calibration.load(mid)
    assert got.capacity == {"prefill_factor": 1000.0, "measured": "third"}
    assert mid.read_text().count("capacity:") == 1 and "\nprefill:\n" in mid.read_text()
    assert list(got.fits["prefill"].coef) == list(cal.fits["prefill"].coef)
    # a factor the loader would refuse is refused before the file is touched
    with pytest.raises(ValueError, match=r"capacity\.prefill_factor"):
        script.write_factor(str(path), 0.0, "zero")
    assert path.read_text() == now


def test_the_scenarios_factor_matches_a_fresh_measurement():
    """The CPU scenarios' committed factor against one point measured now (3 prefill replicas, seed 3,
    30 simulated minutes per bisection step): if the fits or the simulator's prefill change, the file's
    factor is stale and the probe's cap with it (rerun the script with --write)."""
    script = _script()
    cal = Calibration.load(CALS / "smollm2-cpu-scenarios.yaml")
    perf = PerfModel.of(cal)
    targets = dict(zip(("prefill", "decode"), S.slo(perf, S.PROMPT, S.OUTPUT)))
    c, duration, seed = 3, 1800.0, 3
    role = script.ROLES["prefill"]
    sim = script.most(lambda r: script.attainment("prefill", perf, targets, script.steady(r, duration, seed), c,
                                                  duration) >= script.AIM, hi=role.per_replica * c, iters=8)
    _, ratio = script.model_row("prefill", perf, targets, script.steady(sim, duration, seed), c, sim)
    assert abs(ratio - cal.capacity["prefill_factor"]) < 0.1, (ratio, cal.capacity)
