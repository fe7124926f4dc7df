"""Thin Kopf handlers and the operator's one reconcile loop. The work is in reconcile.py (sync, run in
a thread) and desired.py (pure).

- create / update / resume of an InferencePool and events of child Deployments only name the pool to
  the loop: every pass runs in that one loop, so a pool seen by Kopf and by the loop's first listing
  at start is applied once (one reconcile per change).
- The loop also runs a pass for every pool every TANDEM_RESYNC_SECONDS: it refreshes status (pods
  included) and repairs drift. It is not paused by Kopf peering (Kopf has no public hook for that); a
  standby replica computes the same desired objects and, comparing before applying, writes nothing.
- Transient API errors back off per pool (5 s doubling to 300 s); a child refused as invalid parks
  the pool until its generation changes (see reconcile.py).
- No delete handler and no Kopf timer or daemon: both would make Kopf add a finalizer, and deleting a
  pool would then hang while the operator is down. Deletion is left to owner references.
- A validating admission webhook (`check-pool`) enforces the rules of spec.py and the pool's name;
  its configuration is written here (webhook.ManagedConfiguration), fail-open with a 5 s timeout.

Configuration is by environment (the chart sets it; `python -m tandem.operator --help` maps flags):
TANDEM_WEBHOOK (service|url|off), TANDEM_WEBHOOK_LISTEN (addr:port), TANDEM_WEBHOOK_SERVICE
(namespace/name:port), TANDEM_WEBHOOK_HOST (url mode), TANDEM_WEBHOOK_SECRET (namespace/name),
TANDEM_WEBHOOK_CONFIG (name of the managed ValidatingWebhookConfiguration), TANDEM_RESYNC_SECONDS,
TANDEM_METRICS_PORT, TANDEM_NAMESPACES (comma list; empty = all); the autoscaler's loop (autoscaler/
kube_loop.py, outside Kopf: it acts only while holding a Lease): TANDEM_AUTOSCALER (on|off),
TANDEM_AUTOSCALER_INTERVAL_SECONDS, TANDEM_AUTOSCALER_WINDOW_SECONDS, TANDEM_AUTOSCALER_LEASE
(namespace/name), POD_NAME (the Lease holder's identity).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import shutil
import tempfile
import time
from typing import Any, Optional

import kopf

from . import spec as S
from .kube import Kube, KubeError
from .reconcile import Reconciler, list_pools

log = logging.getLogger("tandem.operator")

STATE: dict[str, Any] = {}


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def _plain(body: Any) -> dict:
    """A Kopf Body (a read-only mapping view) as a plain dict."""
    if isinstance(body, dict):
        return body
    return {k: (_plain(v) if hasattr(v, "keys") else v) for k, v in body.items()}


def reconciler() -> Reconciler:
    r = STATE.get("reconciler")
    if r is None:
        r = STATE["reconciler"] = Reconciler(Kube())
    return r


def _metrics():
    return STATE.get("metrics")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger, **_):
    # Progress and diff-base in annotations under our own prefix; nothing in status.kopf.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="serving.tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="serving.tandem.dev", key="last-handled-configuration")
    settings.persistence.finalizer = "serving.tandem.dev/operator"  # never added: no delete handler
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 10
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 30
    settings.networking.error_backoffs = [1, 2, 4, 8, 16]
    settings.execution.max_workers = int(_env("TANDEM_WORKERS", "8"))
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]
    mode = _env("TANDEM_WEBHOOK", "off")
    if mode != "off":
        from .webhook import ServiceWebhookServer, ensure_certs
        listen = _env("TANDEM_WEBHOOK_LISTEN", "0.0.0.0:9443")
        addr, port = listen.rsplit(":", 1)
        hosts: list[str] = []
        svc = _env("TANDEM_WEBHOOK_SERVICE")
        if svc:
            sns, rest = svc.split("/", 1)
            sname, _, sport = rest.partition(":")
            hosts += [f"{sname}.{sns}.svc", f"{sname}.{sns}.svc.cluster.local", f"{sname}.{sns}", sname]
        host = _env("TANDEM_WEBHOOK_HOST")
        if host:
            hosts.append(host)
        if addr not in ("0.0.0.0", "::", ""):
            hosts.append(addr)
        secret = _env("TANDEM_WEBHOOK_SECRET")
        # the serving certificate and its private key: removed at cleanup (the server has loaded them)
        certdir = STATE["certdir"] = tempfile.mkdtemp(prefix="tandem-webhook-")
        ca, crt, key = await asyncio.to_thread(
            ensure_certs, certdir, hosts, Kube() if secret else None,
            tuple(secret.split("/", 1)) if secret else None)
        common = dict(addr=addr, port=int(port), certfile=str(crt), pkeyfile=str(key), cafile=str(ca))
        if mode == "service":
            server = ServiceWebhookServer(
                service_namespace=sns, service_name=sname, service_port=int(sport or 443), **common)
        else:
            server = kopf.WebhookServer(host=host or addr, **common)
        # Not Kopf's managed configuration (it hard-codes timeoutSeconds: 30): ours is fail-open with a
        # short timeout, so a hung operator delays an apply by seconds and never blocks it.
        from .webhook import ManagedConfiguration
        settings.admission.server = ManagedConfiguration(
            server, _env("TANDEM_WEBHOOK_CONFIG", "tandem-operator.serving.tandem.dev"), WEBHOOK_ID)
        settings.admission.managed = None
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # a line per admission request
    logging.getLogger("kopf.objects").addFilter(_RefusalAtInfo())
    port = int(_env("TANDEM_METRICS_PORT", "0") or 0)
    if port:
        from . import metrics
        STATE["metrics"] = metrics.start(port)
    STATE["reconciler"] = Reconciler(Kube())
    STATE["resync_task"] = asyncio.create_task(_resync_loop(float(_env("TANDEM_RESYNC_SECONDS", "10"))))
    if _env("TANDEM_AUTOSCALER", "on") != "off":
        STATE["autoscaler_task"] = asyncio.create_task(_autoscaler_loop())


@kopf.on.cleanup()
async def cleanup(**_):
    for name in ("resync_task", "autoscaler_task"):
        t = STATE.pop(name, None)
        if t is not None:
            t.cancel()
    auto = STATE.pop("autoscaler", None)
    if auto is not None:
        await asyncio.to_thread(auto.stop)
    certdir = STATE.pop("certdir", None)
    if certdir:
        shutil.rmtree(certdir, ignore_errors=True)


async def _autoscaler_loop() -> None:
    """The autoscaler's ticks (autoscaler/kube_loop.py), in a thread each, on the Lease holder only."""
    import socket

    from .autoscaler.kube_loop import KubeAutoscaler
    from .autoscaler.lease import LeaderLease
    interval = float(_env("TANDEM_AUTOSCALER_INTERVAL_SECONDS", "5"))
    lease_ns, _, lease_name = _env("TANDEM_AUTOSCALER_LEASE", "").partition("/")
    kube = Kube()
    lease = LeaderLease(kube, lease_ns or _env("POD_NAMESPACE", "default"), lease_name or "tandem-operator-autoscaler",
                        _env("POD_NAME") or socket.gethostname(),
                        duration_s=float(_env("TANDEM_AUTOSCALER_LEASE_SECONDS", "15")),
                        renew_s=min(interval, 5.0))
    auto = STATE["autoscaler"] = KubeAutoscaler(
        kube, lease, events=reconciler().event, metrics=_metrics(),
        namespaces=[n for n in _env("TANDEM_NAMESPACES").split(",") if n],
        window_s=float(_env("TANDEM_AUTOSCALER_WINDOW_SECONDS", "30")), interval_s=interval)
    # its own thread, not the loop's default executor: the reconcile pass shares that one, and a Lease
    # attempt queued behind slow API calls there would let a standby miss its takeover (client-go runs
    # leader election on its own goroutine for the same reason)
    own = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoscaler")
    loop = asyncio.get_running_loop()
    try:
        while True:
            t0 = time.monotonic()
            try:
                await loop.run_in_executor(own, auto.tick)
            except Exception:  # noqa: BLE001 - nothing stops the loop
                log.exception("autoscaler tick failed")
            await asyncio.sleep(max(0.5, interval - (time.monotonic() - t0)))
    finally:
        own.shutdown(wait=False)


