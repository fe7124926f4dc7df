"""A real Prometheus (Debian's `prometheus` 2.42; scripts/test.sh installs it) for the autoscaler's
Prometheus source: scrapes every second the targets the test names (file service discovery)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tandem.operator.local import free_port


class Prometheus:
    def __init__(self, workdir: Path):
        exe = shutil.which("prometheus")
        if exe is None:   # not a skip: CI installs it (scripts/test.sh)
            pytest.fail("prometheus is not installed: apt-get install prometheus (scripts/test.sh does it)",
                        pytrace=False)
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sd = self.dir / "targets.json"
        self.targets([])
        (self.dir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: tandem\n"
            f"    file_sd_configs: [{{files: ['{self.sd}'], refresh_interval: 1s}}]\n")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end:
            assert self.proc.poll() is None, (self.dir / "prometheus.log").read_text()[-2000:]
            try:
                if requests.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("prometheus not ready in 60 s")

    def targets(self, urls: list[str]) -> None:
        """Scrape exactly these base URLs (``http://host:port``) from now on."""
        hosts = [u.split("://", 1)[1] for u in urls]
        tmp = self.sd.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": hosts}]))
        tmp.replace(self.sd)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
