#!/usr/bin/env bash
# The test command: set up (idempotent), build what the suites need, then run every suite. Extra
# arguments go to pytest.
# The operator suite runs a real kube-apiserver v1.20.2 with etcd. Building it takes minutes on a fresh
# machine (about 8 on 2 cores; cached under ${XDG_CACHE_HOME:-~/.cache}/tandem/ afterwards), so it is
# built here, with its progress shown and a budget of its own, before pytest and its per-test timeouts.
# The serving suite starts real worker processes on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo's top-level operator/ folder would shadow the standard library's `operator` for
# `python -m ...` run here (which puts the current directory first on sys.path); Python 3.11's
# safe-path mode leaves the current directory out.
export PYTHONSAFEPATH=1
./scripts/setup.sh
. .venv/bin/activate
if [[ $(id -u) -eq 0 ]]; then   # the operator suite needs root (network namespaces); it skips otherwise
  echo "test.sh: building the test cluster (kube-apiserver v1.20.2; cached after the first time)..."
  t0=$SECONDS
  timeout "${TANDEM_CLUSTER_BUILD_TIMEOUT:-2400}" bash scripts/cluster/build.sh
  timeout 600 bash scripts/cluster/get_helm.sh
  # The autoscaler's Prometheus metric source is tested against a real Prometheus (Debian's 2.42).
  if ! command -v prometheus >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
  fi
  echo "test.sh: test cluster ready ($((SECONDS - t0)) s)"
fi
# pytest runs in three pytest-xdist workers (TANDEM_TEST_WORKERS; 0 runs it in one process), each taking
# whole groups of tests (tests/xdist_groups.py). Three on 2 cores: the test cluster's group mostly waits
# on the API server and on autoscaler windows, so a third worker fills cores two leave idle (pytest
# 14.8 min with three, the machine 86% busy, where two took 16.2 before this session's cuts:
# bench/RESULTS.md, fifteenth session).
# --durations=30: the slowest tests in every log (CI included), to see where the time goes
workers=${TANDEM_TEST_WORKERS:-3}
dist=(-n "$workers")
[[ $workers != 0 ]] && dist+=(--dist loadgroup)
exec python -m pytest -ra --durations=30 "${dist[@]}" "$@"
