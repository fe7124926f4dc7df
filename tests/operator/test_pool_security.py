"""The pool's security objects on a real kube-apiserver v1.20.2, made by the operator running as the
chart's Deployment (tests/operator/conftest.py): the per-pool Secret and the NetworkPolicies exist with
owner references, the workers' pods mount the secret and the router's its token key alone (and the API
keys), the operator never reads it back (its pool rules only create Secrets), a deleted Secret is made
again with the same value, and rotating the pool's secret makes a new Secret and rolls the pods. (NetworkPolicies are stored, not enforced: the test
cluster has no network plugin; docs/security.md.)"""
from __future__ import annotations

import base64
import hashlib
import json

import pytest

import yaml

from operator_helpers import ROOT, apply_yaml, kget, wait_for

NS = "sec"
POOL = "guarded"


def owned_by(obj: dict, uid: str) -> bool:
    return any(r.get("uid") == uid and r.get("controller") for r in obj["metadata"].get("ownerReferences", []))


def digest(secret: dict) -> str:
    return hashlib.sha256(base64.b64decode(secret["data"]["secret"])).hexdigest()[:16]


def pool_secrets(cluster) -> list[dict]:
    return json.loads(cluster.kubectl("get", "secrets", "-n", NS, "-l", f"serving.tandem.dev/pool={POOL}",
                                      "-o", "json").stdout)["items"]


def pods(cluster) -> list[dict]:
    return json.loads(cluster.kubectl("get", "pods", "-n", NS, "-l", f"serving.tandem.dev/pool={POOL}",
                                      "-o", "json").stdout)["items"]


