"""The autoscaler on the real kube-apiserver v1.20.2: the operator (the chart's Deployment, its own loop
outside Kopf) changes a pool's Deployment replicas per the policy.

STAND-IN: the pool's pods run the MOCK `tandem serve` (tests/operator/mock_bin/tandem, chosen by the
pool's image MOCK_IMAGE), whose /metrics this test scripts: the router's series are rendered by the
project's own router ``Metrics`` class (real exposition text) and POSTed to the router pod, as if real
requests had been served with the latencies the test picks. Real workers serve real requests in the
local-fleet test (tests/autoscaler/test_fleet_autoscaling.py).

The tests run in file order on one pool, like a session: scale up under a TPOT breach; an idle pool
drains down to min; advisory mode writes status only; vanished metrics hold the count; two operator
replicas with one Lease holder writing, then a takeover when it dies.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from operator_helpers import (MOCK_IMAGE, OPERATOR_NS, OPERATOR_SA, ROOT, AuditLog, apply_yaml, kget, wait_for)
from tandem.worker.api.metrics import Metrics

NS = "autoscale"
POOL = "scaled"
LEASE = "tandem-operator-autoscaler"
SLOW_TPOT, TARGET_TPOT = 0.3, 0.1


def manifest(mode: str = "active") -> dict:
    import yaml
    d = yaml.safe_load((ROOT / "examples/smollm2.yaml").read_text())
    d["metadata"].update(name=POOL, namespace=NS)
    s = d["spec"]
    s["engine"]["image"] = MOCK_IMAGE
    fast = {"scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 1, "periodSeconds": 4},
            "scaleDown": {"stabilizationWindowSeconds": 6, "maxStep": 1, "periodSeconds": 4}}
    s["prefill"] = {"resources": s["prefill"]["resources"], "autoscaling": {
        "enabled": True, "minReplicas": 1, "maxReplicas": 2, "target": {"metric": "ttft", "seconds": 1.0},
        "behavior": fast}}
    s["decode"] = {"resources": s["decode"]["resources"], "autoscaling": {
        "enabled": True, "minReplicas": 1, "maxReplicas": 3, "target": {"metric": "tpot", "seconds": TARGET_TPOT},
        "behavior": fast}}
    s["autoscaling"] = {"mode": mode}
    return d


class RouterScript:
    """Feeds the stand-in router's /metrics: every 0.5 s, ``rate`` requests per second finish with the
    TPOT (and remote-prefill TTFT) the test sets; ``rate = 0`` is an idle pool; ``broken`` serves text
    that is not Prometheus exposition (a failing scrape)."""

    def __init__(self, cluster):
        self.c, self.m = cluster, Metrics("router", POOL)
        self.rate, self.tpot, self.ttft, self.broken = 0.0, SLOW_TPOT, 0.2, False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _router_url(self) -> str | None:
        pods = kget(self.c, "pods", "-l", f"serving.tandem.dev/pool={POOL},serving.tandem.dev/role=router", ns=NS)
        ips = [p["status"].get("podIP") for p in (pods or {}).get("items", []) if p.get("status", {}).get("podIP")]
        return f"http://{ips[0]}:8000" if ips else None

    def _run(self) -> None:
        url, carry = None, 0.0
        while not self._stop.is_set():
            try:
                url = url or self._router_url()
                carry += self.rate * 0.5
                while carry >= 1:
                    carry -= 1
                    self.m.request_received(256)
                    self.m.routing.labels(**self.m.labels, decision="remote").inc()
                    self.m.observe_request(self.ttft, self.ttft + 31 * self.tpot, 32, prefill="remote")
                if url:
                    body = b"garbage {{ not exposition" if self.broken else self.m.render()
                    requests.post(url + "/mock/metrics", data=body, timeout=2)
            except Exception:  # noqa: BLE001 - the pod may be restarting; try again
                url = None
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def deployment_replicas(c, role: str) -> int:
    return kget(c, "deployment", f"{POOL}-{role}", ns=NS)["spec"]["replicas"]


def pool(c) -> dict:
    return kget(c, "inferencepools.serving.tandem.dev", POOL, ns=NS)


def decisions(c) -> list[dict]:
    return (pool(c).get("status") or {}).get("lastScalingDecisions") or []


def events(c, reason: str) -> list[dict]:
    doc = kget(c, "events", "--field-selector", f"involvedObject.name={POOL},reason={reason}", ns=NS)
    return (doc or {}).get("items", [])


def events_since(c, reason: str, seen: set[str]) -> list[dict]:
    return [e for e in events(c, reason) if e["metadata"]["name"] not in seen]


def pods(c, role: str) -> list[dict]:
    doc = kget(c, "pods", "-l", f"serving.tandem.dev/pool={POOL},serving.tandem.dev/role={role}", ns=NS)
    return [p for p in (doc or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]


def replica_writers(audit: AuditLog, since: int) -> list[str]:
    """userAgent of each write to the pool's Deployments by the operator (it names the replica)."""
    out = []
    for ev in audit.events(since, OPERATOR_SA):
        ref = ev.get("objectRef") or {}
        if (ev.get("verb") == "patch" and ref.get("resource") == "deployments" and ref.get("namespace") == NS
                and (ref.get("name") or "").startswith(POOL) and ev.get("responseStatus", {}).get("code") == 200):
            out.append(ev.get("userAgent", ""))
    return out


