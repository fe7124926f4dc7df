"""The operator's permissions (docs/security.md, "The operator's permissions"): the chart rendered by
helm and its RBAC rules read, then the same objects applied to the test cluster's real kube-apiserver
and asked with ``kubectl auth can-i --as`` what the operator's ServiceAccount may do.

- Webhook configurations: only the operator's own ValidatingWebhookConfiguration, by name, get and
  patch; nothing on any other, nothing on mutating ones, no create.
- With ``watchNamespaces`` the pool permissions (Secrets included) are a Role in each watched
  namespace; the ClusterRole keeps only cluster-scoped reads.
- Secrets: the pool rules create them and nothing else (each pool's secret is derived from the
  operator's key, operator/pool_key.py, so it is never read back); only in the operator's own
  namespace does it get two Secrets, by name (its webhook certificate and its pool key).
"""
import json

import pytest
import yaml

from operator_helpers import OPERATOR_NS, RELEASE, render_chart

pytestmark = pytest.mark.timeout(300)
NAMESPACED = ("pools-a", "pools-b")


def rbac(rendered: str) -> dict:
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    return {"docs": docs,
            "cluster": [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]],
            "roles": {(d["metadata"]["namespace"], d["metadata"]["name"]): d["rules"]
                      for d in docs if d["kind"] == "Role"}}


def grants(rules: list[dict], resource: str, verb: str, name: str | None = None) -> bool:
    for r in rules:
        if resource in r["resources"] or "*" in r["resources"]:
            if verb in r["verbs"] or "*" in r["verbs"]:
                names = r.get("resourceNames")
                if not names or name in names:
                    return True
    return False


def test_webhook_configurations_only_its_own_by_name(helm_bin):
    r = rbac(render_chart(helm_bin))
    rules = r["cluster"]
    own = f"{RELEASE}.serving.tandem.dev"   # the release is named as the chart: fullname = release
    assert own in {d["metadata"]["name"] for d in r["docs"] if d["kind"] == "ValidatingWebhookConfiguration"}
    assert not any(grants(rules, "mutatingwebhookconfigurations", v) for v in ("get", "create", "patch", "update",
                                                                                 "delete", "list"))
    vwc = [x for x in rules if "validatingwebhookconfigurations" in x["resources"]]
    assert vwc and all(x.get("resourceNames") == [own] and set(x["verbs"]) <= {"get", "patch"} for x in vwc), vwc
    assert not grants(rules, "validatingwebhookconfigurations", "create")
    assert not grants(rules, "validatingwebhookconfigurations", "patch", "someone-elses-policy")
    # no wildcard anywhere
    for x in rules + [x for rs in r["roles"].values() for x in rs]:
        assert "*" not in x["verbs"] and "*" not in x["resources"] and "*" not in x["apiGroups"], x


