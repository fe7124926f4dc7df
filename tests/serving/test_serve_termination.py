"""`tandem serve` writes its fatal error where Kubernetes reads it (TANDEM_TERMINATION_LOG, which the
operator sets to the container's terminationMessagePath); the operator shows it as the pool's
Degraded message (issue #13). Real processes, no cluster."""
import importlib.util
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)


def serve(tmp_path, engine: dict, source: dict) -> tuple[int, str]:
    cfg = tmp_path / "decode.yaml"
    cfg.write_text(yaml.safe_dump({"pool": "p", "model": {"name": "m", "source": source, "dtype": "float32"},
                                   "engine": {"kvCache": {"bytes": "64Mi"}, **engine}}))
    log = tmp_path / "termination-log"
    r = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "serve", "--role", "decode", "--config", str(cfg),
                        "--host", "127.0.0.1", "--port", "0"], capture_output=True, text=True, timeout=100,
                       env={**__import__("os").environ, "TANDEM_TERMINATION_LOG": str(log)})
    return r.returncode, log.read_text() if log.exists() else ""


def test_missing_model_is_the_termination_message(tmp_path):
    rc, msg = serve(tmp_path, {}, {"path": "/models/missing.gguf"})
    assert rc != 0 and msg == "decode: ModelLoadError: /models/missing.gguf: no such file or directory", msg


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attn_without_the_package_fails_before_loading_the_model(tmp_path):
    # A missing model would fail the load; the backend is checked first, so its error is the one shown
    # (and a pod crash-loops in seconds, not after each model load).
    rc, msg = serve(tmp_path, {"attentionBackend": "flash-attn"}, {"path": "/models/missing.gguf"})
    assert rc != 0 and "attentionBackend flash-attn needs the flash-attn package" in msg, msg
