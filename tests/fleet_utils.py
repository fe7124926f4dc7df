"""Helpers for end-to-end tests: a real local fleet from an InferencePool manifest, HTTP calls, and
Prometheus scraping."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tandem.operator.local import LocalFleet, free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
#: The autoscaling tests' decode TPOT target, as a multiple of a single request's TPOT measured in-run.
#: 2.5, not the scenarios' 1.5: this shared 2-core VM's decode step drifts by up to 2x within minutes
#: (a clean-clone run measured 47 ms alone, then a two-stream trickle's p90 of 88 ms a few minutes later,
#: and the pool rightly never scaled down), while their heavy loads run 3-6x the single TPOT.
TPOT_TARGET_FACTOR = 2.5


class LogBuffer(io.StringIO):
    """Collects the fleet's prefixed process output (printed when a test fails)."""


class LogTee(io.TextIOBase):
    """The fleet's prefixed process output, passed on to stderr and kept (``text()``), so a test can
    assert what the processes logged (no traceback, a restart's reason)."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, s: str) -> int:
        self.parts.append(s)
        sys.stderr.write(s)
        return len(s)

    def flush(self) -> None:
        sys.stderr.flush()

    def text(self, since: int = 0) -> str:
        """Everything written after the first ``since`` writes (``len(parts)`` marks a point)."""
        return "".join(self.parts[since:])


def example_manifest(overrides: dict | None = None, name: str = "e2e") -> Path:
    """examples/smollm2.yaml renamed, with ``{"spec.engine.kvCache": ..., ...}`` overrides, in a temp file."""
    manifest = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    manifest["metadata"]["name"] = name
    for path, value in (overrides or {}).items():
        node = manifest
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    f = Path(tempfile.mkdtemp()) / "pool.yaml"
    f.write_text(yaml.safe_dump(manifest))
    return f


def single_tpot(url: str, n: int = 48) -> float:
    """TPOT of one request alone, from its stream: (E2E - TTFT) / (tokens - 1), seconds (the base the
    autoscaling tests set their TPOT targets from)."""
    r = requests.post(url + "/v1/completions", stream=True, timeout=300, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True, "stream": True})
    first = None
    for line in r.iter_lines():
        if line.startswith(b"data: ") and first is None and b'"text"' in line:
            first = time.monotonic()
    return (time.monotonic() - first) / (n - 1)


def start_fleet(overrides: dict | None = None, name: str = "e2e", pool_secret: bool = False,
                manifest: Path | None = None) -> LocalFleet:
    """A local fleet of the example (or ``manifest``). Without ``pool_secret`` (the default here, not in
    `tandem up`) its workers take requests from anyone, as the suites that play the router and call
    workers directly need; tests/serving/test_auth.py runs fleets with it."""
    fleet = LocalFleet(str(manifest or example_manifest(overrides, name)), router_port=0, log_stream=LogTee(),
                       pool_secret=pool_secret)
    try:
        fleet.start(timeout=300)
    except Exception:
        fleet.stop(grace=5)
        raise
    return fleet


def start_worker(role: str = "both", name: str = "e2e-both",
                 overrides: dict | None = None, log=None, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """One ``tandem serve`` process from the example manifest's worker config (with ``overrides``),
    with ``env`` added to this process's environment; its output goes to ``log`` (an open file) when
    given."""
    from tandem.operator.spec import load_manifest, worker_config
    from tandem.worker.api.config import cpu_threads
    from tandem.worker.api.names import CPU_THREADS_ENV
    pool = load_manifest(example_manifest(overrides, name))
    cfg = Path(tempfile.mkdtemp()) / "worker.yaml"
    cfg.write_text(worker_config(pool, role).to_yaml())
    port = free_port()
    # the thread budget a fleet's worker of this role gets (operator/local.py); `both` runs as decode
    threads = cpu_threads((getattr(pool.spec, "decode" if role == "both" else role).resources.requests or {})
                          .get("cpu"))
    env = {**os.environ, **({CPU_THREADS_ENV: str(threads)} if threads else {}), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", role, "--config",
                             str(cfg), "--port", str(port), "--kv-port", "0"], start_new_session=True, env=env,
                            stdout=log, stderr=subprocess.STDOUT if log is not None else None)
    url = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + 300
    while time.monotonic() < t_end:
        assert proc.poll() is None, f"{name} exited with {proc.returncode}"
        try:
            if requests.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{name} not ready")


def chat(url: str, question: str, stream: bool = False, max_tokens: int = 32, timeout: float = 300,
         system: str | None = None, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **extra}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout, stream=stream)
    if not stream:
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"], r.json()
    r.raise_for_status()
    return read_stream(r)


def read_stream(r) -> tuple[str, list[dict]]:
    """The concatenated text and the parsed chunks of an SSE response; asserts it ended with [DONE]."""
    text, chunks, done = "", [], False
    for line in r.iter_lines():
        if not line or line.startswith(b"id: "):   # the router numbers its events (stream resumption)
            continue
        assert line.startswith(b"data: "), line
        if line == b"data: [DONE]":
            done = True
            break
        c = json.loads(line[6:])
        assert "error" not in c, c
        chunks.append(c)
        for ch in c["choices"]:
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    assert done, "stream ended without [DONE]"
    assert chunks[-1]["choices"] and chunks[-1]["choices"][0]["finish_reason"] is not None or \
        chunks[-2]["choices"][0]["finish_reason"] is not None
    return text, chunks


def metric(url: str, name: str, **labels) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``.

    Raises LookupError when no such sample exists: a misspelt name or a series the server never
    exported must not read as 0 (that would make every no-leak assertion pass)."""
    text = requests.get(url + "/metrics", timeout=10).text
    found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    if not found:
        raise LookupError(f"{url}/metrics has no sample {name}{labels or ''}")
    return sum(found)


def urls(fleet: LocalFleet, role: str) -> list[str]:
    """The base URLs of a fleet's processes of one role."""
    return [p.url for p in fleet.procs if p.role == role]


def prefix_cache_hits(fleet: LocalFleet) -> float:
    """Prompt tokens found in the prefix cache, over every worker of the fleet: a request's hit lands on
    its prefill worker, or on its decode worker when the router skips remote prefill for a prefix the
    decode worker holds."""
    return sum(metric(p.url, "tandem:prefix_cache_hits_total") for p in fleet.procs if p.role != "router")


def wait_for(cond, timeout: float = 30.0, interval: float = 0.2):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    return cond()