def _enqueue(body: Any) -> None:
    """Hand a pool to the reconcile loop. Kopf's handlers only enqueue: a single loop runs every pass,
    so a pool found by both Kopf (create/resume) and the loop's first listing is applied once."""
    md = body.get("metadata", {})
    STATE.setdefault("pending", set()).add((md.get("namespace") or "default", md["name"]))
    ev = STATE.get("wake")
    if ev is not None:
        ev.set()


@kopf.on.create(S.GROUP, S.VERSION, S.PLURAL)
async def on_create(body, **_):
    _enqueue(body)


@kopf.on.update(S.GROUP, S.VERSION, S.PLURAL, field="spec")
async def on_update(body, **_):
    _enqueue(body)


@kopf.on.resume(S.GROUP, S.VERSION, S.PLURAL)
async def on_resume(body, **_):
    _enqueue(body)


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": "tandem-operator"})
async def on_child_event(body, type, **_):
    """A child Deployment changed (rollout progress, deletion): refresh its pool soon."""
    md = body.get("metadata", {})
    owner = next((o for o in md.get("ownerReferences", []) if o.get("kind") == S.KIND), None)
    if owner is None:
        return
    _enqueue({"metadata": {"namespace": md.get("namespace"), "name": owner["name"]}})


#: Transient failures of a pool are retried after RETRY_BASE_SECONDS, doubling up to RETRY_MAX_SECONDS.
RETRY_BASE_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0


