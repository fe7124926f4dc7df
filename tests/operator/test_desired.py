"""Unit tests of the pure spec -> children functions (no cluster)."""
import copy
from pathlib import Path

import pytest
import yaml

from tandem.operator import desired as D
from tandem.operator.spec import load_manifest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def pool(mutate=None, path="examples/smollm2.yaml"):
    d = yaml.safe_load((ROOT / path).read_text())
    d["metadata"].update(namespace="ns1", uid="u-1")
    if mutate:
        mutate(d)
    return load_manifest(d)


def by_key(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_children_and_owner_refs():
    objs = by_key(D.desired_objects(pool(), D.Capabilities(pdb_api_version="policy/v1beta1")))
    kinds = sorted(k for k, _ in objs)
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 3 and kinds.count("PodDisruptionBudget") == 3
    assert {("ConfigMap", "smollm2-config"), ("ServiceAccount", "smollm2-router"), ("Role", "smollm2-router"),
            ("RoleBinding", "smollm2-router")} <= set(objs)
    for o in objs.values():
        ref, = o["metadata"]["ownerReferences"]
        assert ref["uid"] == "u-1" and ref["controller"] is True and ref["kind"] == "InferencePool"
        assert o["metadata"]["namespace"] == "ns1"
    assert objs[("PodDisruptionBudget", "smollm2-decode")]["apiVersion"] == "policy/v1beta1"
    assert objs[("Service", "smollm2-prefill")]["spec"]["clusterIP"] == "None"
    dep = objs[("Deployment", "smollm2-decode")]["spec"]["template"]["spec"]
    c = dep["containers"][0]
    assert c["command"][:4] == ["tandem", "serve", "--role", "decode"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"] and dep["securityContext"]["runAsNonRoot"]
    assert "preStop" in c["lifecycle"] and dep["terminationGracePeriodSeconds"] > 100
    router = objs[("Deployment", "smollm2-router")]["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == "smollm2-router"
    cfg = yaml.safe_load(objs[("ConfigMap", "smollm2-config")]["data"]["router.yaml"])
    assert cfg["discovery"] == {"mode": "kubernetes", "namespace": "ns1", "prefillService": "smollm2-prefill",
                                "decodeService": "smollm2-decode", "port": 8000}


def test_optional_children_follow_capabilities():
    gw = "examples/llama3-8b-autoscaled.yaml"
    none = by_key(D.desired_objects(pool(path=gw)))
    assert not any(k in ("ServiceMonitor",) or (k == "InferencePool") for k, _ in none)
    caps = D.Capabilities(service_monitor=True, gie_api_version="inference.networking.x-k8s.io/v1alpha2")
    objs = by_key(D.desired_objects(pool(path=gw), caps))
    gie = objs[("InferencePool", "llama3-8b")]
    assert gie["spec"]["extensionRef"] == {"name": "epp", "portNumber": 9002, "failureMode": "FailClose"}
    assert gie["spec"]["selector"][D.LABEL_ROLE] == "router"
    assert ("ServiceMonitor", "llama3-8b") in objs
    # no endpoint picker named: no GIE InferencePool even where the CRD exists
    objs = by_key(D.desired_objects(pool(lambda d: d["spec"].pop("gateway"), path=gw), caps))
    assert ("InferencePool", "llama3-8b") not in objs


def _hashes(p):
    return {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"][D.ANN_CONFIG_HASH]
            for o in D.desired_objects(p) if o["kind"] == "Deployment"}


@pytest.mark.parametrize("mutate,rolled", [
    (lambda d: d["spec"]["engine"].update(maxNumBatchedTokens=1024), {"prefill", "decode"}),
    (lambda d: d["spec"]["router"].update(routing="least-loaded"), {"router"}),
    (lambda d: d["spec"]["engine"].update(blockSize=32), {"prefill", "decode", "router"}),
    (lambda d: d["spec"]["prefill"].update(replicas=3), set()),
])
def test_config_hash_rolls_exactly_affected_roles(mutate, rolled):
    before, after = _hashes(pool()), _hashes(pool(mutate))
    changed = {k.split("-", 1)[1] for k in before if before[k] != after[k]}
    assert changed == rolled


def test_autoscaled_replicas_are_clamped_current():
    p = pool(path="examples/llama3-8b-autoscaled.yaml")
    assert D.desired_replicas(p.spec.prefill, None) == 1
    assert D.desired_replicas(p.spec.prefill, 5) == 5
    assert D.desired_replicas(p.spec.prefill, 50) == 8
    assert D.desired_replicas(p.spec.decode, 0) == 1


def test_an_autoscaled_count_comes_from_the_object_compared():
    """A pass read the count (3), the autoscaler then scaled to 2: the pass must compare and apply with
    2, or it writes 3 back (the standby operator replica's replica write, issue 11)."""
    p = pool(path="examples/llama3-8b-autoscaled.yaml")
    want = by_key(D.desired_objects(p, D.Capabilities(), {"prefill": 3, "decode": 3}))
    dep = want[("Deployment", f"{p.metadata.name}-prefill")]
    have = copy.deepcopy(dep)
    have["spec"]["replicas"] = 2
    assert D.needs_apply(dep, have)                              # the bug: the old count differs
    fixed = D.with_observed_replicas(dep, p, have)
    assert fixed["spec"]["replicas"] == 2 and not D.needs_apply(fixed, have)
    assert dep["spec"]["replicas"] == 3                          # the cached desired object is untouched
    have["spec"]["replicas"] = 50                                # outside [min, max]: clamped
    assert D.with_observed_replicas(dep, p, have)["spec"]["replicas"] == 8
    assert D.with_observed_replicas(dep, p, None) is dep         # creation keeps the desired count
    router = want[("Deployment", f"{p.metadata.name}-router")]
    assert D.with_observed_replicas(router, p, copy.deepcopy(router)) is router


def test_needs_apply_compares_before_applying():
    want = D.desired_objects(pool())[0]
    have = copy.deepcopy(want)
    have["metadata"].update(resourceVersion="5", uid="x", managedFields=[])
    assert not D.needs_apply(want, have)
    have["data"]["prefill.yaml"] = "edited"
    assert D.needs_apply(want, have)
    assert D.needs_apply(want, None)


@pytest.mark.parametrize("size,seconds", [(None, 1260), ("16Gi", 1260), ("2Gi", 420), ("140Gi", 8700)])
def test_the_startup_probe_covers_the_models_size(size, seconds):
    """300 s plus 60 s per GiB of spec.model.size (16Gi when absent), for the workers only; the
    Deployment's progress deadline never runs out before the probe does."""
    def mutate(d):
        if size:
            d["spec"]["model"]["size"] = size
    objs = by_key(D.desired_objects(pool(mutate), D.Capabilities(pdb_api_version="policy/v1")))
    for role in ("prefill", "decode"):
        dep = objs[("Deployment", f"smollm2-{role}")]["spec"]
        probe = dep["template"]["spec"]["containers"][0]["startupProbe"]
        assert probe["httpGet"]["path"] == "/health"
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        assert seconds <= budget < seconds + probe["periodSeconds"]
        assert dep["progressDeadlineSeconds"] >= budget
    router = objs[("Deployment", "smollm2-router")]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert router["periodSeconds"] * router["failureThreshold"] == 600
