"""The operator on a real kube-apiserver v1.20.2, its pods run as processes by the node agent.

The tests run in file order and share one cluster and one pool (`e2e/smollm2`), like a user's session:
chart checks, invalid pools, apply, resume, changes, apiserver restart, Degraded, optional children,
delete, and finally the audit log's verdict on the operator's RBAC. The operator runs as the chart's
Deployment, under the chart's ServiceAccount (a TokenRequest token given by the node agent).
"""
from __future__ import annotations

import copy
import datetime
import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from operator_helpers import (OPERATOR_NS, OPERATOR_SA, ROOT, AuditLog, apply_yaml, condition, kget, render_chart,
                              wait_for)

NS = "e2e"
POOL = "smollm2"
CHILD_KINDS = ["configmaps", "serviceaccounts", "roles.rbac.authorization.k8s.io",
               "rolebindings.rbac.authorization.k8s.io", "services", "deployments.apps",
               "poddisruptionbudgets.policy"]


def base_manifest(path: str = "examples/smollm2.yaml", ns: str = NS, name: str | None = None) -> dict:
    d = yaml.safe_load((ROOT / path).read_text())
    d["metadata"]["namespace"] = ns
    if name:
        d["metadata"]["name"] = name
    return d


def children(c, ns: str = NS, pool: str = POOL) -> dict[str, dict]:
    out = {}
    for kind in CHILD_KINDS:
        doc = kget(c, kind, "-l", f"serving.tandem.dev/pool={pool}", ns=ns)
        for it in (doc or {}).get("items", []):
            out[f"{it['kind']}/{it['metadata']['name']}"] = it
    return out


def ensure_ns(c, ns: str) -> None:
    c.kubectl("create", "namespace", ns, check=False)


def pool_obj(c, ns: str = NS, name: str = POOL) -> dict | None:
    return kget(c, "inferencepools.serving.tandem.dev", name, ns=ns)


def is_ready(c, ns: str = NS, name: str = POOL) -> bool:
    p = pool_obj(c, ns, name)
    cnd = condition(p or {}, "Ready")
    return bool(cnd and cnd["status"] == "True" and p["status"].get("observedGeneration") == p["metadata"]["generation"])


def template_hashes(c) -> dict[str, tuple[str, int, str]]:
    out = {}
    for role in ("prefill", "decode", "router"):
        d = kget(c, "deployment", f"{POOL}-{role}", ns=NS)
        tmpl = d["spec"]["template"]
        out[role] = (tmpl["metadata"]["annotations"]["serving.tandem.dev/config-hash"],
                     d["metadata"]["generation"], tmpl["spec"]["containers"][0]["image"])
    return out


def patch_pool(c, patch: dict, ns: str = NS, name: str = POOL) -> None:
    c.kubectl("patch", "inferencepools.serving.tandem.dev", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))


# ---- the chart ----------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_chart_lint_strict(helm_bin):
    chart = str(ROOT / "charts/tandem-operator")
    for extra in ([], ["--set", "grafanaDashboard.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
                       "--set", "watchNamespaces={a,b}", "--set", "webhook.enabled=false"]):
        r = subprocess.run([helm_bin, "lint", "--strict", chart, *extra], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    # The chart's CRDs are the project's crds/ (Helm installs them once; upgrades use kubectl).
    for f in (ROOT / "crds").glob("*.yaml"):
        assert (ROOT / "charts/tandem-operator/crds" / f.name).read_text() == f.read_text(), f.name


@pytest.mark.timeout(300)
def test_chart_manifests_pass_server_dry_run(cluster, helm_bin, operator):
    # The default rendering was dry-run and applied by the `operator` fixture; here the other variants.
    ensure_ns(cluster, OPERATOR_NS)
    for sets in (["grafanaDashboard.enabled=true", "peering.enabled=false"], ["webhook.enabled=false"]):
        r = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=render_chart(helm_bin, *sets), check=False)
        assert r.returncode == 0, r.stderr


# ---- invalid pools --------------------------------------------------------------------------------

SMOL = "examples/smollm2.yaml"
LLAMA = "examples/llama3-8b-autoscaled.yaml"