@pytest.fixture(scope="module")
def script(cluster, operator):
    cluster.kubectl("create", "namespace", NS, check=False)
    apply_yaml(cluster, manifest())
    wait_for(lambda: len([p for p in pods(cluster, "decode") if p.get("status", {}).get("podIP")]) == 1
             and pods(cluster, "router"), 120, "the pool's pods")
    s = RouterScript(cluster)
    yield s
    s.stop()
    cluster.kubectl("delete", "inferencepools.serving.tandem.dev", POOL, "-n", NS, "--wait=false", check=False)


@pytest.mark.timeout(240)
def test_a_tpot_breach_scales_decode_up_with_decisions_in_status_and_events(cluster, operator, script):
    script.rate, script.tpot = 4.0, SLOW_TPOT
    wait_for(lambda: deployment_replicas(cluster, "decode") >= 2, 120, "decode scaled up")
    ups = [d for d in decisions(cluster) if d["decode"]["desired"] > d["decode"]["current"]]
    assert ups, decisions(cluster)
    d = ups[0]
    assert d["acted"] and d["decode"]["signal"] == "ok"
    assert d["decode"]["observed"] > TARGET_TPOT * 1.5 and d["decode"]["reason"]
    assert d["prefill"]["desired"] == d["prefill"]["current"] == 1      # TTFT 0.2 s is far under its 1 s target
    ev = events(cluster, "ScaledUp")
    assert ev and "decode" in ev[0]["message"], ev
    st = pool(cluster)["status"]
    assert st["observed"]["tpotSeconds"] > TARGET_TPOT
    # the reconciler keeps the autoscaler's count (no fight): still there after a resync or two
    time.sleep(8)
    assert deployment_replicas(cluster, "decode") >= 2


@pytest.mark.timeout(240)
def test_an_idle_pool_with_working_metrics_drains_down_to_min(cluster, operator, script):
    wait_for(lambda: len([p for p in pods(cluster, "decode") if p["status"].get("podIP")]) >= 2, 60, "pods")
    busy = pods(cluster, "decode")[0]
    requests.post(f"http://{busy['status']['podIP']}:8000/mock/state", json={"in_flight": 3}, timeout=5)
    script.rate = 0.0
    wait_for(lambda: deployment_replicas(cluster, "decode") == 1 and len(pods(cluster, "decode")) == 1, 150,
             "decode down to min")
    drains = events(cluster, "Draining")
    assert drains, "no drain before the scale-down"
    drained = {m.split("draining pod ", 1)[1].split(" ", 1)[0] for m in (e["message"] for e in drains)}
    left = [p["metadata"]["name"] for p in pods(cluster, "decode")]
    assert busy["metadata"]["name"] not in drained                      # the least-loaded went, not the busy one
    assert not drained & set(left), (drained, left)                    # and the drained pods are the removed ones
    assert busy["metadata"]["name"] in left
    idle = [d for d in decisions(cluster) if d["decode"]["signal"] == "idle"]
    assert idle and idle[-1]["decode"]["desired"] >= 1
    requests.post(f"http://{busy['status']['podIP']}:8000/mock/state", json={"in_flight": 0}, timeout=5)


