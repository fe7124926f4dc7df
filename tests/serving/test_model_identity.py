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
# the second test's prompt: the shared decode worker caches the first test's prompt
OTHER_PROMPT = "Two models of the same shape but other weights must never exchange a single KV block"


def _overrides(path: Path) -> dict:
    return {"spec.model.source": {"path": str(path)}, "spec.model.maxModelLen": 256,
            "spec.engine.kvCache": {"bytes": "16Mi"}}


def _complete(url: str, peer: str | None = None, prompt: str = PROMPT) -> dict:
    headers = {"X-Tandem-Prefill-Peer": peer} if peer else {}
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
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


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    from tiny_models import build_model
    tmp = tmp_path_factory.mktemp("identity")
    a = tmp / "mnt-a" / "llama"
    b = tmp / "volumes" / "b" / "llama-copy"
    shutil.copytree(tiny_llama, a)
    shutil.copytree(tiny_llama, b)
    other = build_model(tmp / "other", "llama", seed=11)   # same shape, different weights
    return a, b, other


@pytest.fixture(scope="module")
def decode_a(models, tmp_path_factory):
    """One decode worker of the model at path ``a`` for both tests (a worker start is most of each
    test's time): ``(url, log file)``. The tests send different prompts, so neither finds the other's
    prompt in this worker's prefix cache, and they count its fallbacks as differences."""
    log = open(tmp_path_factory.mktemp("identity-logs") / "decode.log", "w+")
    decode, d_url = start_worker("decode", "id-decode", _overrides(models[0]), log=log)
    yield d_url, log
    _stop(decode)
    log.close()


def test_the_same_model_at_two_paths_exchanges_kv(models, decode_a):
    a, b, _ = models
    d_url, _ = decode_a
    prefill, p_url = start_worker("prefill", "id-prefill", _overrides(b))
    try:
        hp, hd = requests.get(p_url + "/health").json(), requests.get(d_url + "/health").json()
        assert hp["model_fingerprint"] == hd["model_fingerprint"]
        assert hp["startup"]["phase"] == "ready" and "reading" in hp["startup"]["phase_seconds"]
        fallbacks = metric(d_url, "tandem:local_prefill_fallbacks_total")
        received = metric(d_url, "tandem:kv_transfer_bytes_total", direction="received")
        _complete(d_url, peer=p_url)
        assert metric(d_url, "tandem:kv_transfer_bytes_total", direction="received") > received
        assert metric(d_url, "tandem:local_prefill_fallbacks_total") == fallbacks
    finally:
        _stop(prefill)


def test_same_shape_different_weights_are_never_paired(models, decode_a, tmp_path):
    a, _, other = models
    d_url, decode_log = decode_a
    logs = {n: open(tmp_path / f"{n}.log", "w+") for n in ("prefill", "router")}
    prefill, p_url = start_worker("prefill", "id-prefill", _overrides(other), log=logs["prefill"])
    procs = [prefill]
    try:
        fallbacks = metric(d_url, "tandem:local_prefill_fallbacks_total")
        fp_p = requests.get(p_url + "/health").json()["model_fingerprint"]
        fp_d = requests.get(d_url + "/health").json()["model_fingerprint"]
        assert fp_p != fp_d

        # a transfer forced between them is refused at the handshake, naming both; decode prefills locally
        _complete(d_url, peer=p_url, prompt=OTHER_PROMPT)
        assert metric(d_url, "tandem:local_prefill_fallbacks_total") == fallbacks + 1
        wait_for(lambda: fp_p in Path(decode_log.name).read_text())
        refusal = next(line for line in Path(decode_log.name).read_text().splitlines() if "mismatch" in line)
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
        _complete(r_url, prompt=OTHER_PROMPT)
        health = requests.get(r_url + "/health").json()
        assert set(health["model_fingerprints"]) == {fp_p, fp_d}
        assert metric(r_url, "tandem:router_routing_decisions_total", decision="model_mismatch") == 1
        assert metric(d_url, "tandem:local_prefill_fallbacks_total") == fallbacks + 1    # nothing was even tried
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