def _set(path: str, value):
    def f(d):
        cur = d
        keys = path.split(".")
        for k in keys[:-1]:
            cur = cur[k]
        cur[keys[-1]] = value
    return f


def _del(path: str):
    def f(d):
        cur = d
        keys = path.split(".")
        for k in keys[:-1]:
            cur = cur[k]
        del cur[keys[-1]]
    return f


# (id, base manifest, one-field change, field path the message must name, layer: schema | webhook)
INVALID = [
    ("negative-replicas", SMOL, _set("spec.prefill.replicas", -1), "spec.prefill.replicas", "schema"),
    ("wrong-type", SMOL, _set("spec.router.replicas", "two"), "spec.router.replicas", "schema"),
    ("unknown-enum", SMOL, _set("spec.model.dtype", "float8"), "spec.model.dtype", "schema"),
    ("malformed-quantity", SMOL, _set("spec.engine.kvCache.bytes", "256MB"), "spec.engine.kvCache.bytes", "schema"),
    ("block-size-not-allowed", SMOL, _set("spec.engine.blockSize", 24), "spec.engine.blockSize", "schema"),
    ("missing-model-name", SMOL, _del("spec.model.name"), "spec.model.name", "schema"),
    ("max-model-len-too-small", SMOL, _set("spec.model.maxModelLen", 8), "spec.model.maxModelLen", "schema"),
    ("unknown-routing", SMOL, _set("spec.router.routing", "random"), "spec.router.routing", "schema"),
    ("memory-fraction-over-1", LLAMA, _set("spec.engine.kvCache.gpuMemoryFraction", 1.5),
     "spec.engine.kvCache.gpuMemoryFraction", "schema"),
    ("two-model-sources", SMOL, _set("spec.model.source.path", "/models/x"), "spec.model.source", "webhook"),
    ("no-model-source", SMOL, _set("spec.model.source", {}), "spec.model.source", "webhook"),
    ("min-gt-max", LLAMA, _set("spec.prefill.autoscaling.minReplicas", 9),
     "spec.prefill.autoscaling.minReplicas", "webhook"),
    ("replicas-with-autoscaling", LLAMA, _set("spec.decode.replicas", 2), "spec.decode.replicas", "webhook"),
    ("ratio-band-inverted", LLAMA, _set("spec.autoscaling.ratio.min", 5.0), "spec.autoscaling.ratio.min", "webhook"),
    ("wrong-slo-metric", LLAMA, _set("spec.prefill.autoscaling.target.metric", "tpot"),
     "spec.prefill.autoscaling.target.metric", "webhook"),
    ("prometheus-without-url", LLAMA, _set("spec.autoscaling.metrics.source", "prometheus"),
     "spec.autoscaling.metrics.url", "webhook"),
    ("kv-cache-two-sizes", SMOL, _set("spec.engine.kvCache.gpuMemoryFraction", 0.9), "spec.engine.kvCache", "webhook"),
]


@pytest.mark.timeout(240)
def test_invalid_pools_are_rejected_naming_the_field(cluster, operator):
    ensure_ns(cluster, "val")
    for base in (SMOL, LLAMA):  # the unmodified manifests are accepted
        r = apply_yaml(cluster, base_manifest(base, ns="val"), "--dry-run=server", check=False)
        assert r.returncode == 0, f"{base} rejected: {r.stderr}"
    failures = []
    for case, base, mutate, path, layer in INVALID:
        d = base_manifest(base, ns="val")
        mutate(d)
        # --validate=false: kubectl's own schema check would answer first; the API server must reject it
        r = apply_yaml(cluster, d, "--dry-run=server", "--validate=false", check=False)
        by_webhook = "admission webhook" in r.stderr
        if r.returncode == 0:
            failures.append(f"{case}: accepted")
        elif path not in r.stderr:
            failures.append(f"{case}: message does not name {path}: {r.stderr.strip()}")
        elif by_webhook != (layer == "webhook"):
            failures.append(f"{case}: expected the {layer} to reject it: {r.stderr.strip()}")
    assert not failures, "\n".join(failures)
    assert len(INVALID) >= 12