class Backoff:
    """Per-pool retry delays after transient API errors (403 quota, 404, 409, 429, 5xx, no answer):
    5 s, 10 s, 20 s ... 300 s, with +-20 % jitter. A new generation (a spec change) retries at once."""

    def __init__(self, base: float = RETRY_BASE_SECONDS, cap: float = RETRY_MAX_SECONDS):
        self.base, self.cap = base, cap
        self._by_pool: dict[tuple[str, str], tuple[int, float, Optional[int]]] = {}

    def failed(self, key: tuple[str, str], generation: Optional[int]) -> float:
        """Record a failure; returns the delay in seconds before the next try."""
        n = self._by_pool.get(key, (0, 0.0, None))[0] + 1
        delay = min(self.base * 2 ** (n - 1), self.cap) * random.uniform(0.8, 1.2)
        self._by_pool[key] = (n, time.monotonic() + delay, generation)
        return delay

    def succeeded(self, key: tuple[str, str]) -> None:
        self._by_pool.pop(key, None)

    def waiting(self, key: tuple[str, str], generation: Optional[int]) -> bool:
        e = self._by_pool.get(key)
        return e is not None and e[2] == generation and time.monotonic() < e[1]

    def due(self, key: tuple[str, str]) -> bool:
        """Whether a failed pool's retry time has come."""
        e = self._by_pool.get(key)
        return e is not None and time.monotonic() >= e[1]

    def next_due(self) -> Optional[float]:
        """Seconds until the earliest retry, or None."""
        if not self._by_pool:
            return None
        return max(0.0, min(e[1] for e in self._by_pool.values()) - time.monotonic())


