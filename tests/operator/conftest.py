"""Fixtures for the operator's tests on a real kube-apiserver v1.20.2 (scripts/cluster).

The session builds (once, cached under ${XDG_CACHE_HOME:-~/.cache}/tandem/) and starts etcd, the control
plane and the node agent; applies crds/; renders the Helm chart and applies it, so the operator runs as
a pod (a process in its own network namespace, through the node agent) under the chart's
ServiceAccount with a TokenRequest token. Everything is stopped by PID at the end.

Worker pods run the real `tandem serve` when it exists; otherwise a MOCK `tandem serve`
(tests/operator/mock_bin/tandem) that serves /health, /ready, /drain and scripted /metrics. Pods of the
image MOCK_IMAGE always run the mock (the autoscaler's tests script their /metrics).
"""
from __future__ import annotations

import subprocess

import pytest

from operator_helpers import (ROOT, Operator,  # noqa: F401
                              install_operator, real_worker_available, running_cluster)


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return subprocess.run(["bash", str(ROOT / "scripts/cluster/get_helm.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def worker_kind() -> str:
    return "real" if real_worker_available() else "mock"


@pytest.fixture(scope="session")
def cluster(request, worker_kind):
    with running_cluster(request, worker_kind) as c:
        yield c


@pytest.fixture(scope="session")
def operator(cluster, helm_bin) -> Operator:
    return install_operator(cluster, helm_bin)