# ---- apply -------------------------------------------------------------------------------------

@pytest.mark.timeout(420)
def test_apply_creates_children_and_pool_turns_ready(cluster, operator, worker_kind):
    ensure_ns(cluster, NS)
    t0 = time.time()
    apply_yaml(cluster, base_manifest())
    want = {"ConfigMap/smollm2-config", "ServiceAccount/smollm2-router", "Role/smollm2-router",
            "RoleBinding/smollm2-router", "Service/smollm2-prefill", "Service/smollm2-decode",
            "Service/smollm2-router", "Deployment/smollm2-prefill", "Deployment/smollm2-decode",
            "Deployment/smollm2-router", "PodDisruptionBudget/smollm2-prefill",
            "PodDisruptionBudget/smollm2-decode", "PodDisruptionBudget/smollm2-router"}
    kids = wait_for(lambda: (k := children(cluster)) and want <= set(k) and k, 60, "children")
    print(f"\n[apply] all {len(want)} children exist after {time.time() - t0:.1f}s")
    uid = pool_obj(cluster)["metadata"]["uid"]
    for name, obj in kids.items():
        refs = obj["metadata"].get("ownerReferences", [])
        assert any(r["uid"] == uid and r.get("controller") for r in refs), name
    assert kids["PodDisruptionBudget/smollm2-decode"]["apiVersion"] == "policy/v1beta1"  # v1.20: by discovery
    wait_for(lambda: is_ready(cluster), 360, "pool Ready")
    print(f"[apply] pool Ready after {time.time() - t0:.1f}s ({worker_kind} workers)")
    p = pool_obj(cluster)
    assert p["status"]["prefill"]["summary"] == "1/1" and p["status"]["decode"]["readyReplicas"] == 1
    assert not pool_obj(cluster)["metadata"].get("finalizers"), "no finalizer may block deletion"
    # the pods run through the node agent; the workers' Endpoints list their pod IPs
    pods = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-o", "json").stdout)["items"]
    assert len(pods) == 3 and all(pp["status"]["phase"] == "Running" for pp in pods)
    for role in ("prefill", "decode"):
        ep = kget(cluster, "endpoints", f"{POOL}-{role}", ns=NS)
        ips = [a["ip"] for s in ep.get("subsets", []) for a in s.get("addresses", [])]
        assert ips and all(ip.startswith(cluster.subnet + ".") for ip in ips), ep
    # the printer columns
    out = cluster.kubectl("get", "tpool", "-n", NS).stdout
    assert "True" in out and "1/1" in out, out
    # events for what the operator did
    ev = json.loads(cluster.kubectl("get", "events", "-n", NS, "--field-selector",
                                    f"involvedObject.name={POOL},involvedObject.kind=InferencePool",
                                    "-o", "json").stdout)["items"]
    assert any(e["reason"] == "Created" for e in ev), [e["reason"] for e in ev]
    if worker_kind == "real":
        # the router found both workers through Endpoints and answers at its pod IP
        router_ip = next(pp["status"]["podIP"] for pp in pods if pp["metadata"]["labels"]["serving.tandem.dev/role"] == "router")
        import urllib.request
        body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
                           "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://{router_ip}:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        print(f"[apply] router at {router_ip} answered: {out['choices'][0]['text']!r}")
        assert out["choices"][0]["text"]


# ---- resume --------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_resume_repairs_and_leaves_right_children_alone(cluster, operator):
    wait_for(lambda: is_ready(cluster), 120, "pool Ready")
    operator.scale(0)
    cluster.kubectl("delete", "pdb", f"{POOL}-router", "-n", NS)
    cm = kget(cluster, "configmap", f"{POOL}-config", ns=NS)
    good = cm["data"]["prefill.yaml"]
    cluster.kubectl("patch", "configmap", f"{POOL}-config", "-n", NS, "--type=merge",
                    "-p", json.dumps({"data": {"prefill.yaml": "edited: by hand\n"}}))
    time.sleep(2)
    before = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster).items()}
    untouched = {k: rv for k, rv in before.items() if k != f"ConfigMap/{POOL}-config"}
    operator.scale(1)
    wait_for(lambda: kget(cluster, "pdb", f"{POOL}-router", ns=NS), 60, "PDB recreated")
    wait_for(lambda: kget(cluster, "configmap", f"{POOL}-config", ns=NS)["data"]["prefill.yaml"] == good, 60,
             "ConfigMap repaired")
    time.sleep(12)  # two more resync passes (resyncSeconds=5)
    after = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster).items()}
    changed = sorted(k for k, rv in untouched.items() if after.get(k) != rv)
    assert not changed, f"the operator wrote to children that were already right: {changed}"


