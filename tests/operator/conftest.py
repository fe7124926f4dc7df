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

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from operator_helpers import (MOCK_BIN, MOCK_IMAGE, OPERATOR_NS, ROOT, Cluster, Operator,  # noqa: F401
                              _can_run_cluster, real_worker_available, render_chart)


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return subprocess.run(["bash", str(ROOT / "scripts/cluster/get_helm.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def worker_kind() -> str:
    return "real" if real_worker_available() else "mock"


@pytest.fixture(scope="session")
def cluster(request, worker_kind):
    why = _can_run_cluster()
    if why:
        pytest.skip(why)
    extra = [] if worker_kind == "real" else [str(MOCK_BIN)]
    print(f"\n[operator e2e] worker pods run the {worker_kind.upper()} `tandem serve`", flush=True)
    # Not under pytest's basetemp: other pytest sessions on the machine rotate /tmp/pytest-of-<user>
    # and would delete etcd's data and the pods' files under a running cluster.
    workdir = Path(tempfile.mkdtemp(prefix="tandem-operator-e2e-"))
    print(f"[operator e2e] cluster files (logs, audit log, pods) in {workdir}", flush=True)
    c = Cluster(workdir, pod_path_prepend=extra, image_paths={MOCK_IMAGE: str(MOCK_BIN)})
    with c:
        c.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        c.kubectl("wait", "--for=condition=established", "--timeout=60s",
                  "crd/inferencepools.serving.tandem.dev", "crd/clusterkopfpeerings.kopf.dev")
        yield c
    # Everything it started is stopped (by PID). Keep the files only when something failed.
    if request.session.testsfailed == 0 and not os.environ.get("TANDEM_KEEP_CLUSTER"):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"\n[operator e2e] kept {workdir} for inspection", flush=True)


@pytest.fixture(scope="session")
def operator(cluster, helm_bin) -> Operator:
    cluster.kubectl("create", "namespace", OPERATOR_NS)
    rendered = render_chart(helm_bin)
    (cluster.dir / "chart-rendered.yaml").write_text(rendered)
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    cluster.kubectl("apply", "-f", "-", input=rendered)
    op = Operator(cluster)
    op.scale(1, timeout=120)
    return op


