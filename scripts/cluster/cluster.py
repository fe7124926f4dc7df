"""A real Kubernetes v1.20.2 control plane on 127.0.0.1, plus a node agent that runs pods as processes.

    python scripts/cluster/cluster.py up [--dir DIR]    # start; prints the kubeconfig path; Ctrl-C stops
    python scripts/cluster/cluster.py build              # only build/cached binaries

Used by tests/operator through `Cluster` (a context manager). What it starts, each on a free port:
etcd (Debian's etcd-server), kube-apiserver (static admin token in system:masters, RBAC, audit log,
TokenRequest, --enable-aggregator-routing), kube-controller-manager (without the node lifecycle
controller), kube-scheduler, and `node_agent.py` (root: network namespaces on a private bridge).

Nothing here sends traffic outside loopback and the test's own namespaces: there is no kube-proxy, so
ClusterIPs are never dialed; the apiserver reaches Services through their Endpoints.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
K8S_VERSION = "v1.20.2"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / f"k8s-{K8S_VERSION}"


def build() -> Path:
    """Build (once) and return the directory holding kube-apiserver & co and kubectl 1.20."""
    out = subprocess.run(["bash", str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
"""


def _free_subnet_index() -> int:
    """A subnet index (20..219) whose bridge does not exist yet: the process's own by default, so that
    concurrent test runs differ, and the next free one when a cluster of this process still holds it
    (a session-scoped cluster beside a module-scoped one: both bind the apiserver forwarder on X.1)."""
    start = os.getpid() % 200
    for k in range(200):
        idx = (start + k) % 200 + 20
        if not Path(f"/sys/class/net/tdm-br{idx}").exists():
            return idx
    raise RuntimeError("no free 10.213.X.0/24 subnet: 200 tdm-br bridges exist")