# ---- changes -------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_changes_roll_exactly_the_affected_roles(cluster, operator):
    h0 = template_hashes(cluster)
    # an engine-config change: prefill and decode read it, the router does not
    patch_pool(cluster, {"spec": {"engine": {"maxNumBatchedTokens": 1024}}})
    h1 = wait_for(lambda: (h := template_hashes(cluster)) and h["prefill"][0] != h0["prefill"][0]
                  and h["decode"][0] != h0["decode"][0] and h, 60, "prefill and decode templates")
    time.sleep(6)
    h1 = template_hashes(cluster)
    assert h1["router"] == h0["router"], "the router must not roll for an engine-only change"
    # a router change rolls only the router
    patch_pool(cluster, {"spec": {"router": {"routing": "least-loaded"}}})
    h2 = wait_for(lambda: (h := template_hashes(cluster)) and h["router"][0] != h1["router"][0] and h, 60,
                  "router template")
    time.sleep(6)
    h2 = template_hashes(cluster)
    assert h2["prefill"] == h1["prefill"] and h2["decode"] == h1["decode"]
    # a replicas change only scales: same template, so the same ReplicaSet
    rs_before = kget(cluster, "deployment", f"{POOL}-prefill", ns=NS)["spec"]["template"]
    patch_pool(cluster, {"spec": {"prefill": {"replicas": 2}}})
    wait_for(lambda: kget(cluster, "deployment", f"{POOL}-prefill", ns=NS)["spec"]["replicas"] == 2, 60, "scale")
    assert kget(cluster, "deployment", f"{POOL}-prefill", ns=NS)["spec"]["template"] == rs_before
    h3 = template_hashes(cluster)
    assert h3["decode"] == h2["decode"] and h3["router"] == h2["router"] and h3["prefill"][0] == h2["prefill"][0]
    # an image change rolls every role (they all run the image)
    patch_pool(cluster, {"spec": {"engine": {"image": "ghcr.io/tandem-fleet/tandem-worker:0.1.1"}}})
    wait_for(lambda: all(v[2].endswith(":0.1.1") for v in template_hashes(cluster).values()), 60, "image rolled")
    patch_pool(cluster, {"spec": {"prefill": {"replicas": 1}}})


# ---- apiserver restart ---------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_apiserver_restart_under_running_operator(cluster, operator):
    cluster.restart_apiserver()
    # a change made after the restart is reconciled by the same operator process
    pid = operator.pid()
    patch_pool(cluster, {"spec": {"router": {"replicas": 2}}})
    wait_for(lambda: kget(cluster, "deployment", f"{POOL}-router", ns=NS)["spec"]["replicas"] == 2, 120,
             "router scaled after apiserver restart")
    assert operator.pid() == pid, "the operator restarted instead of reconnecting"
    patch_pool(cluster, {"spec": {"router": {"replicas": 1}}})


# ---- Degraded when the webhook is absent ---------------------------------------------------------