@pytest.mark.parametrize("watch", [False, True])
def test_secrets_are_only_created_never_read_outside_the_operators_namespace(helm_bin, watch):
    r = rbac(render_chart(helm_bin, *(["watchNamespaces={" + ",".join(NAMESPACED) + "}"] if watch else [])))
    pool_rules = r["cluster"] + [x for (ns, _), rs in r["roles"].items() if ns != OPERATOR_NS for x in rs]
    secret_rules = [x for x in pool_rules if "secrets" in x["resources"]]
    assert secret_rules if not watch else not [x for x in r["cluster"] if "secrets" in x["resources"]]
    for x in secret_rules:
        assert x["verbs"] == ["create"] and x["resources"] == ["secrets"], x
    for verb in ("get", "list", "watch", "patch", "update", "delete"):
        assert not grants(pool_rules, "secrets", verb, "anyones-secret"), verb
    own = r["roles"][(OPERATOR_NS, RELEASE)]
    assert grants(own, "secrets", "get", f"{RELEASE}-pool-key") and grants(own, "secrets", "get", f"{RELEASE}-webhook-cert")
    assert not grants(own, "secrets", "get", "another-secret") and not grants(own, "secrets", "list")
    # the operator is told where its key is
    dep, = [d for d in r["docs"] if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TANDEM_POOL_KEY_SECRET"] == f"{OPERATOR_NS}/{RELEASE}-pool-key"


def test_namespaced_mode_grants_pool_permissions_only_in_the_watched_namespaces(helm_bin):
    r = rbac(render_chart(helm_bin, "watchNamespaces={" + ",".join(NAMESPACED) + "}"))
    cluster = r["cluster"]
    for res in ("secrets", "deployments", "roles", "rolebindings", "serviceaccounts", "inferencepools", "pods",
                "clusterkopfpeerings"):
        for verb in ("get", "create", "patch", "list"):
            assert not grants(cluster, res, verb), (res, verb)
    for ns in NAMESPACED:
        rules = r["roles"][(ns, f"{RELEASE}-pools")]
        assert grants(rules, "secrets", "create") and grants(rules, "deployments", "patch")
        assert not grants(rules, "secrets", "get")
        assert grants(rules, "inferencepools", "watch") and grants(rules, "kopfpeerings", "patch")
    # nothing in any other namespace but the operator's own (its webhook certificate and Lease)
    assert {ns for ns, _ in r["roles"]} == {*NAMESPACED, OPERATOR_NS}
    assert not [d for d in r["docs"] if d["kind"] == "ClusterKopfPeering"]
    assert {d["metadata"]["namespace"] for d in r["docs"] if d["kind"] == "KopfPeering"} == set(NAMESPACED)


def can_i(cluster, sa: str, verb: str, what: str, ns: str | None = None) -> bool:
    args = ["auth", "can-i", verb, what, f"--as=system:serviceaccount:{OPERATOR_NS}:{sa}"]
    args += ["-n", ns] if ns else []
    out = cluster.kubectl(*args, check=False)
    return out.stdout.strip() == "yes"


def test_the_api_server_enforces_it(cluster, helm_bin):
    """The chart's RBAC objects, cluster-wide and namespaced, applied to the real API server (a release
    of their own, and only the RBAC objects: no operator runs for this, and the ServiceAccount need not
    exist for its name to be bound and impersonated), then asked what the ServiceAccount may do."""
    for ns in (*NAMESPACED, "elsewhere"):
        cluster.kubectl("create", "namespace", ns, check=False)
    kinds = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    # a release of its own (its ClusterRole must not be the operator fixture's)
    sets = ["fullnameOverride=rbac-check", "serviceAccount.name=rbac-check"]
    for extra in ([], ["watchNamespaces={" + ",".join(NAMESPACED) + "}"]):
        docs = [d for d in yaml.safe_load_all(render_chart(helm_bin, *sets, *extra))
                if d and d["kind"] in kinds and d["metadata"].get("namespace") != OPERATOR_NS]
        as_list = json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})   # one JSON document
        cluster.kubectl("apply", "-f", "-", input=as_list)
        own = "rbac-check.serving.tandem.dev"
        assert can_i(cluster, "rbac-check", "patch", f"validatingwebhookconfigurations/{own}")
        assert not can_i(cluster, "rbac-check", "patch", "validatingwebhookconfigurations/another-policy")
        assert not can_i(cluster, "rbac-check", "create", "validatingwebhookconfigurations")
        assert not can_i(cluster, "rbac-check", "patch", "mutatingwebhookconfigurations/anything")
        assert not can_i(cluster, "rbac-check", "create", "mutatingwebhookconfigurations")
        # Secrets: created where pools may be, never read, changed or deleted (cluster-wide mode too)
        pools_ns = NAMESPACED[0] if extra else "elsewhere"
        assert can_i(cluster, "rbac-check", "create", "secrets", pools_ns)
        for ns in (*NAMESPACED, "elsewhere", "kube-system"):
            for verb in ("get", "list", "watch", "patch", "update", "delete"):
                assert not can_i(cluster, "rbac-check", verb, "secrets", ns), (verb, ns)
            assert not can_i(cluster, "rbac-check", "get", "secrets/some-apps-credentials", ns), ns
        if extra:   # namespaced: no Secret, Deployment or Role outside the watched namespaces
            for ns in ("elsewhere", "kube-system"):
                assert not can_i(cluster, "rbac-check", "create", "secrets", ns), ns
                assert not can_i(cluster, "rbac-check", "patch", "deployments", ns), ns
                assert not can_i(cluster, "rbac-check", "create", "rolebindings", ns), ns
        # the next render replaces these objects; a ClusterRole keeps only what that render grants
        cluster.kubectl("delete", "-f", "-", input=as_list, check=False)
