"""`tandem up` as a user runs it: prints the endpoint, prefixes every process's logs, serves, and stops
every process on Ctrl-C."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from fleet_utils import ROOT, chat

pytestmark = pytest.mark.timeout(600)


def start_up() -> tuple[subprocess.Popen, list[str], str, list[int]]:
    """`tandem up examples/smollm2.yaml`: the process, its output lines, the endpoint, every port."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "up", str(ROOT / "examples" / "smollm2.yaml"),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    endpoint = None
    t_end = time.monotonic() + 300
    while endpoint is None and time.monotonic() < t_end:
        if proc.poll() is not None:
            raise AssertionError("".join(lines))
        for line in list(lines):
            m = re.search(r"OpenAI endpoint: (http://[\d.]+:\d+)/v1", line)
            if m:
                endpoint = m.group(1)
        time.sleep(0.2)
    assert endpoint, "".join(lines)
    ports = [int(p) for p in re.findall(r"listening on http://127\.0\.0\.1:(\d+)", "".join(lines))]
    assert len(ports) == 3
    return proc, lines, endpoint, ports


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def all_gone(ports: list[int]) -> None:
    for port in ports:
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_tandem_up_serves_and_stops_on_ctrl_c():
    proc, lines, endpoint, ports = start_up()
    try:
        assert "Paris" in chat(endpoint, "What is the capital of France?")[0]
        text = "".join(lines)
        for prefix in ("[router]", "[prefill-0]", "[decode-0]"):
            assert prefix in text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
        all_gone(ports)   # every process of the fleet is gone
    finally:
        if proc.poll() is None:
            proc.kill()


def test_workers_die_with_a_killed_tandem_up():
    """SIGKILL leaves tandem up no chance to stop its fleet: the processes must go by themselves."""
    proc, _, _, ports = start_up()
    kids = children(proc.pid)
    assert len(kids) == 3
    # the fleet's config folder (each worker's --config lives in it): a killed `tandem up` cannot
    # remove it, so this test does
    args = [a.decode() for k in kids for a in Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")]
    dirs = {Path(a).parent for a in args if a.endswith(".yaml") and "/tandem-" in a}
    proc.kill()
    proc.wait(10)
    try:
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end and any(Path(f"/proc/{k}").exists() for k in kids):
            time.sleep(0.2)
        assert not any(Path(f"/proc/{k}").exists() for k in kids)
        all_gone(ports)
    finally:
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


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
