"""The chaos soak (``tandem bench chaos``, worker/bench/chaos.py) on Kubernetes: the test cluster
(scripts/cluster/: a real kube-apiserver v1.20.2, controller-manager, scheduler, and the node agent that
runs pods as processes in network namespaces), crds/ and the chart applied, the operator as the chart's
pod, and a SmolLM2 pool of real ``tandem serve`` pods: both roles autoscaled from ``--min-replicas``
(the operator's autoscaler, with the shipped calibration as its ``calibrationRef``), and 2 router
replicas. Root. Benchmark only (minutes to bring up); the CI soak runs on the local fleet
(tests/bench/test_chaos.py).

    PYTHONSAFEPATH=1 .venv/bin/python bench/chaos_kube.py examples/smollm2.yaml --duration 600 \\
        --fault-every 60 --load-fraction 0.1 --output-dir /tmp/chaos_kube --json

The same load, classes, JSON Lines and summary as the local target (:func:`tandem.worker.bench.chaos.soak`),
with these faults (``--faults``, default all of them):

- ``kill_decode`` / ``kill_prefill``: ``kill -9`` of a ready worker pod's process (the node agent
  restarts the container, restartPolicy Always, as a kubelet does);
- ``kill_router``: ``kill -9`` of one of the two router pods' process;
- ``stop_worker``: ``SIGSTOP`` of a worker pod's process for ``--stop-seconds``, then ``SIGCONT``;
- ``cut_kv``: the KV connections of every prefill pod destroyed (``ss -K`` inside each pod's network
  namespace) for ``--cut-seconds``;
- ``delete_operator``: the operator's pod deleted (its Deployment starts another);
- ``apiserver_outage``: the kube-apiserver stopped for ``--apiserver-down-seconds`` (30), then started;
- ``delete_worker_pod``: a ready prefill or decode pod deleted (its preStop drain, then a new pod).

Through the API-server outages the operator's autoscaler is watched (:class:`OperatorWatch`: its
``tandem:autoscaler_ticks_total{outcome}`` and ``tandem:autoscaler_scaling_actions_total``, scraped every
second at the operator pod's metrics port): the summary's ``apiserver_outages`` gives, per outage, the
ticks that decided and the scaling actions while the API server was down (aim 0: nothing decided on
stale data), the ticks that found it unavailable, and the seconds from its return to the first decision.

The client reaches the routers through a stand-in for kube-proxy (:class:`ServiceProxy`, on loopback):
each new connection goes to a router pod that accepts it, so a killed router's new connections go to the
other one; the cluster has no kube-proxy, and the chart's Service is the client's entry in production.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))
from operator_helpers import (OPERATOR_NS, Cluster, Operator, apply_yaml, condition,  # noqa: E402
                              install_operator, kget)

from tandem.worker.api import auth  # noqa: E402
from tandem.worker.api.names import KV_PORT, WORKER_PORT  # noqa: E402
from tandem.worker.bench import chaos as C  # noqa: E402

NS = "chaos"
POOL = "chaos"
KUBE_KINDS = C.FAULT_KINDS + ("delete_operator", "apiserver_outage", "delete_worker_pod")
#: the chart's autoscaler window as tests/operator renders it (operator_helpers.render_chart): the SLO
#: recovery's metric window
WINDOW_S = 10.0


def _ready(p: dict) -> bool:
    return not p["metadata"].get("deletionTimestamp") and bool((p.get("status") or {}).get("podIP")) and any(
        x.get("type") == "Ready" and x.get("status") == "True" for x in (p.get("status") or {}).get("conditions") or [])


def _restarts(p: dict) -> int:
    return sum(c.get("restartCount", 0) for c in (p.get("status") or {}).get("containerStatuses") or [])


class Pods:
    """The pool's pods, read every second on a thread of its own; the last good list is kept while the
    API server is down (as kube-proxy keeps its rules)."""

    def __init__(self, c: Cluster):
        self.c, self.items = c, []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.refresh()
        threading.Thread(target=self._run, daemon=True).start()

    def refresh(self) -> None:
        try:
            doc = kget(self.c, "pods", "-l", f"serving.tandem.dev/pool={POOL}", ns=NS)
        except RuntimeError:
            return
        with self.lock:
            self.items = (doc or {}).get("items", [])

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()

    def ready(self, role: str) -> list[dict]:
        with self.lock:
            return [p for p in self.items if p["metadata"]["labels"].get("serving.tandem.dev/role") == role
                    and _ready(p)]

    def all(self) -> list[dict]:
        with self.lock:
            return list(self.items)

    @staticmethod
    def url(p: dict) -> str:
        return f"http://{p['status']['podIP']}:{WORKER_PORT}"

    def pid(self, p: dict) -> int:
        """The pod's process (the node agent's ``pid`` file; ``ip netns exec`` keeps the PID)."""
        md = p["metadata"]
        return int((self.c.dir / "pods" / f"{NS}_{md['name']}_{md['uid'][:8]}" / "pid").read_text())

    def netns(self, p: dict) -> str:
        """The pod's network namespace (node_agent.PodRunner: one per pod IP's last octet)."""
        return f"tdm{self.c.subnet_index}p{p['status']['podIP'].rsplit('.', 1)[1]}"


class ServiceProxy:
    """A stand-in for kube-proxy (the cluster has none): a TCP listener on loopback that sends each new
    connection to one of ``backends()`` (host, port), round robin, skipping those that refuse it."""

    def __init__(self, backends):
        self.backends = backends
        self.port, self._n = _free_port(), 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        started.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        started.set()
        self.loop.run_forever()
        server.close()

    async def _handle(self, reader, writer) -> None:
        backs = list(self.backends())
        self._n += 1
        up = None
        for host, port in backs[self._n % max(1, len(backs)):] + backs[:self._n % max(1, len(backs))]:
            try:
                up = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
                break
            except (OSError, asyncio.TimeoutError):
                continue
        if up is None:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up[1]), self._pipe(up[0], writer))

    @staticmethod
    async def _pipe(src, dst) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            dst.close()

    def stop(self) -> None:
        async def shutdown():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KubeInjector:
    """Injects faults into the pool on the test cluster (module docstring); the interface of
    :class:`tandem.worker.bench.chaos.Injector`."""

    def __init__(self, c: Cluster, pods: Pods, seed: int = 0, stop_s: float = 20.0, cut_s: float = 3.0,
                 apiserver_down_s: float = 30.0, out=None):
        self.c, self.pods, self.rng = c, pods, random.Random(seed + 1)
        self.stop_s, self.cut_s, self.down_s, self.out = stop_s, cut_s, apiserver_down_s, out
        self.faults: list[C.Fault] = []
        self.names: dict[str, str] = {}
        self.operator = Operator(c)

    def note_names(self) -> None:
        for p in self.pods.all():
            if (p.get("status") or {}).get("podIP"):
                self.names[Pods.url(p)] = p["metadata"]["name"]

    def settled(self) -> bool:
        return all(f.until is not None for f in self.faults)

    def _log(self, msg: str) -> None:
        if self.out is not None:
            self.out.write(f"[chaos] {msg}\n")
            self.out.flush()

    def _until_back(self, f: C.Fault, role: str, before: int, restarts: int, timeout: float = 300.0) -> None:
        """``f.until``: when ``role`` has ``before`` ready pods again, counted from the moment the victim
        was seen not ready (its Ready condition lags the kill by a probe period and the pod list by a
        second: without this wait a restart would read as instant)."""
        t_end = time.monotonic() + timeout
        gone_by = time.monotonic() + 30
        while time.monotonic() < gone_by and any(
                p["metadata"]["name"] == f.target and _restarts(p) == restarts for p in self.pods.ready(role)):
            time.sleep(0.2)
        while time.monotonic() < t_end and len(self.pods.ready(role)) < before:
            time.sleep(0.5)
        f.until = time.time()
        self.note_names()

    def _victim(self, f: C.Fault, roles: tuple[str, ...]) -> dict | None:
        """A ready pod of one of ``roles`` whose role keeps another ready pod; None (noted) when none."""
        choices = [p for r in roles if len(self.pods.ready(r)) >= 2 for p in self.pods.ready(r)]
        if not choices:
            f.note, f.until = "skipped: no role with 2 ready pods", f.at
            return None
        p = self.rng.choice(choices)
        f.target, f.url = p["metadata"]["name"], Pods.url(p)
        return p

    def inject(self, kind: str) -> C.Fault:
        self.note_names()
        f = C.Fault(len(self.faults), kind, time.time())
        self.faults.append(f)
        if kind in ("kill_decode", "kill_prefill", "kill_router"):
            role = kind.split("_")[1]
            p = self._victim(f, (role,))
            if p is not None:
                before = len(self.pods.ready(role))
                os.kill(self.pods.pid(p), signal.SIGKILL)     # the node agent restarts the container
                threading.Thread(target=self._until_back, args=(f, role, before, _restarts(p)), daemon=True).start()
        elif kind == "stop_worker":
            p = self._victim(f, ("prefill", "decode"))
            if p is not None:
                pid = self.pods.pid(p)
                os.kill(pid, signal.SIGSTOP)

                def cont():
                    os.kill(pid, signal.SIGCONT)
                    f.until = time.time()
                threading.Timer(self.stop_s, cont).start()
        elif kind == "cut_kv":
            n, t_end = 0, time.monotonic() + self.cut_s
            prefill = self.pods.ready("prefill")
            f.target = "kv:" + ",".join(p["metadata"]["name"] for p in prefill)
            while time.monotonic() < t_end:
                for p in prefill:
                    r = subprocess.run(["ip", "netns", "exec", self.pods.netns(p), "ss", "-K", "-t", "-n", "-H",
                                        "state", "established", f"( sport = :{KV_PORT} or dport = :{KV_PORT} )"],
                                       capture_output=True, text=True, timeout=10)
                    n += sum(1 for line in r.stdout.splitlines() if line.strip())
                time.sleep(0.05)
            f.note, f.until = f"{n} socket(s) destroyed", time.time()
        elif kind == "delete_operator":
            pods = self.operator.pods()
            f.target = ",".join(p["metadata"]["name"] for p in pods)
            for p in pods:
                self.c.kubectl("delete", "pod", "-n", OPERATOR_NS, p["metadata"]["name"], "--wait=false")

            def back():
                t_end = time.monotonic() + 300
                while time.monotonic() < t_end:
                    try:
                        ps = [p for p in self.operator.pods() if p["metadata"]["name"] not in f.target.split(",")]
                    except RuntimeError:      # the API server is down (the next fault): ask again
                        ps = []
                    if any((p.get("status") or {}).get("phase") == "Running" for p in ps):
                        break
                    time.sleep(0.5)
                f.until = time.time()
            threading.Thread(target=back, daemon=True).start()
        elif kind == "apiserver_outage":
            f.target = "kube-apiserver"
            self.c.stop_apiserver()
            time.sleep(self.down_s)
            self.c.start_apiserver()
            f.until = time.time()
        elif kind == "delete_worker_pod":
            p = self._victim(f, ("prefill", "decode"))
            if p is not None:
                role = p["metadata"]["labels"]["serving.tandem.dev/role"]
                before = len(self.pods.ready(role))
                self.c.kubectl("delete", "pod", "-n", NS, p["metadata"]["name"], "--wait=false")
                threading.Thread(target=self._until_back, args=(f, role, before, _restarts(p)), daemon=True).start()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self._log(f"{kind} {f.target or ''} {f.note}")
        return f


class OperatorWatch:
    """The operator's autoscaler ticks, scraped every ``interval`` s from its pods' metrics ports (the
    last known pods are kept while the API server is down): ``samples`` of ``(unix time, pod name,
    {outcome: ticks}, scaling actions)``."""

    def __init__(self, c: Cluster, interval: float = 1.0):
        self.op, self.interval = Operator(c), interval
        self.samples: list[tuple[float, str, dict, float]] = []
        self._pods: list[tuple[str, str]] = []   # (name, metrics URL)
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _targets(self) -> list[tuple[str, str]]:
        try:
            pods = self.op.pods()
        except RuntimeError:   # the API server is down: the last known pods
            return self._pods
        out = []
        for p in pods:
            ip = (p.get("status") or {}).get("podIP")
            env = {e["name"]: e.get("value") for c in p["spec"]["containers"] for e in c.get("env") or []}
            port = env.get("TANDEM_METRICS_PORT") or "8080"
            if ip and port != "0":
                out.append((p["metadata"]["name"], f"http://{ip}:{port}/metrics"))
        self._pods = out
        return out

    def _run(self) -> None:
        import urllib.request
        from prometheus_client.parser import text_string_to_metric_families
        while not self._stop.wait(self.interval):
            for name, url in self._targets():
                try:
                    text = urllib.request.urlopen(url, timeout=2).read().decode()
                except OSError:
                    continue
                ticks, actions = {}, 0.0
                for fam in text_string_to_metric_families(text):
                    for smp in fam.samples:
                        if smp.name == "tandem:autoscaler_ticks_total":
                            ticks[smp.labels["outcome"]] = smp.value
                        elif smp.name == "tandem:autoscaler_scaling_actions_total":
                            actions += smp.value
                self.samples.append((time.time(), name, ticks, actions))

    def stop(self) -> None:
        self._stop.set()

    def outages(self, faults: list) -> list[dict]:
        return outage_rows(self.samples, faults)


def outage_rows(samples: list, faults: list, margin_s: float = 3.0) -> list[dict]:
    """From :class:`OperatorWatch` ``samples``, per ``apiserver_outage`` fault: over the scrapes from
    ``margin_s`` after the stop (a tick under way at the stop may end after it) to the start again, the
    ticks that decided, the ticks by outcome (``api_unavailable``; ``not_leader``: the Lease could not be
    renewed, so the replica stopped acting) and the scaling actions (summed over operator pods, each
    counter differenced from its own first scrape in the span); and the seconds from the start to the
    first scrape that shows a new decided tick."""
    out = []
    for f in faults:
        if f.kind != "apiserver_outage" or f.until is None:
            continue
        inside = [x for x in samples if f.at + margin_s <= x[0] <= f.until]
        row = {"fault": f.id, "down_s": round(f.until - f.at, 1), "scrapes": len(inside)}
        def delta(get) -> int:
            by_pod: dict[str, list[float]] = {}
            for x in inside:
                by_pod.setdefault(x[1], []).append(get(x))
            return int(sum(v[-1] - v[0] for v in by_pod.values()))
        row["decided_while_down"] = delta(lambda x: x[2].get("decided", 0.0))
        row["actions_while_down"] = delta(lambda x: x[3])
        outcomes = sorted({o for x in inside for o in x[2]} - {"decided"})
        row["ticks_while_down"] = {o: n for o in outcomes if (n := delta(lambda x, o=o: x[2].get(o, 0.0)))}
        last = {x[1]: x[2].get("decided", 0.0) for x in samples if x[0] <= f.until}
        first = next((x[0] for x in samples
                      if x[0] > f.until and x[2].get("decided", 0.0) > last.get(x[1], 0.0)), None)
        row["first_decision_after_s"] = None if first is None else round(first - f.until, 1)
        out.append(row)
    return out


def pool_manifest(cfg: C.ChaosConfig) -> list[dict]:
    """The calibration ConfigMap and the pool: ``cfg.manifest`` with both roles autoscaled
    (:func:`tandem.worker.bench.chaos.chaos_manifest`), 2 router replicas, the calibration as its
    ``calibrationRef``."""
    doc = yaml.safe_load(C.chaos_manifest(cfg.manifest, cfg.min_replicas, cfg.max_replicas, cfg.ttft_s, cfg.tpot_s,
                                          name=POOL).read_text())
    doc["metadata"]["namespace"] = NS
    doc["spec"]["router"]["replicas"] = 2
    doc["spec"].setdefault("autoscaling", {}).update(mode="active", calibrationRef={"configMap": "calibration"})
    cal = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "calibration", "namespace": NS},
           "data": {"calibration.yaml": Path(cfg.calibration).read_text()}}
    return [cal, doc]


def pool_secret(c: Cluster) -> bytes:
    """The pool's shared secret (the operator's ``<pool>-pool-secret-<hash>`` Secret): the client's pool
    token makes the router name the workers that served a request."""
    for s in (kget(c, "secrets", ns=NS) or {}).get("items", []):
        if s["metadata"]["name"].startswith(f"{POOL}-pool-secret-"):
            return base64.b64decode(s["data"]["secret"])
    raise RuntimeError(f"no {POOL}-pool-secret-* Secret in {NS}")


def run_kube_chaos(cfg: C.ChaosConfig, apiserver_down_s: float = 30.0, log=None) -> dict:
    """Bring the cluster, the operator and the pool up, run the soak, stop everything. Returns the
    summary (as :func:`tandem.worker.bench.chaos.soak`), plus ``operator_restarts`` (the operator pods'
    restartCount at the end: a crash loop while the API server was down shows here). The cluster's files
    are removed at the end unless ``TANDEM_KEEP_CLUSTER`` is set."""
    log = log or sys.stderr
    helm = subprocess.run(["bash", str(ROOT / "scripts/cluster/get_helm.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    cal, capacity, rate, dataset, schedule = C.plan(cfg)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-chaos-kube-"))
    log.write(f"[chaos] cluster files in {workdir}\n")
    try:
        return _run(cfg, apiserver_down_s, log, helm, workdir, capacity, rate, dataset, schedule)
    finally:
        if not os.environ.get("TANDEM_KEEP_CLUSTER"):
            shutil.rmtree(workdir, ignore_errors=True)


def _run(cfg, apiserver_down_s, log, helm, workdir, capacity, rate, dataset, schedule) -> dict:
    from tandem.worker.bench.client import Target
    with Cluster(workdir) as c:
        c.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        c.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/inferencepools.serving.tandem.dev",
                  "crd/clusterkopfpeerings.kopf.dev")
        t0 = time.monotonic()
        install_operator(c, helm)
        c.kubectl("create", "namespace", NS)
        for obj in pool_manifest(cfg):
            apply_yaml(c, obj)
        pods = Pods(c)
        want = {"prefill": cfg.min_replicas, "decode": cfg.min_replicas, "router": 2}
        t_end = time.monotonic() + 900
        while time.monotonic() < t_end:
            pool = kget(c, "inferencepools.serving.tandem.dev", POOL, ns=NS) or {}
            if all(len(pods.ready(r)) >= n for r, n in want.items()) and \
                    (condition(pool, "Ready") or {}).get("status") == "True":
                break
            time.sleep(2)
        else:
            raise RuntimeError(f"pool not ready in 900 s; pods: {[p['metadata']['name'] for p in pods.all()]}")
        log.write(f"[chaos] pool ready {time.monotonic() - t0:.0f} s after the operator's install\n")
        secret = pool_secret(c)
        proxy = ServiceProxy(lambda: [(p["status"]["podIP"], WORKER_PORT) for p in pods.ready("router")])
        injector = KubeInjector(c, pods, cfg.seed, cfg.stop_s, cfg.cut_s, apiserver_down_s, out=log)
        watch = OperatorWatch(c)
        target = Target(proxy.url, doc_model(cfg), "completions", timeout=cfg.deadline_s,
                        headers=lambda: auth.pool_headers(secret), resend_s=cfg.deadline_s)

        def idle():
            def rows():
                return [C.idle_row(p["metadata"]["name"], Pods.url(p)) for r in ("prefill", "decode")
                        for p in pods.ready(r)]
            return C.wait_idle(rows)
        try:
            s = C.soak(cfg, target, injector, dataset, schedule, rate, capacity, idle, log)
            op = Operator(c).pods()
            s["operator_restarts"] = sum(cs.get("restartCount", 0) for p in op
                                         for cs in (p.get("status") or {}).get("containerStatuses") or [])
            s["replicas_at_end"] = {r: len(pods.ready(r)) for r in ("prefill", "decode", "router")}
            s["apiserver_outages"] = watch.outages(injector.faults)
            if cfg.output_dir:
                out = {k: v for k, v in s.items() if k != "records"}
                (Path(cfg.output_dir) / "summary.json").write_text(json.dumps(out, indent=1))
            return s
        finally:
            watch.stop()
            proxy.stop()
            pods.stop()


def outage_table(rows: list[dict]) -> str:
    """The autoscaler through the API-server outages, as a Markdown table (bench/RESULTS.md)."""
    head = ["| fault | down (s) | operator scrapes while down | ticks that decided while down (aim 0) | "
            "scaling actions while down (aim 0) | other ticks while down, by outcome | "
            "first decision after it was back (s) |", "|---|---|---|---|---|---|---|"]
    return "\n".join(head + [f"| {r['fault']} | {r['down_s']} | {r['scrapes']} | {r['decided_while_down']} | "
                             f"{r['actions_while_down']} | "
                             f"{', '.join(f'{k} {v}' for k, v in r['ticks_while_down'].items()) or 'none'} | "
                             f"{r['first_decision_after_s']} |" for r in rows])


def doc_model(cfg: C.ChaosConfig) -> str:
    return yaml.safe_load(Path(cfg.manifest).read_text())["spec"]["model"]["name"]


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the cluster (by PID) on SIGTERM too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_chaos_args(ap, KUBE_KINDS)
    ap.add_argument("--apiserver-down-seconds", type=float, default=30.0)
    a = ap.parse_args()
    cfg = C.config_from_args(a, KUBE_KINDS, autoscale_window_s=WINDOW_S, autoscale_interval_s=2.0)
    if cfg is None:
        return 2
    s = run_kube_chaos(cfg, a.apiserver_down_seconds)
    print(f"operator restarts: {s['operator_restarts']}; ready pods at the end: {s['replicas_at_end']}")
    print(outage_table(s["apiserver_outages"]))
    return C.report(s, a.json)


if __name__ == "__main__":
    sys.exit(main())