@pytest.mark.timeout(240)
def test_advisory_mode_writes_status_only(cluster, operator, script):
    audit = AuditLog(cluster)
    apply_yaml(cluster, manifest("advisory"))
    time.sleep(3)
    before = {r: deployment_replicas(cluster, r) for r in ("prefill", "decode")}
    m = audit.mark()
    m_events = {e["metadata"]["name"] for r in ("ScaledUp", "Draining") for e in events(cluster, r)}
    script.rate, script.tpot = 6.0, SLOW_TPOT * 2
    n0 = len(decisions(cluster))
    wait_for(lambda: any(not d["acted"] and d["advisory"] and d["decode"]["desired"] > d["decode"]["current"]
                         for d in decisions(cluster)), 90, "an advisory recommendation to scale up")
    time.sleep(6)
    assert {r: deployment_replicas(cluster, r) for r in ("prefill", "decode")} == before
    assert not replica_writers(audit, m)
    writes = {w.split()[1] for w in audit.writes(m, OPERATOR_SA, "inferencepools", POOL, NS)}
    assert writes <= {f"inferencepools/{POOL}/status"}, writes
    assert not events_since(cluster, "ScaledUp", m_events) and not events_since(cluster, "Draining", m_events)
    assert len(decisions(cluster)) >= min(n0 + 1, 10)
    apply_yaml(cluster, manifest("active"))


@pytest.mark.timeout(240)
def test_vanished_metrics_hold_the_count_never_below_min(cluster, operator, script):
    script.rate, script.tpot = 4.0, SLOW_TPOT
    wait_for(lambda: deployment_replicas(cluster, "decode") >= 2, 120, "decode scaled up again")
    script.broken = True              # the last good scrape stays usable until it is a window old
    wait_for(lambda: decisions(cluster)[-1]["decode"]["signal"] == "no_data", 60, "no_data seen")
    n = deployment_replicas(cluster, "decode")
    assert n >= 2
    t_end = time.time() + 20          # two windows of no data: held, neither up nor down
    while time.time() < t_end:
        assert deployment_replicas(cluster, "decode") == n
        time.sleep(1)
    script.broken = False


# Known failure, kept visible rather than hidden: in a clean-clone run of the whole suite the audit
# log showed replica writes from the replica that did not hold the Lease (it passed twice when run
# alone). Suspected cause: the reconciler's own resync loop, which Kopf's peering does not pause,
# writes a Deployment's replicas on the standby. Open in issue 11's note.
@pytest.mark.timeout(180)
def test_a_ttft_breach_with_decode_headroom_asks_the_router_to_absorb_bursts(cluster, operator, script):
    """Prefill over its TTFT target and short of replicas, decode well under its TPOT target: the
    decision asks for burst absorption, and the Lease holder tells the router pod (POST /absorb-bursts
    with the pool token, for a few ticks, renewed while the decision holds; 0 once it stops)."""
    url = script._router_url()
    script.rate, script.tpot, script.ttft = 4.0, SLOW_TPOT / 4, 3.0
    try:
        got = wait_for(lambda: [r for r in requests.get(url + "/mock/absorb", timeout=5).json()
                                if r.get("seconds", 0) > 0], 60, "an absorb-bursts push")
        assert all(r["token"] for r in got), got
        assert any(d.get("absorbBursts") for d in decisions(cluster)), decisions(cluster)[-3:]
    finally:
        script.ttft, script.rate = 0.2, 0.0
    wait_for(lambda: (requests.get(url + "/mock/absorb", timeout=5).json() or [{}])[-1].get("seconds") == 0,
             60, "the push that stops it")


