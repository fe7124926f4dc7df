"""The admission webhook's certificate and server.

Kopf's built-in self-signed certificate fails here (oscrypto can't parse OpenSSL 3's version string),
so the CA and serving certificate are made with `cryptography` and handed to Kopf as certfile/pkeyfile.
Where a Secret name is given, the pair is kept in that Secret, so every replica (and every restart)
serves the same CA and the managed ValidatingWebhookConfiguration's caBundle stays put.

`ServiceWebhookServer` makes the webhook registered by Service reference (namespace/name/port)
instead of by URL: the apiserver reaches it through the Service's endpoints.

`ManagedConfiguration` writes the ValidatingWebhookConfiguration itself instead of letting Kopf do
it: Kopf hard-codes `timeoutSeconds: 30`, so a frozen operator would hold every `kubectl apply` of a
pool for 30 s. Ours is fail-open (`failurePolicy: Ignore`) with a short timeout; the reconciler checks
the same rules and reports an admitted invalid pool as Degraded/InvalidSpec.
"""
from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import logging
import os
from pathlib import Path
from typing import AsyncIterator, Optional

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from . import spec as S
from .kube import Kube, KubeError, object_path

log = logging.getLogger("tandem.operator.webhook")


def make_certs(hosts: list[str], days: int = 3650) -> tuple[bytes, bytes, bytes]:
    """(ca_pem, cert_pem, key_pem): a CA and a serving certificate for `hosts` (DNS names or IPs)."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem-operator-webhook-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


def ensure_certs(outdir: str | Path, hosts: list[str], kube: Optional[Kube] = None,
                 secret: Optional[tuple[str, str]] = None) -> tuple[Path, Path, Path]:
    """Write ca.crt, tls.crt, tls.key to outdir; share them through a Secret (namespace, name) if given."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    data: Optional[dict[str, bytes]] = None
    if kube is not None and secret is not None:
        ns, name = secret
        path = object_path("v1", "secrets", ns, name)
        s = kube.get(path)
        if s is None:
            ca, crt, key = make_certs(hosts)
            body = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                    "metadata": {"name": name, "namespace": ns,
                                 "labels": {"app.kubernetes.io/managed-by": "tandem-operator"}},
                    "data": {"ca.crt": base64.b64encode(ca).decode(), "tls.crt": base64.b64encode(crt).decode(),
                             "tls.key": base64.b64encode(key).decode()}}
            try:
                kube.request("POST", object_path("v1", "secrets", ns), body=body, retry=False)
            except KubeError as e:
                if e.status != 409:
                    raise
            s = kube.get(path)
        assert s is not None
        data = {k: base64.b64decode(v) for k, v in s["data"].items()}
    else:
        ca, crt, key = make_certs(hosts)
        data = {"ca.crt": ca, "tls.crt": crt, "tls.key": key}
    for k, v in data.items():
        # the key is 0600 from creation (a chmod after writing leaves a moment it is readable)
        fd = os.open(out / k, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if k == "tls.key" else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(v)
    return out / "ca.crt", out / "tls.crt", out / "tls.key"


class ServiceWebhookServer(kopf.WebhookServer):
    """Kopf's webhook server, registered by Service reference rather than URL."""

    def __init__(self, *, service_namespace: str, service_name: str, service_port: int = 443, **kw):
        super().__init__(**kw)
        self.service_namespace = service_namespace
        self.service_name = service_name
        self.service_port = service_port

    async def __call__(self, fn) -> AsyncIterator[kopf.WebhookClientConfig]:  # type: ignore[override]
        async for cfg in super().__call__(fn):
            out = kopf.WebhookClientConfig(service=kopf.WebhookClientConfigService(
                namespace=self.service_namespace, name=self.service_name, port=self.service_port,
                path=(self.path or "").rstrip("/")))
            if "caBundle" in cfg:
                out["caBundle"] = cfg["caBundle"]
            yield out


#: Seconds the API server waits for the webhook before ignoring it (fail-open).
WEBHOOK_TIMEOUT_SECONDS = 5
VWC_API = "admissionregistration.k8s.io/v1"


def webhook_configuration(name: str, client_config: dict, handler_id: str,
                          timeout_seconds: int = WEBHOOK_TIMEOUT_SECONDS) -> dict:
    """The ValidatingWebhookConfiguration `name` for the pool webhook `handler_id` (Kopf serves each
    handler at /<id>). An empty `client_config` gives an empty webhook list (the operator stopped)."""
    hooks = []
    if client_config:
        cc = {k: v for k, v in client_config.items() if k in ("service", "url", "caBundle")}
        if "service" in cc:
            svc = dict(cc["service"])
            svc["path"] = f"{(svc.get('path') or '').rstrip('/')}/{handler_id}"
            cc["service"] = svc
        else:
            cc["url"] = f"{cc['url'].rstrip('/')}/{handler_id}"
        hooks.append({
            "name": f"{handler_id}.{name}",
            "sideEffects": "None",
            "failurePolicy": "Ignore",
            "matchPolicy": "Equivalent",
            "rules": [{"apiGroups": [S.GROUP], "apiVersions": [S.VERSION], "resources": [S.PLURAL],
                       "operations": ["CREATE", "UPDATE"], "scope": "Namespaced"}],
            "clientConfig": cc,
            "timeoutSeconds": timeout_seconds,
            "admissionReviewVersions": ["v1", "v1beta1"],
        })
    return {"apiVersion": VWC_API, "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "tandem-operator"}},
            "webhooks": hooks}


class ManagedConfiguration:
    """Wraps a Kopf webhook server: each client config it yields (its address and CA, once it
    listens) is written to the ValidatingWebhookConfiguration `name`; when the operator stops, the
    webhook list is emptied. Use with `settings.admission.managed = None`."""

    def __init__(self, server, name: str, handler_id: str, kube_factory=Kube,
                 timeout_seconds: int = WEBHOOK_TIMEOUT_SECONDS):
        self.server = server
        self.name = name
        self.handler_id = handler_id
        self.kube_factory = kube_factory
        self.timeout_seconds = timeout_seconds

    def _write(self, client_config: dict) -> None:
        obj = webhook_configuration(self.name, client_config, self.handler_id, self.timeout_seconds)
        self.kube_factory().apply(object_path(VWC_API, "validatingwebhookconfigurations", None, self.name), obj)

    async def __call__(self, fn) -> AsyncIterator[kopf.WebhookClientConfig]:
        written = False
        try:
            async for cfg in self.server(fn):
                await asyncio.to_thread(self._write, dict(cfg))
                written = True
                log.info("webhook configuration %s: failurePolicy Ignore, timeoutSeconds %d",
                         self.name, self.timeout_seconds)
                yield cfg
        finally:
            if written:  # fail-open on a clean stop, as Kopf's non-persistent webhooks are
                try:
                    self._write({})
                except Exception as e:  # noqa: BLE001 - stopping; the Ignore policy covers it
                    log.warning("emptying webhook configuration %s: %s", self.name, e)
