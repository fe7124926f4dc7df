"""One model identity across the fleet, with real worker and router processes on loopback:

* the same model at two different paths is the same model: KV moves between the two workers
  (bytes > 0, no local-prefill fallback);
* two models of the same shape with different weights are not: their fingerprints differ, the router
  refuses to pair them and says so with both fingerprints, and a transfer forced between them is
  refused at the handshake, again naming both.
"""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests

from fleet_utils import MODEL, example_manifest, free_port, metric, start_worker, wait_for

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. Prefill computes the prompt, decode"


def _overrides(path: Path) -> dict:
    return {"spec.model.source": {"path": str(path)}, "spec.model.maxModelLen": 256,
            "spec.engine.kvCache": {"bytes": "16Mi"}}


def _complete(url: str, peer: str | None = None) -> dict:
    headers = {"X-Tandem-Prefill-Peer": peer} if peer else {}
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                     "temperature": 0}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stop(*procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture
def models(tiny_llama, tmp_path):
    from tiny_models import build_model
    a = tmp_path / "mnt-a" / "llama"
    b = tmp_path / "volumes" / "b" / "llama-copy"
    shutil.copytree(tiny_llama, a)
    shutil.copytree(tiny_llama, b)
    other = build_model(tmp_path / "other", "llama", seed=11)   # same shape, different weights
    return a, b, other


def test_the_same_model_at_two_paths_exchanges_kv(models):
    a, b, _ = models
    prefill, p_url = start_worker("prefill", "id-prefill", _overrides(a))
    try:
        decode, d_url = start_worker("decode", "id-decode", _overrides(b))
        try:
            hp, hd = requests.get(p_url + "/health").json(), requests.get(d_url + "/health").json()
            assert hp["model_fingerprint"] == hd["model_fingerprint"]
            assert hp["startup"]["phase"] == "ready" and "reading" in hp["startup"]["phase_seconds"]
            _complete(d_url, peer=p_url)
            assert metric(d_url, "tandem:kv_transfer_bytes_total", direction="received") > 0
            assert metric(d_url, "tandem:local_prefill_fallbacks_total") == 0
        finally:
            _stop(decode)
    finally:
        _stop(prefill)


def test_same_shape_different_weights_are_never_paired(models, tmp_path):
    a, _, other = models
    logs = {n: open(tmp_path / f"{n}.log", "w+") for n in ("prefill", "decode", "router")}
    prefill, p_url = start_worker("prefill", "id-prefill", _overrides(other), log=logs["prefill"])
    procs = [prefill]
    try:
        decode, d_url = start_worker("decode", "id-decode", _overrides(a), log=logs["decode"])
        procs.append(decode)
        fp_p = requests.get(p_url + "/health").json()["model_fingerprint"]
        fp_d = requests.get(d_url + "/health").json()["model_fingerprint"]
        assert fp_p != fp_d

        # a transfer forced between them is refused at the handshake, naming both; decode prefills locally
        _complete(d_url, peer=p_url)
        assert metric(d_url, "tandem:local_prefill_fallbacks_total") == 1
        wait_for(lambda: fp_p in Path(logs["decode"].name).read_text())
        refusal = next(line for line in Path(logs["decode"].name).read_text().splitlines() if "mismatch" in line)
        assert fp_p in refusal and fp_d in refusal

        # the router takes the fingerprints from /health and does not pair them at all
        from tandem.operator.spec import load_manifest, worker_config
        cfg = worker_config(load_manifest(example_manifest(_overrides(a), "id")), "router")
        cfg.discovery = {"mode": "static", "prefill": [p_url], "decode": [d_url]}
        cfg_file = Path(tempfile.mkdtemp()) / "router.yaml"
        cfg_file.write_text(cfg.to_yaml())
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "router",
                                   "--config", str(cfg_file), "--port", str(port)], start_new_session=True,
                                  stdout=logs["router"], stderr=subprocess.STDOUT)
        procs.append(router)
        r_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(r_url + "/ready"), timeout=120)
        _complete(r_url)
        health = requests.get(r_url + "/health").json()
        assert set(health["model_fingerprints"]) == {fp_p, fp_d}
        assert metric(r_url, "tandem:router_routing_decisions_total", decision="model_mismatch") == 1
        assert metric(d_url, "tandem:local_prefill_fallbacks_total") == 1    # nothing was even tried
        warning = next(line for line in Path(logs["router"].name).read_text().splitlines()
                       if "not pairing" in line)
        assert fp_p in warning and fp_d in warning
    finally:
        _stop(*reversed(procs))
        for f in logs.values():
            f.close()


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False
