"""The Kopf wiring: thin handlers that name pools to the operator's one reconcile loop
(work_queue.py), the startup that starts that loop, the webhook (webhook_setup.py) and the autoscaler
thread (autoscaler/runner.py), and the cleanup that stops them. The work is in reconcile.py (sync, run
in a thread) and desired.py (pure).

- create / update / resume of an InferencePool and events of child Deployments only name the pool to
  the loop: every pass runs in that one loop, so a pool seen by Kopf and by the loop's first listing
  at start is applied once (one reconcile per change).
- The loop also runs a pass for every pool every TANDEM_RESYNC_SECONDS: it refreshes status (pods
  included) and repairs drift. It is not paused by Kopf peering (Kopf has no public hook for that); a
  standby replica computes the same desired objects and, comparing before applying, writes nothing.
- Transient API errors back off per pool (backoff.py: 5 s doubling to 300 s); a child refused as
  invalid parks the pool until its generation changes (see reconcile.py).
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
import logging
import os
import shutil
import tempfile
from typing import Any

import kopf

from . import spec as S
from .backoff import Backoff
from .kube import Kube
from .reconcile import Reconciler
from .webhook_setup import RefusalAtInfo, configure_webhook, register_check_pool, webhook_mode
from .work_queue import WorkQueue, resync_loop

log = logging.getLogger("tandem.operator")

STATE: dict[str, Any] = {}
QUEUE = WorkQueue()


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


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
    if webhook_mode() != "off":
        # the serving certificate and its private key: removed at cleanup (the server has loaded them)
        STATE["certdir"] = tempfile.mkdtemp(prefix="tandem-webhook-")
        await configure_webhook(settings, STATE["certdir"])
    logging.getLogger("kopf.objects").addFilter(RefusalAtInfo())
    port = int(_env("TANDEM_METRICS_PORT", "0") or 0)
    if port:
        from . import metrics
        STATE["metrics"] = metrics.start(port)
    STATE["reconciler"] = Reconciler(Kube())
    STATE["resync_task"] = asyncio.create_task(resync_loop(
        QUEUE, reconciler, float(_env("TANDEM_RESYNC_SECONDS", "10")),
        [n for n in _env("TANDEM_NAMESPACES").split(",") if n], STATE.setdefault("backoff", Backoff()), _metrics))
    if _env("TANDEM_AUTOSCALER", "on") != "off":
        from .autoscaler.runner import run_autoscaler
        STATE["autoscaler_task"] = asyncio.create_task(run_autoscaler(STATE, reconciler().event, _metrics()))


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


@kopf.on.create(S.GROUP, S.VERSION, S.PLURAL)
async def on_create(body, **_):
    QUEUE.enqueue(body)


@kopf.on.update(S.GROUP, S.VERSION, S.PLURAL, field="spec")
async def on_update(body, **_):
    QUEUE.enqueue(body)


@kopf.on.resume(S.GROUP, S.VERSION, S.PLURAL)
async def on_resume(body, **_):
    QUEUE.enqueue(body)


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": "tandem-operator"})
async def on_child_event(body, type, **_):
    """A child Deployment changed (rollout progress, deletion): refresh its pool soon."""
    md = body.get("metadata", {})
    owner = next((o for o in md.get("ownerReferences", []) if o.get("kind") == S.KIND), None)
    if owner is None:
        return
    QUEUE.enqueue({"metadata": {"namespace": md.get("namespace"), "name": owner["name"]}})


register_check_pool()
