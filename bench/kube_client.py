"""The operator's REST client (operator/kube.py) against the kubernetes package's dynamic client
(``kubernetes.dynamic``) on the real kube-apiserver v1.20.2 test cluster (scripts/cluster), not a test.

    PYTHONSAFEPATH=1 .venv/bin/python bench/kube_client.py [--rounds 3] [--passes 5]

Each client runs in a fresh interpreter (``--rounds`` times, alternating) and does the API work of a
reconcile pass of one pool: for each of the pool's children (examples/smollm2.yaml through
``desired_objects``: ConfigMap, router RBAC, 3 Services, 3 Deployments, 2 NetworkPolicies, 3 PDBs) a GET
and a server-side apply under the operator's field manager (the reconciler reads children with one LIST
per kind instead of the GETs; the same for both clients here). Each pass starts with the reconciler's
capability questions (is each of five kinds served: the two Gateway API Inference Extension versions,
``policy/v1`` PDBs, ServiceMonitor, NetworkPolicy; on the bare v1.20 test cluster only NetworkPolicy
is). Ours is ``Reconciler.capabilities`` itself, with its 10 s answers expired before each pass, as one
resync period (10 s) later; the dynamic client's equivalent is a ``resources.get`` per kind, which
re-runs discovery on a miss. The first pass creates the children, the other ``--passes - 1`` find them
in place (the steady state).
Printed per client (medians): import time, client construction (the dynamic client's discovery
included), its API requests, one steady pass's wall time and requests, and the process's RSS at the
end; the last two columns are the ratios dynamic / ours. Requests are counted at the one place both
clients send them (``kubernetes.client.rest.RESTClientObject.request``).

The dynamic client's discovery cache is a file; ``cold`` removes it before each run (a fresh operator
pod), ``warm`` keeps it (the file from the previous round).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
if MODE == "ours":
    from tandem.operator.kube import Kube, KubeError, path_of
else:
    from kubernetes.dynamic import DynamicClient
    from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from kubernetes import client, config
t_import = time.perf_counter() - t0

from kubernetes.client import rest
calls = [0]
_request = rest.RESTClientObject.request
def counted(self, *a, **k):
    calls[0] += 1
    return _request(self, *a, **k)
rest.RESTClientObject.request = counted

import yaml
from tandem.operator import spec as S
from tandem.operator.desired import Capabilities, desired_objects
import urllib3
urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
config.load_kube_config(KUBECONFIG)
pool = S.load_manifest(yaml.safe_load(open(MANIFEST)))
pool.metadata.namespace = NS
objs = desired_objects(pool, Capabilities(pdb_api_version="policy/v1beta1"))
for o in objs:
    o["metadata"].pop("ownerReferences", None)   # no pool object here: the garbage collector would take them

t1 = time.perf_counter()
if MODE == "ours":
    kube = Kube(client.ApiClient())
else:
    dyn = DynamicClient(client.ApiClient(), cache_file=CACHE)
t_ctor, n_ctor = time.perf_counter() - t1, calls[0]

# the reconciler's capability questions, asked each pass (operator/reconcile.py, Reconciler.capabilities)
CAPS = [("inference.networking.k8s.io/v1", "InferencePool"),
        ("inference.networking.x-k8s.io/v1alpha2", "InferencePool"), ("policy/v1", "PodDisruptionBudget"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"), ("networking.k8s.io/v1", "NetworkPolicy")]
if MODE == "ours":
    from tandem.operator.reconcile import Reconciler
    rec = Reconciler(kube)

def capabilities():
    if MODE == "ours":
        # as if the pass came one resync (10 s) after the last: the 10 s answers have expired, the
        # policy/v1 one (an hour) has not
        for gv in list(kube._disc_at):
            if gv != "policy/v1":
                kube._disc_at[gv] -= 11
        rec.capabilities()
    else:
        for gv, kind in CAPS:
            try:
                dyn.resources.get(api_version=gv, kind=kind)
            except ResourceNotFoundError:
                pass

c0 = calls[0]
capabilities()
n_first_caps = calls[0] - c0

def one_pass():
    capabilities()
    for o in objs:
        if MODE == "ours":
            kube.get(path_of(o))
            kube.apply(path_of(o), o)
        else:
            res = dyn.resources.get(api_version=o["apiVersion"], kind=o["kind"])
            try:
                res.get(name=o["metadata"]["name"], namespace=NS)
            except NotFoundError:
                pass
            res.server_side_apply(body=o, name=o["metadata"]["name"], namespace=NS,
                                  field_manager="tandem-operator", force_conflicts=True)

one_pass()   # creates (or re-applies) the children
walls, reqs = [], []
for _ in range(PASSES - 1):
    c0, t2 = calls[0], time.perf_counter()
    one_pass()
    walls.append(time.perf_counter() - t2)
    reqs.append(calls[0] - c0)
rss = int([l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]) / 1024
print(json.dumps({"import_s": t_import, "ctor_s": t_ctor, "ctor_requests": n_ctor, "caps_requests": n_first_caps,
                  "pass_s": sorted(walls)[len(walls) // 2], "pass_requests": max(reqs), "children": len(objs),
                  "rss_mib": rss}))
"""


