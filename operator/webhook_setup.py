"""The operator's validating admission webhook, set up from the environment: its serving certificate,
its server (behind a Service, or at a URL), its fail-open configuration, and the admission handler
``check-pool`` (the rules of spec.py). Called from Kopf's startup (operator/handlers.py); the server
and configuration classes are in operator/webhook.py.

Environment: TANDEM_WEBHOOK (service|url|off), TANDEM_WEBHOOK_LISTEN (addr:port), TANDEM_WEBHOOK_SERVICE
(namespace/name:port), TANDEM_WEBHOOK_HOST (url mode), TANDEM_WEBHOOK_SECRET (namespace/name),
TANDEM_WEBHOOK_CONFIG (name of the managed ValidatingWebhookConfiguration)."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from . import spec as S
from .kube import Kube

log = logging.getLogger("tandem.operator")

WEBHOOK_ID = "check-pool"
#: Kopf's INFO lines for routine handler runs (every admission, every child Deployment event).
_ROUTINE = {f"Handler '{WEBHOOK_ID}' succeeded.", "Handler 'on_child_event' succeeded."}


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def webhook_mode() -> str:
    """``service``, ``url`` or ``off`` (TANDEM_WEBHOOK)."""
    return _env("TANDEM_WEBHOOK", "off")


async def configure_webhook(settings: kopf.OperatorSettings, certdir: str) -> None:
    """Make the certificate (into ``certdir``, which the caller removes at cleanup: the server has
    loaded it by then), the webhook server and its managed configuration, and put them in Kopf's
    ``settings``. Only when :func:`webhook_mode` is not ``off``."""
    from .webhook import ManagedConfiguration, ServiceWebhookServer, ensure_certs
    mode = webhook_mode()
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
    settings.admission.server = ManagedConfiguration(
        server, _env("TANDEM_WEBHOOK_CONFIG", "tandem-operator.serving.tandem.dev"), WEBHOOK_ID)
    settings.admission.managed = None
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # a line per admission request


class RefusalAtInfo(logging.Filter):
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


def _plain(body: Any) -> dict:
    """A Kopf Body (a read-only mapping view) as a plain dict."""
    if isinstance(body, dict):
        return body
    return {k: (_plain(v) if hasattr(v, "keys") else v) for k, v in body.items()}


def check_pool(body, operation=None, old=None, **_):
    """Single- and cross-field rules of spec.py, and a name whose children are valid (every message
    names its field). An UPDATE that leaves the spec as it was (labels, annotations: Kopf's own among
    them) is allowed, so a pool admitted while the webhook was down can still be annotated; the
    reconciler reports it as Degraded/InvalidSpec. Raises kopf.AdmissionError (422) naming each field."""
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


def register_check_pool() -> None:
    """Register :func:`check_pool` with Kopf, only when a webhook server is configured (Kopf refuses
    admission handlers without one). Fail-open: the configuration says failurePolicy Ignore
    (webhook.ManagedConfiguration); the reconciler's Degraded condition covers what gets through."""
    if webhook_mode() != "off":
        kopf.on.validate(S.GROUP, S.VERSION, S.PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"],
                         persistent=False, ignore_failures=True)(check_pool)