@pytest.mark.timeout(300)
def test_two_operator_replicas_one_lease_holder_writes_and_a_takeover_follows_its_death(cluster, operator, script):
    """Protects: only the Lease holder writes replica counts, and when it dies without releasing the
    Lease another replica takes over (within the Lease time, not never). The takeover's bound is 60 s:
    the Lease is 8 s and renewed every 2 s (tests/operator/operator_helpers.py's chart values), so a
    takeover comes 8-10 s after the kill, up to about 20 s on a loaded 2-core machine where the
    Deployment's replacement pod wins the race; 60 s is 3x that and still tells a takeover from none."""
    audit = AuditLog(cluster)
    operator.scale(2, timeout=120)
    try:
        lease = wait_for(lambda: kget(cluster, "lease", LEASE, ns=OPERATOR_NS), 30, "the lease")
        holder = lease["spec"]["holderIdentity"]
        names = [p["metadata"]["name"] for p in operator.pods()]
        assert holder in names, (holder, names)
        m = audit.mark()
        script.rate = 0.0                           # idle: down to min, then a breach: up to max
        wait_for(lambda: deployment_replicas(cluster, "decode") == 1, 150, "decode down to min")
        script.rate, script.tpot = 4.0, SLOW_TPOT * 3
        wait_for(lambda: deployment_replicas(cluster, "decode") == 3, 120, "decode scaled to max")
        writers = replica_writers(audit, m)
        assert writers and set(writers) == {f"tandem-operator/{holder}"}, writers

        # the holder dies (SIGKILL: no release); the other replica takes over within the lease time
        d = next((cluster.dir / "pods").glob(f"{OPERATOR_NS}_{holder}_*"))
        os.killpg(int((d / "pid").read_text()), signal.SIGKILL)
        cluster.kubectl("delete", "pod", holder, "-n", OPERATOR_NS, "--grace-period=0", "--force", "--wait=false",
                        check=False)
        t_kill = time.time()
        # the standby normally takes over; the Deployment's replacement pod may win the race on a loaded
        # machine (its first read starts its own lease clock): either is a takeover, the dead one is not
        def new_holder():
            h = ((kget(cluster, "lease", LEASE, ns=OPERATOR_NS) or {}).get("spec") or {}).get("holderIdentity")
            return h if h and h != holder else None
        try:
            other = wait_for(new_holder, 90, "the takeover")
        except TimeoutError as e:
            pods_now = [(p["metadata"]["name"], p["status"].get("phase"), bool(p["metadata"].get("deletionTimestamp")))
                        for p in operator.pods()]
            raise AssertionError(f"{e}\nlease: {kget(cluster, 'lease', LEASE, ns=OPERATOR_NS)}\nkilled {holder}; "
                                 f"pods then: {names}; now: {pods_now}\n{operator.logs(tail=4000)}") from None
        took = time.time() - t_kill
        assert other in names or other in [p["metadata"]["name"] for p in operator.pods()], other
        # lease duration + renew period, 3x what a loaded machine takes (and a replacement pod's start,
        # if it won): see the docstring
        assert took < 3 * 20, took
        m2 = audit.mark()
        script.rate = 0.0                           # idle: the new holder scales down
        wait_for(lambda: deployment_replicas(cluster, "decode") < 3, 120, "a scale-down by the new holder")
        assert set(replica_writers(audit, m2)) == {f"tandem-operator/{other}"}
    finally:
        # straight from 2 to 1 would leave the webhook configuration emptied by the replica that stops
        # (the survivor does not write it again: see the report); a restart writes it
        operator.scale(0, timeout=120)
        operator.scale(1, timeout=120)
