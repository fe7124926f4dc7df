"""Remake bench/calibrations/smollm2-cpu.yaml: start a `both` worker and a P/D fleet from
examples/smollm2.yaml, run `tandem bench calibrate` against them, stop them.

Usage: .venv/bin/python bench/make_calibration.py [-o bench/calibrations/smollm2-cpu.yaml] [-- extra calibrate args]
Remake it whenever the example manifests' dtype, engine settings or the engine's hot paths change.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fleet_utils import MODEL, start_worker  # noqa: E402  (the tests' helpers start real processes)

from tandem.operator.local import LocalFleet  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-o", "--output", default=str(ROOT / "bench" / "calibrations" / "smollm2-cpu.yaml"))
    args, extra = p.parse_known_args()
    proc, url = start_worker("both", name="calibration")
    fleet = LocalFleet(str(ROOT / "examples" / "smollm2.yaml"), router_port=0,
                       log_stream=open(Path(tempfile.gettempdir()) / "make_calibration_fleet.log", "w"))
    try:
        fleet.start(timeout=600)
        decode = next(p.url for p in fleet.procs if p.role == "decode")
        cmd = [sys.executable, "-m", "tandem.worker.cli", "bench", "calibrate", "--base-url", url, "--model", MODEL,
               "-o", args.output, "--pd-url", fleet.endpoint, "--pd-decode-url", decode, *[a for a in extra if a != "--"]]
        print("$", " ".join(cmd), flush=True)
        return subprocess.run(cmd, env={**os.environ, "PYTHONSAFEPATH": "1"}).returncode
    finally:
        fleet.stop(grace=10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
