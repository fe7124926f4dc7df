"""Unit tests of the pool's security objects (operator/security.py): the secret's mounts and digest,
the API keys' mount, the NetworkPolicies, and the hardening of every pod the operator makes. No cluster."""
from pathlib import Path

import pytest
import yaml

from tandem.operator import desired as D
from tandem.operator import security as SEC
from tandem.operator.spec import SpecError
from test_desired import pool   # the example pool with a namespace and uid, as test_desired builds it

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def deployments(objs):
    return {o["metadata"]["labels"][D.LABEL_ROLE]: o for o in objs if o["kind"] == "Deployment"}


def pod_templates(objs):
    """Every pod template among the objects (any kind with spec.template.spec)."""
    return [(o["kind"], o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objs
            if isinstance(o.get("spec"), dict) and isinstance(o["spec"].get("template"), dict)]


@pytest.mark.parametrize("path", ["examples/smollm2.yaml", "examples/llama3-8b-autoscaled.yaml"])
def test_every_pod_the_operator_makes_is_hardened(path):
    caps = D.Capabilities(service_monitor=True, gie_api_version="inference.networking.x-k8s.io/v1alpha2")
    objs = D.desired_objects(pool(path=path), caps, pool_secret_hash="h")
    tmpls = pod_templates(objs)
    assert len(tmpls) == 3
    for kind, name, spec in tmpls:
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["runAsNonRoot"] is True, name
        # a worker needs no API token; only the router (discovery) gets one
        assert spec.get("automountServiceAccountToken") is (None if name.endswith("-router") else False), name


def test_pool_secret_is_mounted_in_every_worker_the_token_key_alone_in_the_router_and_its_digest_rolls_them():
    p = pool()
    a = deployments(D.desired_objects(p, pool_secret_hash="aaaabbbbccccdddd"))
    b = deployments(D.desired_objects(p, pool_secret_hash="bbbbccccddddeeee"))
    for role, dep in a.items():
        tmpl = dep["spec"]["template"]
        c = tmpl["spec"]["containers"][0]
        vol = next(v for v in tmpl["spec"]["volumes"] if v["name"] == "pool-secret")
        assert vol["secret"]["secretName"] == "smollm2-pool-secret-aaaabbbbcc"
        assert vol["secret"]["defaultMode"] & 0o007 == 0, "others may not read the secret"
        # each role gets only the item it needs: the router never the secret itself (L13)
        item, mount, env = (("router-token", SEC.POOL_TOKEN_DIR, "TANDEM_POOL_TOKEN_KEY_FILE") if role == "router"
                            else ("secret", SEC.POOL_SECRET_DIR, "TANDEM_POOL_SECRET_FILE"))
        assert vol["secret"]["items"] == [{"key": item, "path": item}], role
        assert {"name": "pool-secret", "mountPath": mount, "readOnly": True} in c["volumeMounts"]
        assert {"name": env, "value": f"{mount}/{item}"} in c["env"]
        assert tmpl["metadata"]["annotations"][SEC.ANN_SECRET_HASH] == "aaaabbbbccccdddd"
        # a new secret (rotation) changes every role's pod template: each rolls
        assert b[role]["spec"]["template"] != tmpl
        assert b[role]["metadata"]["annotations"][D.ANN_DESIRED_HASH] != dep["metadata"]["annotations"][D.ANN_DESIRED_HASH]
        # the value itself is never in a pod template
        assert "secretKeyRef" not in str(tmpl)


def test_pool_secret_is_derived_from_the_operator_key_per_pool_and_rotates_with_it():
    import base64
    from tandem.operator import pool_key as PK
    from tandem.worker.api import auth
    k1, k2 = b"k" * 32, b"q" * 32
    p = pool()
    v = SEC.pool_secret_value(k1, p)
    assert v == SEC.pool_secret_value(k1, pool()) and len(v) == 43        # deterministic: nothing to read back
    assert v != SEC.pool_secret_value(k2, p)                                # a new operator key rotates it
    assert v != PK.pool_secret(k1, "other-ns", p.metadata.name, p.metadata.uid)
    assert v != PK.pool_secret(k1, p.metadata.namespace, p.metadata.name, "another-uid")   # same name, new pool
    assert v != SEC.pool_secret_value(k1, pool(lambda d: d["metadata"].setdefault("annotations", {}).update(
        {PK.ANN_ROTATE: "2"})))                                             # one pool rotated alone
    s = SEC.pool_secret_object(p, D._meta(p, "x"), v)
    digest = SEC.secret_hash(v)
    assert s["metadata"]["name"] == f"smollm2-pool-secret-{digest[:10]}"
    assert s["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert s["metadata"]["labels"][SEC.ANN_SECRET_HASH] == digest
    assert base64.b64decode(s["data"]["secret"]) == v and v.decode() not in digest
    token = bytes.fromhex(base64.b64decode(s["data"]["router-token"]).decode())
    assert token == auth.token_key(v) and v not in token


def test_api_keys_are_mounted_in_the_router_only():
    p = pool(lambda d: d["spec"]["router"].update(apiKeySecretRef={"name": "my-keys"}))
    deps = deployments(D.desired_objects(p, pool_secret_hash="h"))
    r = deps["router"]["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "my-keys", "defaultMode": 0o440}} in r["volumes"]
    assert {"name": "TANDEM_API_KEY_FILE", "value": SEC.API_KEYS_DIR} in r["containers"][0]["env"]
    for role in ("prefill", "decode"):
        assert "api-keys" not in str(deps[role]["spec"]["template"])
    # the key reference is part of the router's config: setting it rolls the router only
    before = deployments(D.desired_objects(pool(), pool_secret_hash="h"))
    for role in ("prefill", "decode"):
        assert before[role]["spec"]["template"] == deps[role]["spec"]["template"]


def test_network_policies_admit_only_the_pool():
    p = pool(lambda d: d["spec"].update(networkPolicy={
        "routerFrom": [{"namespaceSelector": {"team": "a"}}, {"ipBlock": "10.0.0.0/8"}],
        "workersFrom": [{"namespaceSelector": {"name": "monitoring"}, "podSelector": {"app": "prometheus"}}]}))
    objs = {(o["kind"], o["metadata"]["name"]): o for o in D.desired_objects(p)}
    workers, router = objs[("NetworkPolicy", "smollm2-workers")], objs[("NetworkPolicy", "smollm2-router")]
    for np in (workers, router):
        assert np["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    sel = workers["spec"]["podSelector"]
    assert sel["matchLabels"] == {D.LABEL_POOL: "smollm2"}
    assert sel["matchExpressions"] == [{"key": D.LABEL_ROLE, "operator": "In", "values": ["prefill", "decode"]}]
    pool_rule, others = workers["spec"]["ingress"]
    assert pool_rule["from"] == [{"podSelector": {"matchLabels": D.selector("smollm2", "router")}}, {"podSelector": sel}]
    assert {p["port"] for p in pool_rule["ports"]} == {8000, D.KV_PORT}
    assert [p["port"] for p in others["ports"]] == [8000]   # scrapers never reach the KV port
    assert {"namespaceSelector": {"matchLabels": {"name": "monitoring"}},
            "podSelector": {"matchLabels": {"app": "prometheus"}}} in others["from"]
    assert {"namespaceSelector": {}, "podSelector": {"matchLabels": SEC.OPERATOR_POD_LABELS}} in others["from"]
    assert router["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}],
                                          "from": [{"namespaceSelector": {"matchLabels": {"team": "a"}}},
                                                   {"ipBlock": {"cidr": "10.0.0.0/8"}}]}]
    # the default router policy admits anyone on the router's port only
    dflt = {o["metadata"]["name"]: o for o in D.desired_objects(pool()) if o["kind"] == "NetworkPolicy"}
    assert dflt["smollm2-router"]["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    # off by spec, or where the API has no NetworkPolicy: none
    off = pool(lambda d: d["spec"].update(networkPolicy={"enabled": False}))
    assert not [o for o in D.desired_objects(off) if o["kind"] == "NetworkPolicy"]
    assert not [o for o in D.desired_objects(pool(), D.Capabilities(network_policies=False))
                if o["kind"] == "NetworkPolicy"]


def test_a_policy_peer_is_selectors_or_an_ip_block():
    with pytest.raises(SpecError, match=r"spec.networkPolicy.routerFrom\[0\]"):
        pool(lambda d: d["spec"].update(networkPolicy={"routerFrom": [{"ipBlock": "10.0.0.0/8",
                                                                         "podSelector": {"a": "b"}}]}))
    with pytest.raises(SpecError, match=r"spec.networkPolicy.workersFrom\[0\]"):
        pool(lambda d: d["spec"].update(networkPolicy={"workersFrom": [{}]}))


def test_every_child_kind_has_an_api_path():
    from tandem.operator.kube import path_of
    caps = D.Capabilities(service_monitor=True, gie_api_version="inference.networking.x-k8s.io/v1alpha2")
    p = pool(path="examples/llama3-8b-autoscaled.yaml")
    for o in D.desired_objects(p, caps, pool_secret_hash="h") + [SEC.pool_secret_object(p, D._meta(p, "x"), b"v" * 43)]:
        assert path_of(o).endswith("/" + o["metadata"]["name"]), o["kind"]


def test_the_charts_operator_pod_is_hardened_and_its_webhook_fenced(helm_bin):
    from operator_helpers import render_chart
    docs = [d for d in yaml.safe_load_all(render_chart(helm_bin)) if d]
    dep, = [d for d in docs if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
    np, = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert np["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    webhook = next(r for r in np["spec"]["ingress"] if r["ports"][0]["port"] == 9443)
    assert webhook["from"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}]   # the values' default; narrowed per cluster


def test_the_operator_is_admitted_from_its_own_namespace_only():
    """Running in a pod (POD_NAMESPACE known), the operator's peer in the workers' policy names its
    namespace: a pod elsewhere that copies the operator's labels is not admitted (before the fix: any
    namespace, with a label anyone may put on a pod)."""
    p = pool()
    objs = {o["metadata"]["name"]: o for o in D.desired_objects(p, D.Capabilities(operator_namespace="tandem-system"))
            if o["kind"] == "NetworkPolicy"}
    _, others = objs["smollm2-workers"]["spec"]["ingress"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tandem-system"}},
            "podSelector": {"matchLabels": SEC.OPERATOR_POD_LABELS}} in others["from"]
    assert not any(f.get("namespaceSelector") == {} for f in others["from"])


def test_the_installation_allows_only_its_images_and_metrics_urls(monkeypatch, helm_bin):
    """The chart's allowlists reach the operator (env) and refuse, with the field named, a pool whose
    image or metrics URL is outside them (the webhook and the reconciler share this check); a prefix
    admits only at a boundary. Before the fix any image and any URL was taken."""
    import subprocess
    from tandem.operator import spec as S
    rendered = subprocess.run([helm_bin, "template", "t", str(Path(__file__).parents[2] / "charts/tandem-operator")],
                              check=True, capture_output=True, text=True).stdout
    default = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in default["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[S.ALLOWED_IMAGES_ENV] == "ghcr.io/tandem-fleet/" and env[S.ALLOWED_METRICS_URLS_ENV] == ""
    monkeypatch.setenv(S.ALLOWED_IMAGES_ENV, env[S.ALLOWED_IMAGES_ENV])
    monkeypatch.setenv(S.ALLOWED_METRICS_URLS_ENV, "http://prom.monitoring.svc:9090")
    pool()   # the example's image is the chart's own
    for image in ("evil.io/miner:1", "ghcr.io/tandem-fleetx/worker:1"):
        with pytest.raises(SpecError, match=r"spec.engine.image"):
            pool(lambda d: d["spec"].setdefault("engine", {}).update(image=image))
    ok = {"source": "prometheus", "url": "http://prom.monitoring.svc:9090/"}
    pool(lambda d: d["spec"].setdefault("autoscaling", {}).update(metrics=ok))
    for url in ("http://169.254.169.254/latest/meta-data", "http://prom.monitoring.svc:9090.evil.io/"):
        with pytest.raises(SpecError, match=r"spec.autoscaling.metrics.url"):
            pool(lambda d: d["spec"].setdefault("autoscaling", {}).update(metrics={"source": "prometheus", "url": url}))


def test_the_pools_egress_is_dns_the_pool_and_for_the_router_the_api_server():
    """Egress (M7): workers reach DNS and the pool's workers (decode -> prefill: HTTP for /health, the
    KV port); the router DNS, the workers' HTTP port and the API server (its discovery) at the
    installation's CIDRs, nothing else; spec.networkPolicy.egressTo adds destinations. Before the fix
    the policies had no egress rules (any destination)."""
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    caps = D.Capabilities(operator_namespace="tandem-system", api_server_cidrs=("10.96.0.1/32", "172.18.0.2/32"))
    objs = {o["metadata"]["name"]: o["spec"] for o in D.desired_objects(pool(), caps) if o["kind"] == "NetworkPolicy"}
    workers, router = objs["smollm2-workers"], objs["smollm2-router"]
    assert "Egress" in workers["policyTypes"] and "Egress" in router["policyTypes"]
    assert workers["egress"] == [dns, {"to": [{"podSelector": workers["podSelector"]}],
                                       "ports": [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": D.KV_PORT}]}]
    assert router["egress"] == [
        dns, {"to": [{"podSelector": workers["podSelector"]}], "ports": [{"protocol": "TCP", "port": 8000}]},
        {"to": [{"ipBlock": {"cidr": "10.96.0.1/32"}}, {"ipBlock": {"cidr": "172.18.0.2/32"}}],
         "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}]
    # every rule but DNS names its destinations
    assert all(r.get("to") for sp in (workers, router) for r in sp["egress"] if r is not dns and r != dns)
    # egressTo adds to both; an invalid peer is refused with its field
    extra = pool(lambda d: d["spec"].update(networkPolicy={"egressTo": [{"ipBlock": "10.9.0.0/16"}]}))
    for np in (o for o in D.desired_objects(extra) if o["kind"] == "NetworkPolicy"):
        assert np["spec"]["egress"][-1] == {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]}
    with pytest.raises(SpecError, match=r"spec.networkPolicy.egressTo\[0\]"):
        pool(lambda d: d["spec"].update(networkPolicy={"egressTo": [{}]}))


@pytest.mark.parametrize("watch", [False, True])
def test_the_charts_operator_policy_has_egress_to_dns_the_api_server_and_pool_pods_only(helm_bin, watch):
    from operator_helpers import render_chart
    sets = ["networkPolicy.apiServerCIDRs={10.0.0.1/32}"] + (["watchNamespaces={a,b}"] if watch else [])
    docs = [d for d in yaml.safe_load_all(render_chart(helm_bin, *sets)) if d]
    np, = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    dns, api, pods = np["spec"]["egress"]
    assert "to" not in dns and {p["port"] for p in dns["ports"]} == {53}
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}] and {p["port"] for p in api["ports"]} == {443, 6443}
    sel = {"matchExpressions": [{"key": "serving.tandem.dev/pool", "operator": "Exists"}]}
    want = ([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}, "podSelector": sel}
             for ns in ("a", "b")] if watch else [{"namespaceSelector": {}, "podSelector": sel}])
    assert pods["to"] == want and pods["ports"] == [{"protocol": "TCP", "port": 8000}]
    dep, = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TANDEM_API_SERVER_CIDRS"] == "10.0.0.1/32"   # the pools' routers get the same