@pytest.mark.timeout(420)
def test_pool_secret_network_policies_and_rotation(cluster, operator):
    from tandem.worker.api import auth
    cluster.kubectl("create", "namespace", NS, check=False)
    keys = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "guarded-keys", "namespace": NS},
            "stringData": {"ops": "sk-ops-0123456789"}}
    apply_yaml(cluster, keys)
    d = yaml.safe_load((ROOT / "examples/smollm2.yaml").read_text())
    d["metadata"].update(name=POOL, namespace=NS)
    d["spec"]["prefill"]["replicas"] = 0   # the router's pods show the mounts; no model load needed here
    d["spec"]["decode"]["replicas"] = 0
    d["spec"]["router"]["apiKeySecretRef"] = {"name": "guarded-keys"}
    apply_yaml(cluster, d)
    uid = wait_for(lambda: kget(cluster, "inferencepools.serving.tandem.dev", POOL, ns=NS), 30, "pool")["metadata"]["uid"]

    secret, = wait_for(lambda: pool_secrets(cluster), 60, "pool secret")
    name = secret["metadata"]["name"]
    assert name == f"{POOL}-pool-secret-{digest(secret)[:10]}" and owned_by(secret, uid), secret["metadata"]
    assert len(base64.b64decode(secret["data"]["secret"])) >= 32
    token_key = bytes.fromhex(base64.b64decode(secret["data"]["router-token"]).decode())
    assert token_key == auth.token_key(base64.b64decode(secret["data"]["secret"]))
    # the operator's key, in its own namespace, made by the operator itself
    assert kget(cluster, "secret", "tandem-operator-pool-key", ns="tandem-system") is not None
    for np_name in (f"{POOL}-workers", f"{POOL}-router"):
        np = wait_for(lambda: kget(cluster, "networkpolicy", np_name, ns=NS), 60, np_name)
        assert owned_by(np, uid), np_name
    workers = kget(cluster, "networkpolicy", f"{POOL}-workers", ns=NS)["spec"]
    assert {p["port"] for p in workers["ingress"][0]["ports"]} == {8000, 8001}

    def templates() -> dict:
        out = {}
        for role in ("prefill", "decode", "router"):
            dep = kget(cluster, "deployment", f"{POOL}-{role}", ns=NS)
            if dep is None:
                return {}
            out[role] = dep["spec"]["template"]
        return out
    tmpls = wait_for(lambda: (t := templates()) and len(t) == 3 and t, 60, "deployments")
    for role, t in tmpls.items():
        assert t["metadata"]["annotations"]["serving.tandem.dev/pool-secret-hash"] == digest(secret), role
        vols = {v["name"]: v for v in t["spec"]["volumes"]}
        assert vols["pool-secret"]["secret"]["secretName"] == name, role
        item = "router-token" if role == "router" else "secret"
        assert vols["pool-secret"]["secret"]["items"] == [{"key": item, "path": item}], role
        assert ("api-keys" in vols) == (role == "router"), role
    # the router's pod mounts its token key and the API keys, and runs hardened
    pod = wait_for(lambda: (ps := pods(cluster)) and ps[0], 60, "router pod")
    vols = {v["name"]: v.get("secret", {}).get("secretName") for v in pod["spec"]["volumes"]}
    assert vols["pool-secret"] == name and vols["api-keys"] == "guarded-keys"
    c = pod["spec"]["containers"][0]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/var/run/tandem/pool-token", "/var/run/tandem/api-keys"}
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    old_rs = {rs["metadata"]["name"] for rs in json.loads(cluster.kubectl(
        "get", "rs", "-n", NS, "-l", f"serving.tandem.dev/pool={POOL}", "-o", "json").stdout)["items"]}

    # a deleted Secret is made again, with the same value (derived, so nothing rolls)
    cluster.kubectl("delete", "secret", name, "-n", NS)
    again = wait_for(lambda: (s := kget(cluster, "secret", name, ns=NS))
                     and s["metadata"]["uid"] != secret["metadata"]["uid"] and s, 60, "the pool secret made again")
    assert again["data"] == secret["data"] and owned_by(again, uid)

    # rotation of this pool alone: its annotation; a new Secret (a new name) and every role rolls
    cluster.kubectl("annotate", "inferencepools.serving.tandem.dev", POOL, "-n", NS,
                    "serving.tandem.dev/rotate-pool-secret=2")
    new = wait_for(lambda: [s for s in pool_secrets(cluster) if s["metadata"]["name"] != name], 60,
                   "a new pool secret")[0]
    assert owned_by(new, uid) and new["data"]["secret"] != secret["data"]["secret"]
    assert new["metadata"]["name"] == f"{POOL}-pool-secret-{digest(new)[:10]}"
    wait_for(lambda: (t := templates()) and all(
        x["metadata"]["annotations"]["serving.tandem.dev/pool-secret-hash"] == digest(new) for x in t.values()),
        60, "pod templates with the new secret's digest")

    def rolled() -> bool:
        items = json.loads(cluster.kubectl("get", "rs", "-n", NS, "-l", f"serving.tandem.dev/pool={POOL}",
                                           "-o", "json").stdout)["items"]
        fresh = [rs for rs in items if rs["metadata"]["name"] not in old_rs]
        roles = {rs["metadata"]["labels"]["serving.tandem.dev/role"] for rs in fresh}
        return roles == {"prefill", "decode", "router"} and all(
            rs["spec"]["template"]["metadata"]["annotations"]["serving.tandem.dev/pool-secret-hash"] == digest(new)
            for rs in fresh)
    wait_for(rolled, 60, "a new ReplicaSet (pod-template hash) per role")
    wait_for(lambda: any(p["metadata"]["annotations"].get("serving.tandem.dev/pool-secret-hash") == digest(new)
                         for p in pods(cluster)), 60, "a router pod of the new template")
    cluster.kubectl("delete", "inferencepools.serving.tandem.dev", POOL, "-n", NS, "--wait=true", "--timeout=30s")
    wait_for(lambda: not pool_secrets(cluster), 120, "the pool's Secrets garbage-collected with their pool")


@pytest.mark.timeout(120)
def test_the_operator_key_is_made_once_shared_and_rotated_by_deletion(cluster):
    """The operator's pool key on the real API server (pool_key.PoolKey, a short re-read interval
    here): the first reader makes it, a second replica reads the same, and deleting it makes a new
    one at the next read: every pool's derived secret then changes (the rotation of every pool)."""
    import time
    from kubernetes import config
    from tandem.operator.kube import Kube
    from tandem.operator.pool_key import PoolKey, pool_secret
    kube = Kube(config.new_client_from_config(str(cluster.kubeconfig)))
    ns = "pool-key-check"
    cluster.kubectl("create", "namespace", ns, check=False)
    env = {"TANDEM_POOL_KEY_SECRET": f"{ns}/the-key"}
    a, b = PoolKey(kube, env, ttl=0.3), PoolKey(kube, env, ttl=0.3)
    first = a.key()
    assert len(first) == 32 and b.key() == first
    stored = kget(cluster, "secret", "the-key", ns=ns)
    assert base64.b64decode(stored["data"]["key"]) == first
    cluster.kubectl("delete", "secret", "the-key", "-n", ns)
    time.sleep(0.4)
    second = a.key()
    assert second != first and len(second) == 32
    time.sleep(0.4)
    assert b.key() == second   # the other replica follows at its next read
    assert pool_secret(first, "ns", "p", "uid") != pool_secret(second, "ns", "p", "uid")