def run_child(mode: str, kubeconfig: Path, ns: str, cache: Path, passes: int) -> dict:
    head = (f"MODE={mode!r}; KUBECONFIG={str(kubeconfig)!r}; NS={ns!r}; CACHE={str(cache)!r}; "
            f"PASSES={passes}; MANIFEST={str(ROOT / 'examples/smollm2.yaml')!r}\n")
    out = subprocess.run([sys.executable, "-c", head + CHILD], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONSAFEPATH="1"))
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster (by PID) on SIGTERM too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "scripts" / "cluster"))
    from cluster import Cluster
    workdir = Path(tempfile.mkdtemp(prefix="tandem-kube-client-bench-"))
    cache = workdir / "discovery-cache.json"
    rows: dict[str, list[dict]] = {"ours": [], "dynamic (cold)": [], "dynamic (warm)": []}
    with Cluster(workdir / "cluster", node_agent=False) as c:
        c.kubectl("create", "namespace", "bench")
        for _ in range(a.rounds):
            rows["ours"].append(run_child("ours", c.kubeconfig, "bench", cache, a.passes))
            cache.unlink(missing_ok=True)
            rows["dynamic (cold)"].append(run_child("dynamic", c.kubeconfig, "bench", cache, a.passes))
            rows["dynamic (warm)"].append(run_child("dynamic", c.kubeconfig, "bench", cache, a.passes))
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}
    fields = [("import_s", "import (s)", "{:.3f}"), ("ctor_s", "client ready (s)", "{:.3f}"),
              ("ctor_requests", "requests to be ready", "{:.0f}"),
              ("caps_requests", "requests for the first capability check", "{:.0f}"),
              ("pass_s", "steady pass (s)", "{:.3f}"),
              ("pass_requests", "requests per pass", "{:.0f}"), ("rss_mib", "RSS at end (MiB)", "{:.1f}")]
    print(f"{med['ours']['children']:.0f} children per pass; medians of {a.rounds} rounds, "
          f"{a.passes - 1} steady passes each\n")
    print("| | ours (operator/kube.py) | dynamic, cold cache | dynamic, warm cache | cold / ours | warm / ours |")
    print("|---|---|---|---|---|---|")
    for f, label, fmt in fields:
        o, dc, dw = med["ours"][f], med["dynamic (cold)"][f], med["dynamic (warm)"][f]
        ratio = (lambda x: f"{x / o:.2f}x" if o else "-")
        print(f"| {label} | {fmt.format(o)} | {fmt.format(dc)} | {fmt.format(dw)} | {ratio(dc)} | {ratio(dw)} |")
    print("\nraw:", json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
