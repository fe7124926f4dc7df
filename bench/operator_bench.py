"""Operator benchmark on the real kube-apiserver v1.20.2 test cluster (scripts/cluster), not a test.

    .venv/bin/python bench/operator_bench.py [--trials 10] [--pools 100] [--watch-seconds 60]

1. apply -> children: the time from `kubectl apply` of a pool (the smollm2 example) to all 13 of its
   children existing (ConfigMap, router SA/Role/RoleBinding, 3 Services, 3 Deployments, 3 PDBs),
   polled every 20 ms with the Python client; --trials pools, one at a time.
2. 100 pools: the operator's CPU and memory while it watches --pools pools: the time until all their
   Deployments exist, the CPU while the controller-manager catches up (--settle-seconds: ReplicaSets
   and Pods appear, Deployment status changes, each change wakes a status refresh), then CPU
   (utime+stime from /proc) and RSS over --watch-seconds of steady state, with the default resync
   interval (10 s: every pool is compared with its 13 children every 10 s, from one LIST per kind).

The operator runs as a local process (python -m tandem.operator, admin kubeconfig, no webhook);
the cluster has no node agent, so the pods stay Pending (the operator's work is the same).
Worker replicas are 0 and the router has 1 replica, so 100 pools make 100 Pending pods.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "cluster"))
from cluster import Cluster  # noqa: E402

KINDS = [("v1", "configmaps"), ("v1", "serviceaccounts"), ("rbac.authorization.k8s.io/v1", "roles"),
         ("rbac.authorization.k8s.io/v1", "rolebindings"), ("v1", "services"), ("apps/v1", "deployments"),
         ("policy/v1beta1", "poddisruptionbudgets")]


def proc_cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def count_children(kube, ns: str, pool: str) -> int:
    n = 0
    for gv, plural in KINDS:
        base = "/api/v1" if gv == "v1" else f"/apis/{gv}"
        doc = kube.request("GET", f"{base}/namespaces/{ns}/{plural}",
                           query={"labelSelector": f"serving.tandem.dev/pool={pool}"})
        n += len(doc["items"])
    return n


def manifest(ns: str, name: str) -> dict:
    d = yaml.safe_load((ROOT / "examples/smollm2.yaml").read_text())
    d["metadata"].update(name=name, namespace=ns)
    d["spec"]["prefill"]["replicas"] = 0
    d["spec"]["decode"]["replicas"] = 0
    return d


def main() -> int:
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster (by PID) on SIGTERM too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--pools", type=int, default=100)
    ap.add_argument("--watch-seconds", type=float, default=60)
    ap.add_argument("--resync-seconds", type=float, default=10)
    ap.add_argument("--settle-seconds", type=float, default=60,
                    help="wait after the last Deployment appears, while the controllers catch up")
    a = ap.parse_args()
    import tempfile
    from kubernetes import client, config
    import urllib3
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    workdir = tempfile.mkdtemp(prefix="tandem-operator-bench-")
    c = Cluster(workdir, node_agent=False)
    with c:
        c.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        c.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/inferencepools.serving.tandem.dev")
        env = dict(os.environ, KUBECONFIG=str(c.kubeconfig), TANDEM_LOG_LEVEL="WARNING")
        log = open(c.dir / "operator.log", "w")
        op = subprocess.Popen([sys.executable, "-m", "tandem.operator", "--resync-seconds", str(a.resync_seconds)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            config.load_kube_config(str(c.kubeconfig))
            from tandem.operator.kube import Kube
            api = Kube(client.ApiClient())
            time.sleep(3)
            c.kubectl("create", "namespace", "bench")
            # 1. apply -> all children exist
            lat = []
            for i in range(a.trials):
                name = f"lat{i}"
                t0 = time.perf_counter()
                c.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest("bench", name)))
                while count_children(api, "bench", name) < 13:
                    time.sleep(0.02)
                lat.append(time.perf_counter() - t0)
            print(json.dumps({"apply_to_children_s": {"median": statistics.median(lat), "min": min(lat),
                                                      "max": max(lat), "trials": lat}}), flush=True)
            # 2. N pools
            c.kubectl("create", "namespace", "many")
            docs = "\n---\n".join(yaml.safe_dump(manifest("many", f"p{i:03d}")) for i in range(a.pools))
            cpu0, t0 = proc_cpu_seconds(op.pid), time.perf_counter()
            c.kubectl("apply", "-f", "-", input=docs)
            while True:
                r = c.kubectl("get", "deployments", "-n", "many", "-o", "name")
                if len(r.stdout.split()) >= 3 * a.pools:
                    break
                time.sleep(0.5)
            t_all = time.perf_counter() - t0
            cpu_create = proc_cpu_seconds(op.pid) - cpu0
            cpu_s0, ts0 = proc_cpu_seconds(op.pid), time.perf_counter()
            time.sleep(a.settle_seconds)  # the controller-manager is still making ReplicaSets and Pods
            cpu_settle = (proc_cpu_seconds(op.pid) - cpu_s0) / (time.perf_counter() - ts0)
            rss = []
            cpu1, t1 = proc_cpu_seconds(op.pid), time.perf_counter()
            while time.perf_counter() - t1 < a.watch_seconds:
                rss.append(proc_rss_mib(op.pid))
                time.sleep(1)
            cpu_steady = (proc_cpu_seconds(op.pid) - cpu1) / (time.perf_counter() - t1)
            print(json.dumps({"pools": a.pools, "all_deployments_exist_s": round(t_all, 2),
                              "cpu_seconds_to_create": round(cpu_create, 2),
                              "settling_cpu_cores": round(cpu_settle, 4), "settle_seconds": a.settle_seconds,
                              "steady_cpu_cores": round(cpu_steady, 4), "rss_mib_mean": round(statistics.mean(rss), 1),
                              "rss_mib_max": round(max(rss), 1), "resync_seconds": a.resync_seconds,
                              "watch_seconds": a.watch_seconds}), flush=True)
        finally:
            op.terminate()
            try:
                op.wait(20)
            except subprocess.TimeoutExpired:
                op.kill()
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