class Cluster:
    """etcd + kube-apiserver + controller-manager + scheduler (+ node agent) on 127.0.0.1."""

    def __init__(self, workdir: str | Path | None = None, node_agent: bool = True, subnet_index: int | None = None,
                 pod_path_prepend: list[str] | None = None, image_paths: dict[str, str] | None = None):
        self.pod_path_prepend = list(pod_path_prepend or [])
        self.image_paths = dict(image_paths or {})
        self.bin = build()
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="tandem-cluster-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.token = secrets.token_hex(16)
        self.with_node_agent = node_agent
        # A private /24 only our namespaces use (10.213.X.0/24); the bridge is tdm-brX.
        self.subnet_index = subnet_index if subnet_index is not None else _free_subnet_index()
        self.subnet = f"10.213.{self.subnet_index}"
        self.bridge = f"tdm-br{self.subnet_index}"
        self.host_ip = f"{self.subnet}.1"
        self.audit_log = self.dir / "audit.log"
        self.kubeconfig = self.dir / "admin.kubeconfig"

    # ---- lifecycle --------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        f = open(log, "ab")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                             start_new_session=True)
        self.procs[name] = p
        return p

    def _pki(self) -> None:
        d = self.dir
        if not (d / "sa.key").exists():
            subprocess.run(["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"], check=True,
                           capture_output=True)
            subprocess.run(["openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub")],
                           check=True, capture_output=True)
        (d / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        (d / "audit-policy.yaml").write_text(AUDIT_POLICY)

    def start(self) -> "Cluster":
        self._pki()
        self.etcd_port, self.etcd_peer = free_port(), free_port()
        self._spawn("etcd", ["etcd", "--data-dir", str(self.dir / "etcd"), "--name", "tandem",
                             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                             "--initial-cluster", f"tandem=http://127.0.0.1:{self.etcd_peer}",
                             "--unsafe-no-fsync"])
        self.port = free_port()
        self.start_apiserver()
        self._write_kubeconfig()
        kc = str(self.kubeconfig)
        self.cm_port = free_port()
        self._spawn("controller-manager", [
            str(self.bin / "kube-controller-manager"), "--kubeconfig", kc, "--authentication-kubeconfig", kc,
            "--authorization-kubeconfig", kc, "--bind-address", "127.0.0.1", "--secure-port", str(self.cm_port),
            "--port", "0", "--controllers", "*,-nodelifecycle,-nodeipam,-csrsigning,-bootstrapsigner,-tokencleaner",
            "--service-account-private-key-file", str(self.dir / "sa.key"),
            "--root-ca-file", str(self.dir / "certs" / "apiserver.crt"),
            "--use-service-account-credentials=false", "--leader-elect=false",
            "--concurrent-gc-syncs", "5", "--v", "1"])
        self.sched_port = free_port()
        self._spawn("scheduler", [
            str(self.bin / "kube-scheduler"), "--kubeconfig", kc, "--authentication-kubeconfig", kc,
            "--authorization-kubeconfig", kc, "--bind-address", "127.0.0.1", "--secure-port", str(self.sched_port),
            "--port", "0", "--leader-elect=false", "--v", "1"])
        if self.with_node_agent:
            self.start_node_agent()
        return self

    def start_apiserver(self) -> None:
        d = self.dir
        (d / "certs").mkdir(exist_ok=True)
        self._spawn("apiserver", [
            str(self.bin / "kube-apiserver"),
            "--etcd-servers", f"http://127.0.0.1:{self.etcd_port}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(self.port),
            "--insecure-port", "0", "--cert-dir", str(d / "certs"),
            "--token-auth-file", str(d / "tokens.csv"), "--authorization-mode", "RBAC",
            "--service-account-key-file", str(d / "sa.pub"),
            "--service-account-signing-key-file", str(d / "sa.key"),
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--api-audiences", "https://kubernetes.default.svc",
            "--service-cluster-ip-range", "10.214.0.0/24",
            "--endpoint-reconciler-type", "none",
            "--enable-aggregator-routing=true",
            "--audit-log-path", str(self.audit_log), "--audit-policy-file", str(d / "audit-policy.yaml"),
            "--audit-log-maxsize", "200",
            "--enable-admission-plugins", "NamespaceLifecycle,ServiceAccount,DefaultStorageClass,"
                                          "ResourceQuota,MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
            "--allow-privileged=true", "--v", "1"])
        self.wait_ready()

    def stop_apiserver(self) -> None:
        self._stop("apiserver")

    def restart_apiserver(self) -> None:
        self.stop_apiserver()
        self.start_apiserver()

    def start_node_agent(self) -> None:
        env = os.environ.copy()
        env["PYTHONUNBUFFERED"] = "1"
        self._spawn("node-agent", [sys.executable, str(HERE / "node_agent.py"), "--kubeconfig", str(self.kubeconfig),
                                   "--subnet", self.subnet, "--bridge", self.bridge, "--node", "tandem-node",
                                   "--workdir", str(self.dir / "pods"),
                                   *[f"--path-prepend={p}" for p in self.pod_path_prepend],
                                   *[f"--image-path={i}={d}" for i, d in self.image_paths.items()]], env=env)
        deadline = time.time() + 30
        while time.time() < deadline:
            r = self.kubectl("get", "node", "tandem-node", "-o", "name", check=False)
            if r.returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError("node agent did not register its node; see " + str(self.logs["node-agent"]))

    def wait_ready(self, timeout: float = 60) -> None:
        ctx = ssl._create_unverified_context()
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            p = self.procs.get("apiserver")
            if p is not None and p.poll() is not None:
                raise RuntimeError("kube-apiserver exited; see " + str(self.logs["apiserver"]))
            try:
                req = urllib.request.Request(f"https://127.0.0.1:{self.port}/readyz",
                                             headers={"Authorization": f"Bearer {self.token}"})
                with urllib.request.urlopen(req, context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception as e:  # noqa: BLE001 - keep polling
                last = e
            time.sleep(0.3)
        raise RuntimeError(f"kube-apiserver not ready: {last}")

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _write_kubeconfig(self) -> None:
        write_kubeconfig(self.kubeconfig, self.server, self.token, user="admin")

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                kubeconfig: str | Path | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run([str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
                           capture_output=True, text=True, input=input)
        if check and r.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {r.stderr}")
        return r

    def _stop(self, name: str, grace: float = 10) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    def stop(self) -> None:
        # The node agent first: it stops its pods and removes its namespaces and bridge.
        self._stop("node-agent", grace=40)
        for name in ("scheduler", "controller-manager", "apiserver", "etcd"):
            self._stop(name)

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def write_kubeconfig(path: str | Path, server: str, token: str, user: str = "user",
                     namespace: str | None = None) -> Path:
    ctx = {"cluster": "tandem", "user": user}
    if namespace:
        ctx["namespace"] = namespace
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "tandem",
           "clusters": [{"name": "tandem", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
           "users": [{"name": user, "user": {"token": token}}],
           "contexts": [{"name": "tandem", "context": ctx}]}
    Path(path).write_text(yaml.safe_dump(cfg))
    os.chmod(path, 0o600)
    return Path(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["up", "build"])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-node-agent", action="store_true")
    a = ap.parse_args()
    if a.cmd == "build":
        print(build())
        return 0
    c = Cluster(a.dir, node_agent=not a.no_node_agent)
    with c:
        print(f"export KUBECONFIG={c.kubeconfig}", flush=True)
        print(f"# kubectl 1.20: {c.bin / 'kubectl'}; logs in {c.dir}; Ctrl-C to stop", flush=True)
        try:
            signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
