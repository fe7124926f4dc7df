"""A worker's startup is visible: from its first second the port answers /health with 503 and the phase
(reading, converting, profiling) and its progress; the log says the same and ends with the memory
plan; once ready, /health keeps each phase's duration. A real worker process on the real SmolLM2."""
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from fleet_utils import example_manifest, free_port

PHASES = ["reading", "converting", "profiling", "capturing", "ready"]


def test_health_shows_the_startup_phases_while_the_model_loads(tmp_path):
    from tandem.operator.spec import load_manifest, worker_config
    cfg = Path(tempfile.mkdtemp()) / "worker.yaml"
    cfg.write_text(worker_config(load_manifest(example_manifest(None, "startup")), "both").to_yaml())
    port = free_port()
    log = open(tmp_path / "worker.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "both", "--config",
                             str(cfg), "--port", str(port)], start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    seen = []
    try:
        t_end = time.monotonic() + 300
        while time.monotonic() < t_end:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                # /ready first: a worker still starting at the /health that follows was not ready before
                ready = requests.get(url + "/ready", timeout=2).status_code
                r = requests.get(url + "/health", timeout=2)
            except requests.ConnectionError:
                time.sleep(0.02)
                continue
            if r.status_code == 200:
                final = r.json()
                break
            body = r.json()
            assert r.status_code == 503 and body["status"] == "starting", body
            assert 0.0 <= body["progress"] <= 1.0
            assert ready == 503
            seen.append(body["phase"])
            time.sleep(0.02)
        else:
            raise AssertionError("worker never became healthy")
        loading = [p for p in seen if p in PHASES]
        assert loading, f"no startup phase seen at /health: {seen}"   # SmolLM2 takes seconds to read
        order = [PHASES.index(p) for p in loading]
        assert order == sorted(order), loading                          # phases only move forward
        assert final["startup"]["phase"] == "ready"
        assert {"reading", "converting", "profiling"} <= set(final["startup"]["phase_seconds"])
        text = Path(log.name).read_text()
        assert "startup: reading" in text and "startup: profiling" in text
        assert "memory plan (cpu):" in text and "tokens max concurrent" in text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
