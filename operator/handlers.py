"""Thin Kopf handlers. The work is in reconcile.py (sync, run in a thread) and desired.py (pure).

- create / update / resume of an InferencePool: one reconcile pass (apply only what differs).
- No delete handler and no Kopf timer or daemon: both would make Kopf add a finalizer, and deleting a
  pool would then hang while the operator is down. Deletion is left to owner references.
- The "status timer" is one operator-wide resync loop (started at startup) that runs the same pass
  for every pool every TANDEM_RESYNC_SECONDS: it refreshes status and repairs drift. It is not paused
  by Kopf peering (Kopf has no public hook for that); a standby replica running it computes the same
  desired objects and, comparing before applying, writes nothing.
- Events of child Deployments trigger a status-only refresh of their pool, so Ready follows quickly.
- A validating admission webhook (`check-pool`) enforces the cross-field rules of spec.py.

Configuration is by environment (the chart sets it; `python -m tandem.operator --help` maps flags):
TANDEM_WEBHOOK (service|url|off), TANDEM_WEBHOOK_LISTEN (addr:port), TANDEM_WEBHOOK_SERVICE
(namespace/name:port), TANDEM_WEBHOOK_HOST (url mode), TANDEM_WEBHOOK_SECRET (namespace/name),
TANDEM_WEBHOOK_CONFIG (name of the managed ValidatingWebhookConfiguration), TANDEM_RESYNC_SECONDS,
TANDEM_METRICS_PORT, TANDEM_NAMESPACES (comma list; empty = all).
"""
from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from typing import Any

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
        certdir = tempfile.mkdtemp(prefix="tandem-webhook-")
        ca, crt, key = await asyncio.to_thread(
            ensure_certs, certdir, hosts, Kube() if secret else None,
            tuple(secret.split("/", 1)) if secret else None)
        common = dict(addr=addr, port=int(port), certfile=str(crt), pkeyfile=str(key), cafile=str(ca))
        if mode == "service":
            settings.admission.server = ServiceWebhookServer(
                service_namespace=sns, service_name=sname, service_port=int(sport or 443), **common)
        else:
            settings.admission.server = kopf.WebhookServer(host=host or addr, **common)
        settings.admission.managed = _env("TANDEM_WEBHOOK_CONFIG", "tandem-operator.serving.tandem.dev")
    port = int(_env("TANDEM_METRICS_PORT", "0") or 0)
    if port:
        from . import metrics
        STATE["metrics"] = metrics.start(port)
    STATE["reconciler"] = Reconciler(Kube())
    STATE["resync_task"] = asyncio.create_task(_resync_loop(float(_env("TANDEM_RESYNC_SECONDS", "10"))))


@kopf.on.cleanup()
async def cleanup(**_):
    t = STATE.pop("resync_task", None)
    if t is not None:
        t.cancel()


async def _run(body: Any, reason: str, logger) -> None:
    t0 = time.perf_counter()
    try:
        res = await asyncio.to_thread(reconciler().reconcile, _plain(body), reason)
    except KubeError as e:
        m = _metrics()
        if m:
            m.errors.inc()
        raise kopf.TemporaryError(f"API error, will retry: {e}", delay=5) from None
    m = _metrics()
    if m:
        m.observe(res, time.perf_counter() - t0)
    if res.problems:
        logger.warning("invalid spec: %s", "; ".join(f"{p}: {msg}" for p, msg in res.problems))
    elif res.applied:
        logger.info("applied %s", ", ".join(res.applied))


@kopf.on.create(S.GROUP, S.VERSION, S.PLURAL)
async def on_create(body, logger, **_):
    await _run(body, "create", logger)


@kopf.on.update(S.GROUP, S.VERSION, S.PLURAL, field="spec")
async def on_update(body, logger, **_):
    await _run(body, "update", logger)


@kopf.on.resume(S.GROUP, S.VERSION, S.PLURAL)
async def on_resume(body, logger, **_):
    await _run(body, "resume", logger)


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": "tandem-operator"})
async def on_child_event(body, type, **_):
    """A child Deployment changed (rollout progress, deletion): refresh its pool soon."""
    md = body.get("metadata", {})
    owner = next((o for o in md.get("ownerReferences", []) if o.get("kind") == S.KIND), None)
    if owner is None:
        return
    pending: set = STATE.setdefault("pending", set())
    pending.add((md.get("namespace"), owner["name"]))
    ev = STATE.get("wake")
    if ev is not None:
        ev.set()


async def _resync_loop(interval: float) -> None:
    wake = STATE["wake"] = asyncio.Event()
    last_full = 0.0
    namespaces = [n for n in _env("TANDEM_NAMESPACES").split(",") if n]
    while True:
        try:
            await asyncio.wait_for(wake.wait(), timeout=max(0.5, interval - (time.monotonic() - last_full)))
        except asyncio.TimeoutError:
            pass
        wake.clear()
        await asyncio.sleep(0.5)  # coalesce bursts of child events
        full = time.monotonic() - last_full >= interval
        pending: set = STATE.setdefault("pending", set())
        targets = None if full else set(pending)
        pending.clear()
        try:
            pools = await asyncio.to_thread(list_pools, reconciler().kube, namespaces)
        except KubeError as e:
            log.warning("resync: listing pools failed: %s", e)
            continue
        if full:
            last_full = time.monotonic()
        rec = reconciler()
        by_ns: dict[str, list[dict]] = {}
        for body in pools:
            md = body["metadata"]
            if md.get("deletionTimestamp"):
                continue
            if targets is not None and (md.get("namespace"), md["name"]) not in targets:
                continue
            by_ns.setdefault(md.get("namespace") or "default", []).append(body)
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
                try:
                    await asyncio.to_thread(rec.reconcile, body, "resync", caps, snap)
                except KubeError as e:
                    log.warning("resync of %s/%s failed (retried next pass): %s", ns, md["name"], e)
                except Exception:  # noqa: BLE001 - nothing crashes the operator
                    log.exception("resync of %s/%s crashed", ns, md["name"])


def check_pool(body, **_):
    """Cross-field rules (and, again, single-field ones) of spec.py; the message names each field."""
    spec = _plain(body).get("spec")
    if not isinstance(spec, dict):
        raise kopf.AdmissionError("spec: is required", code=422)
    problems = S.validate_spec_dict(spec)
    md = _plain(body).get("metadata") or {}
    if md.get("name") and len(md["name"]) > 40:
        problems.append(("metadata.name", "must be at most 40 characters (children append -prefill etc.)"))
    if problems:
        raise kopf.AdmissionError("; ".join(f"{p}: {m}" for p, m in problems), code=422)


# Registered only when a webhook server is configured (Kopf refuses admission handlers without one).
# Fail-open: not persistent, so Kopf empties its webhook list when the operator stops; the reconciler's
# Degraded condition covers that gap.
if _env("TANDEM_WEBHOOK", "off") != "off":
    kopf.on.validate(S.GROUP, S.VERSION, S.PLURAL, id="check-pool", operations=["CREATE", "UPDATE"],
                     persistent=False)(check_pool)