@pytest.mark.timeout(240)
def test_reconciler_reports_invalid_spec_as_degraded(cluster, operator):
    ensure_ns(cluster, "bad")
    certs = lambda: set(Path(tempfile.gettempdir()).glob("tandem-webhook-*"))  # noqa: E731
    before = certs()   # the operator pod runs on this host, with its /tmp
    operator.scale(0)  # fail-open: the operator empties its webhooks when it stops
    # and it removes its serving certificate and private key (an earlier version left one per start)
    wait_for(lambda: certs() < before, 15, "the stopped operator's webhook certificate dir to be removed")
    d = base_manifest(ns="bad", name="twosources")
    d["spec"]["model"]["source"]["path"] = "/models/x"
    apply_yaml(cluster, d)  # only the schema stands: accepted
    operator.scale(1)

    def degraded():
        c = condition(pool_obj(cluster, "bad", "twosources") or {}, "Degraded")
        return c if c and c["status"] == "True" else None
    c = wait_for(degraded, 60, "Degraded condition")
    assert c["reason"] == "InvalidSpec" and "spec.model.source" in c["message"], c
    assert not children(cluster, "bad", "twosources"), "an invalid pool gets no children"
    cluster.kubectl("delete", "inferencepools.serving.tandem.dev", "twosources", "-n", "bad", "--wait=true",
                    "--timeout=30s")


# ---- ServiceMonitor and Gateway API Inference Extension InferencePool ---------------------------

@pytest.mark.timeout(240)
def test_optional_children_only_where_their_crds_exist(cluster, operator, helm_bin):
    ensure_ns(cluster, "gw")
    # No CRDs yet: a pool with an endpoint picker gets neither object (and no error).
    a = base_manifest(ns="gw", name="withepp")
    a["spec"]["prefill"]["replicas"] = 0
    a["spec"]["decode"]["replicas"] = 0
    a["spec"]["gateway"] = {"endpointPickerRef": {"name": "epp", "port": 9002}}
    apply_yaml(cluster, a)
    wait_for(lambda: kget(cluster, "deployment", "withepp-router", ns="gw"), 60, "children of withepp")
    cond = condition(wait_for(lambda: (p := pool_obj(cluster, "gw", "withepp")) and condition(p, "Degraded") and p,
                              60, "status"), "Degraded")
    assert cond["status"] == "False", cond
    cluster.kubectl("apply", "-f", str(ROOT / "tests/operator/standin_crds.yaml"))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s",
                    "crd/servicemonitors.monitoring.coreos.com", "crd/inferencepools.inference.networking.x-k8s.io")
    b = base_manifest(ns="gw", name="noepp")
    b["spec"]["prefill"]["replicas"] = 0
    b["spec"]["decode"]["replicas"] = 0
    apply_yaml(cluster, b)
    gie = wait_for(lambda: kget(cluster, "inferencepools.inference.networking.x-k8s.io", "withepp", ns="gw"), 90,
                   "GIE InferencePool")
    assert gie["spec"]["extensionRef"]["name"] == "epp"
    assert gie["spec"]["selector"] == {"serving.tandem.dev/pool": "withepp", "serving.tandem.dev/role": "router"}
    assert gie["spec"]["targetPortNumber"] == 8000
    wait_for(lambda: kget(cluster, "servicemonitors.monitoring.coreos.com", "withepp", ns="gw"), 60, "ServiceMonitor")
    wait_for(lambda: kget(cluster, "servicemonitors.monitoring.coreos.com", "noepp", ns="gw"), 60, "ServiceMonitor")
    time.sleep(6)
    assert kget(cluster, "inferencepools.inference.networking.x-k8s.io", "noepp", ns="gw") is None
    # removing the endpoint picker removes the GIE InferencePool
    patch_pool(cluster, {"spec": {"gateway": None}}, ns="gw", name="withepp")
    wait_for(lambda: kget(cluster, "inferencepools.inference.networking.x-k8s.io", "withepp", ns="gw") is None, 60,
             "GIE InferencePool removed")
    # the GA API (inference.networking.k8s.io/v1) is preferred where it is served
    cluster.kubectl("apply", "-f", str(ROOT / "tests/operator/standin_gie_v1.yaml"))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s",
                    "crd/inferencepools.inference.networking.k8s.io")
    patch_pool(cluster, {"spec": {"gateway": {"endpointPickerRef": {"name": "epp", "port": 9002}}}}, ns="gw",
               name="withepp")
    gie = wait_for(lambda: kget(cluster, "inferencepools.inference.networking.k8s.io", "withepp", ns="gw"), 90,
                   "GIE v1 InferencePool")
    assert gie["spec"]["selector"] == {"matchLabels": {"serving.tandem.dev/pool": "withepp",
                                                       "serving.tandem.dev/role": "router"}}, gie["spec"]
    assert gie["spec"]["targetPorts"] == [{"number": 8000}]
    assert gie["spec"]["endpointPickerRef"]["name"] == "epp" and gie["spec"]["endpointPickerRef"]["port"] == {
        "number": 9002}
    # a v1alpha2 object made while the v1 CRD was not yet seen (discovery is cached 10 s) is removed
    wait_for(lambda: kget(cluster, "inferencepools.inference.networking.x-k8s.io", "withepp", ns="gw") is None, 60,
             "no v1alpha2 twin")
    # with the CRD present, the chart's own ServiceMonitor also passes a server dry run
    r = cluster.kubectl("apply", "--dry-run=server", "-f", "-",
                        input=render_chart(helm_bin, "metrics.serviceMonitor.enabled=true"), check=False)
    assert r.returncode == 0, r.stderr


