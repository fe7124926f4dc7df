"""`tandem up` as a user runs it: prints the endpoint, prefixes every process's logs, serves, and stops
every process on Ctrl-C."""
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from fleet_utils import ROOT, chat

pytestmark = pytest.mark.timeout(600)


def test_tandem_up_serves_and_stops_on_ctrl_c():
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "up", str(ROOT / "examples" / "smollm2.yaml"),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        endpoint = None
        t_end = time.monotonic() + 300
        while endpoint is None and time.monotonic() < t_end:
            assert proc.poll() is None, "".join(lines)
            for line in list(lines):
                m = re.search(r"OpenAI endpoint: (http://[\d.]+:\d+)/v1", line)
                if m:
                    endpoint = m.group(1)
            time.sleep(0.2)
        assert endpoint, "".join(lines)
        assert "Paris" in chat(endpoint, "What is the capital of France?")[0]
        text = "".join(lines)
        for prefix in ("[router]", "[prefill-0]", "[decode-0]"):
            assert prefix in text
        ports = [int(p) for p in re.findall(r"listening on http://127\.0\.0\.1:(\d+)", text)]
        assert len(ports) == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
        for port in ports:   # every process of the fleet is gone
            with pytest.raises(requests.ConnectionError):
                requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_tandem_up_ask_and_bad_manifest(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "up", str(ROOT / "examples" / "smollm2.yaml"),
                          "--port", "0", "--ask", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"A: .*Paris", out.stdout)
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "examples" / "smollm2.yaml").read_text().replace("blockSize: 16", "blockSize: 17"))
    out = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "up", str(bad)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "blockSize" in out.stderr
