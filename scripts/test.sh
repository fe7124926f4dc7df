#!/usr/bin/env bash
# The test command: set up (idempotent), then run every suite. Extra arguments go to pytest.
# The operator suite builds (once, cached under ${XDG_CACHE_HOME:-~/.cache}/tandem/) and starts a real
# kube-apiserver v1.20.2 with etcd; the serving suite starts real worker processes on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo's top-level operator/ folder would shadow the standard library's `operator` for
# `python -m ...` run here (which puts the current directory first on sys.path); Python 3.11's
# safe-path mode leaves the current directory out.
export PYTHONSAFEPATH=1
./scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -ra "$@"