# ---- delete --------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_delete_with_operator_stopped_children_garbage_collected(cluster, operator):
    operator.scale(0)
    t0 = time.time()
    cluster.kubectl("delete", "inferencepools.serving.tandem.dev", POOL, "-n", NS, "--wait=true", "--timeout=30s")
    print(f"\n[delete] pool gone after {time.time() - t0:.1f}s with the operator stopped")
    wait_for(lambda: not children(cluster), 120, "children garbage-collected")
    wait_for(lambda: not json.loads(cluster.kubectl("get", "pods", "-n", NS, "-o", "json").stdout)["items"], 180,
             "pods gone")
    operator.scale(1)


# ---- RBAC: the audit log ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_operator_ran_under_chart_serviceaccount_without_403(cluster, operator):
    time.sleep(2)
    events = AuditLog(cluster).events()
    # a deleted pool's router Role or RoleBinding (named as the router's account) can be
    # garbage-collected while its router still runs (the delete test above); the router's requests
    # after that are refused by design, not for a missing rule (run 53 of the test command,
    # twenty-fifth session: three lists of EndpointSlices)
    rbac_gone = {}
    for ev in events:
        ref = ev.get("objectRef") or {}
        rbac = ref.get("apiGroup") == "rbac.authorization.k8s.io" and ref.get("resource") in ("roles", "rolebindings")
        if rbac and ev.get("verb") == "delete" and ev.get("responseStatus", {}).get("code") in (200, 202):
            rbac_gone.setdefault((ref.get("namespace"), ref.get("name")), ev["requestReceivedTimestamp"])
    total, forbidden, routers_403, after_delete = 0, [], [], 0
    for ev in events:
        user = ev.get("user", {}).get("username", "")
        code = ev.get("responseStatus", {}).get("code")
        if ev.get("annotations", {}).get("authorization.k8s.io/decision") == "allow":
            code = None   # RBAC allowed it; a 403 then is admission's (a ResourceQuota), not a missing rule
        if user == OPERATOR_SA:
            total += 1
            if code == 403:
                forbidden.append(f"{ev.get('verb')} {ev.get('requestURI')}")
        elif user.startswith("system:serviceaccount:") and user.endswith("-router") and code == 403:
            gone = rbac_gone.get(tuple(user.split(":")[2:4]))   # (namespace, the router's Role's name)
            if gone is None or _audit_time(ev["requestReceivedTimestamp"]) < _audit_time(gone):
                routers_403.append(f"{user} {ev.get('verb')} {ev.get('requestURI')}")
            else:
                after_delete += 1
    print(f"\n[rbac] {total} audited requests by {OPERATOR_SA}, {len(forbidden)} answered 403; "
          f"{after_delete} router requests refused after their pool's Role or RoleBinding was deleted")
    assert total > 100
    assert not forbidden, forbidden[:20]
    assert not routers_403, routers_403[:20]


def _audit_time(stamp: str) -> datetime.datetime:
    """An audit event's RFC 3339 timestamp (microseconds, ``Z``) as an aware datetime."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