async def _resync_loop(interval: float) -> None:
    """The one place passes run: every `interval` seconds for every pool, and soon after Kopf or a
    child Deployment names a pool. Transient failures back off per pool; a pool whose child was
    refused as invalid is left alone by the reconciler until its generation changes."""
    wake = STATE["wake"] = asyncio.Event()
    backoff: Backoff = STATE.setdefault("backoff", Backoff())
    last_full = 0.0
    namespaces = [n for n in _env("TANDEM_NAMESPACES").split(",") if n]
    while True:
        timeout = max(0.5, interval - (time.monotonic() - last_full))
        due = backoff.next_due()
        if due is not None:
            timeout = max(0.5, min(timeout, due))
        try:
            await asyncio.wait_for(wake.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            pass
        wake.clear()
        await asyncio.sleep(0.5)  # coalesce bursts of child events
        full = time.monotonic() - last_full >= interval
        pending: set = STATE.setdefault("pending", set())
        named = set(pending)
        pending.clear()
        try:
            pools = await asyncio.to_thread(list_pools, reconciler().kube, namespaces)
        except KubeError as e:
            log.warning("resync: listing pools failed: %s", e)
            pending |= named
            continue
        if full:
            last_full = time.monotonic()
        rec = reconciler()
        by_ns: dict[str, list[dict]] = {}
        for body in pools:
            md = body["metadata"]
            key = (md.get("namespace") or "default", md["name"])
            if md.get("deletionTimestamp"):
                continue
            if not full and key not in named and not backoff.due(key):
                continue
            if backoff.waiting(key, md.get("generation")):
                continue  # its retry comes at its own time
            by_ns.setdefault(key[0], []).append(body)
        for ns, bodies in by_ns.items():
            snap, caps = None, None
            if len(bodies) > 1:  # one LIST per kind instead of one GET per child
                try:
                    caps = await asyncio.to_thread(rec.capabilities)
                    snap = await asyncio.to_thread(rec.snapshot, ns, caps)
                except KubeError as e:
                    log.warning("resync: snapshot of %s failed, reading children one by one: %s", ns, e)
                    snap, caps = None, None
            for body in bodies:
                md = body["metadata"]
                key = (ns, md["name"])
                t0 = time.perf_counter()
                try:
                    res = await asyncio.to_thread(rec.reconcile, body, caps, snap)
                except KubeError as e:
                    m = _metrics()
                    if m:
                        m.errors.inc()
                    delay = backoff.failed(key, md.get("generation"))
                    log.warning("pool %s/%s: %s; retrying in %.0fs", ns, md["name"], e, delay)
                    continue
                except Exception:  # noqa: BLE001 - nothing crashes the operator
                    log.exception("pass of %s/%s crashed", ns, md["name"])
                    backoff.failed(key, md.get("generation"))
                    continue
                backoff.succeeded(key)
                _report(res, ns, md["name"], time.perf_counter() - t0)


def _report(res, ns: str, name: str, seconds: float) -> None:
    m = _metrics()
    if m:
        m.observe(res, seconds)
    if res.parked:
        return
    if res.problems:
        if res.status_written:  # once per change, not once per pass
            log.info("pool %s/%s: invalid spec: %s", ns, name, "; ".join(f"{p}: {msg}" for p, msg in res.problems))
    elif res.rejected and res.status_written:
        log.warning("pool %s/%s: the API server rejected %s", ns, name,
                    "; ".join(f"{c}: {msg}" for c, msg in res.rejected))
    elif res.applied:
        log.info("pool %s/%s: applied %s", ns, name, ", ".join(res.applied))


WEBHOOK_ID = "check-pool"
#: Kopf's INFO lines for routine handler runs (every admission, every child Deployment event).
_ROUTINE = {f"Handler '{WEBHOOK_ID}' succeeded.", "Handler 'on_child_event' succeeded."}


class _RefusalAtInfo(logging.Filter):
    """A user's invalid manifest is not an operator error: Kopf logs each refusal of the admission
    handler as "Handler 'check-pool' failed permanently: ..." at ERROR; make it one INFO line. Kopf's
    routine "succeeded" lines for every admission and child event are kept for DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        marker = f"'{WEBHOOK_ID}' failed permanently: "
        if record.levelno == logging.INFO and msg in _ROUTINE:  # one per admission or child event
            return log.isEnabledFor(logging.DEBUG)
        if record.levelno >= logging.ERROR and marker in msg:
            record.msg, record.args = "admission refused: " + msg.split(marker, 1)[1], None
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


def check_pool(body, operation=None, old=None, **_):
    """Single- and cross-field rules of spec.py, and a name whose children are valid (every message
    names its field). An UPDATE that leaves the spec as it was (labels, annotations: Kopf's own among
    them) is allowed, so a pool admitted while the webhook was down can still be annotated; the
    reconciler reports it as Degraded/InvalidSpec."""
    new = _plain(body)
    if operation == "UPDATE" and old is not None and _plain(old).get("spec") == new.get("spec"):
        return
    spec = new.get("spec")
    if not isinstance(spec, dict):
        raise kopf.AdmissionError("spec: is required", code=422)
    problems = S.validate_spec_dict(spec)
    if operation != "UPDATE":  # a name cannot change
        problems = S.pool_name_problems((new.get("metadata") or {}).get("name") or "") + problems
    if problems:
        raise kopf.AdmissionError("; ".join(f"{p}: {m}" for p, m in problems), code=422)


# Registered only when a webhook server is configured (Kopf refuses admission handlers without one).
# Fail-open: the configuration says failurePolicy Ignore (webhook.ManagedConfiguration); the
# reconciler's Degraded condition covers what gets through.
if _env("TANDEM_WEBHOOK", "off") != "off":
    kopf.on.validate(S.GROUP, S.VERSION, S.PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"],
                     persistent=False, ignore_failures=True)(check_pool)
