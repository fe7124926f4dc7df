"""Operator soak with broken pools (issue #13), on the real kube-apiserver v1.20.2 test cluster. Root.

    .venv/bin/python bench/operator_soak.py [--healthy 15] [--minutes 5] [--settle-seconds 60]

The operator runs as the chart's Deployment (a pod of the node agent, under the chart's
ServiceAccount, resync 10 s as in the chart's default). Worker pods run the MOCK `tandem serve`
(tests/operator/mock_bin/tandem): the operator's work is the same. --healthy pools of one prefill,
one decode and one router each, plus 5 pools broken in different ways:

- `invalid`: two model sources (admitted: the webhook is fail-open and these are applied first,
  while the operator is stopped) -> Degraded/InvalidSpec;
- `badname.v2`: a name its Services cannot have (admitted the same way) -> Degraded/InvalidSpec;
- `badres`: decode requests.cpu above limits.cpu: the Deployment is refused (422) -> ChildRejected;
- `nomodel`: model.source.path missing: workers and router crash-loop -> Degraded/PodsFailing;
- `quota`: a ResourceQuota refuses its PDBs (403) -> Degraded/ApplyFailed, retried with back-off.

After --settle-seconds, for --minutes minutes: per minute, the operator's CPU (utime+stime from
/proc) and its writes (create/update/patch/delete in the audit log by its ServiceAccount), split
into writes to the broken pools (and their children) and the rest. Prints JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))
from operator_helpers import (MOCK_BIN, OPERATOR_NS, OPERATOR_SA, AuditLog, Cluster, Operator,  # noqa: E402
                              render_chart)

BROKEN = ["invalid", "badname.v2", "badres", "nomodel", "quota"]


def proc_cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def manifest(ns: str, name: str) -> dict:
    d = yaml.safe_load((ROOT / "examples/smollm2.yaml").read_text())
    d["metadata"].update(name=name, namespace=ns)
    return d


def broken(name: str) -> dict:
    d = manifest("soak", name) if name != "quota" else manifest("soak-quota", name)
    if name == "invalid":
        d["spec"]["model"]["source"]["path"] = "/models/x"
    elif name == "badres":
        d["spec"]["decode"]["resources"] = {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}
    elif name == "nomodel":
        d["spec"]["model"]["source"] = {"path": "/models/missing.gguf"}
    return d


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster (by PID) on SIGTERM too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--healthy", type=int, default=15)
    ap.add_argument("--minutes", type=int, default=5)
    ap.add_argument("--settle-seconds", type=float, default=60)
    a = ap.parse_args()
    helm = subprocess.run(["bash", str(ROOT / "scripts/cluster/get_helm.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    workdir = tempfile.mkdtemp(prefix="tandem-operator-soak-")
    c = Cluster(workdir, pod_path_prepend=[str(MOCK_BIN)])
    with c:
        c.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        c.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/inferencepools.serving.tandem.dev")
        c.kubectl("create", "namespace", OPERATOR_NS)
        c.kubectl("apply", "-f", "-", input=render_chart(helm, "resyncSeconds=10"))
        op = Operator(c)
        for ns in ("soak", "soak-quota"):
            c.kubectl("create", "namespace", ns)
        c.kubectl("apply", "-f", "-", input=yaml.safe_dump(
            {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pdbs", "namespace": "soak-quota"},
             "spec": {"hard": {"count/poddisruptionbudgets.policy": "0"}}}))
        # the invalid ones first, while no webhook is there (fail-open), as a user might meet them
        for name in ("invalid", "badname.v2"):
            c.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(broken(name)))
        op.scale(1, timeout=120)
        for name in ("badres", "nomodel", "quota"):
            c.kubectl("apply", "-f", "-", input=yaml.safe_dump(broken(name)))
        docs = "\n---\n".join(yaml.safe_dump(manifest("soak", f"ok{i:02d}")) for i in range(a.healthy))
        c.kubectl("apply", "-f", "-", input=docs)
        t0 = time.time()
        while True:  # every healthy pool Ready
            pools = json.loads(c.kubectl("get", "tpool", "-A", "-o", "json").stdout)["items"]
            ready = [p for p in pools if p["metadata"]["name"].startswith("ok") and any(
                x["type"] == "Ready" and x["status"] == "True" for x in p.get("status", {}).get("conditions", []))]
            if len(ready) == a.healthy or time.time() - t0 > 600:
                break
            time.sleep(2)
        print(json.dumps({"healthy_ready": len(ready), "seconds": round(time.time() - t0, 1)}), flush=True)
        time.sleep(a.settle_seconds)
        pid = op.pid()
        audit = AuditLog(c)
        rows = []
        for minute in range(1, a.minutes + 1):
            m, cpu0, t1 = audit.mark(), proc_cpu_seconds(pid), time.time()
            time.sleep(60)
            cpu = (proc_cpu_seconds(pid) - cpu0) / (time.time() - t1)
            writes = {"broken": 0, "healthy": 0, "events": 0}
            for ev in audit.events(m, OPERATOR_SA):
                if ev.get("verb") not in ("create", "update", "patch", "delete"):
                    continue
                ref = ev.get("objectRef") or {}
                if ref.get("resource") == "events":
                    writes["events"] += 1
                elif any((ref.get("name") or "").startswith(b) for b in BROKEN):
                    writes["broken"] += 1
                else:
                    writes["healthy"] += 1
            rows.append({"minute": minute, "operator_cpu_cores": round(cpu, 4), "writes": writes})
            print(json.dumps(rows[-1]), flush=True)
        status = {p["metadata"]["name"]: next((f"{x['reason']}" for x in p.get("status", {}).get("conditions", [])
                                               if x["type"] == "Degraded" and x["status"] == "True"), "-")
                  for p in json.loads(c.kubectl("get", "tpool", "-A", "-o", "json").stdout)["items"]
                  if not p["metadata"]["name"].startswith("ok")}
        print(json.dumps({"broken_pools_degraded": status}), flush=True)
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
