#!/usr/bin/env bash
# The whole story on one machine, in one command: the test cluster (a real kube-apiserver v1.20.2,
# controller-manager, scheduler and a node agent that runs pods as local processes), crds/ applied with
# `kubectl apply --server-side`, the chart applied from `helm template`, the operator as the chart's pod,
# a SmolLM2 InferencePool applied from a file written once, a chat completion at the router pod, a load
# ramp from `tandem bench serve` until decode scales up, a GitOps re-apply that moves no count, a trickle
# until the extra replica is drained away, and the pool deleted (tests/e2e/test_story.py).
# Needs root (network namespaces) and the setup (scripts/setup.sh). Figures go to $TANDEM_E2E_RESULTS
# (default /tmp/tandem-e2e-results.json); TANDEM_KEEP_CLUSTER=1 keeps the cluster's files. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1   # the repo's operator/ folder must not shadow the standard library's
bash scripts/cluster/build.sh        # cached after the first time (minutes on 2 cores)
bash scripts/cluster/get_helm.sh >/dev/null
exec .venv/bin/python -m pytest tests/e2e -s -ra "$@"
