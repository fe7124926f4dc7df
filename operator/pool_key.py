"""The operator's pool key: every pool's shared secret is derived from it (docs/security.md, "The pool
secret"), so the operator computes a pool's secret instead of reading it back, and needs no read
access to Secrets outside its own namespace.

A pool's secret is HKDF-SHA256 (RFC 5869, the ``cryptography`` package) of the key, with the pool's
namespace, name, uid and its ``serving.tandem.dev/rotate-pool-secret`` annotation as the info: a pool
deleted and made again under the same name gets another secret, and changing the annotation rotates
one pool's secret. Replacing the key rotates every pool's.

Where the key comes from:
- ``TANDEM_POOL_KEY_SECRET=<namespace>/<name>`` (the chart): a Secret in the operator's namespace. The
  operator makes it (32 random bytes) when it is missing and reads it again every ``ttl`` seconds, so
  deleting it rotates every pool's secret within a minute. A failed read keeps the key it has; only a
  404 makes a new one.
- ``TANDEM_POOL_KEY_FILE``: a file holding at least 32 bytes (read once).
- neither (out of a cluster: in-process tests): a random key for this process.
"""
from __future__ import annotations

import base64
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Optional

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .kube import Kube, KubeError, object_path

log = logging.getLogger(__name__)

KEY_SECRET_ENV = "TANDEM_POOL_KEY_SECRET"
KEY_FILE_ENV = "TANDEM_POOL_KEY_FILE"
DATA_KEY = "key"
#: a pool annotation whose value is part of the pool's secret: change it to rotate that pool alone
ANN_ROTATE = "serving.tandem.dev/rotate-pool-secret"
_INFO = b"tandem pool secret v1"
_PROCESS_KEY = secrets.token_bytes(32)   # the same for every PoolKey of this process (no env set)


def pool_secret(key: bytes, namespace: str, name: str, uid: str, rotation: str = "") -> bytes:
    """The pool's shared secret: 32 bytes of HKDF-SHA256(``key``) with the pool's identity as the
    info (each part length-prefixed, so no two identities give the same info), written as URL-safe
    base64 (43 bytes: the form the workers read from their mounted file)."""
    info = _INFO + b"".join(len(p).to_bytes(2, "big") + p
                            for p in (x.encode() for x in (namespace, name, uid, rotation)))
    raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


class PoolKey:
    """The operator's key, from the environment (module docstring). Thread-safe; ``key()`` costs one
    GET at most every ``ttl`` seconds."""

    def __init__(self, kube: Optional[Kube] = None, env=os.environ, ttl: float = 60.0):
        self.kube, self.ttl = kube, ttl
        self.secret_ref = env.get(KEY_SECRET_ENV) or None
        self.file = env.get(KEY_FILE_ENV) or None
        self._key: Optional[bytes] = None
        self._at = 0.0
        self._lock = threading.Lock()

    def key(self) -> bytes:
        """The current key. Raises KubeError when the Secret cannot be read or made and no key was read
        before."""
        with self._lock:
            if self._key is not None and (self.secret_ref is None or time.monotonic() - self._at < self.ttl):
                return self._key
            if self.secret_ref is not None and self.kube is not None:
                try:
                    self._key = self._from_secret(*self.secret_ref.split("/", 1))
                    self._at = time.monotonic()
                except KubeError as e:
                    if self._key is None:
                        raise
                    log.warning("pool key not re-read (keeping the last one): %s", e)
            elif self.file is not None:
                data = Path(self.file).read_bytes().strip()
                if len(data) < 32:
                    raise ValueError(f"pool key file {self.file}: shorter than 32 bytes")
                self._key = data
            else:
                self._key = _PROCESS_KEY
            return self._key

    def _from_secret(self, ns: str, name: str) -> bytes:
        path = object_path("v1", "secrets", ns, name)
        s = self.kube.get(path)
        if s is None:
            body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": name, "namespace": ns,
                                 "labels": {"app.kubernetes.io/managed-by": "tandem-operator"}},
                    "data": {DATA_KEY: base64.b64encode(secrets.token_bytes(32)).decode()}}
            try:
                self.kube.request("POST", object_path("v1", "secrets", ns), body=body, retry=False)
                log.info("made the pool key %s/%s (every pool's secret changes)", ns, name)
            except KubeError as e:
                if e.status != 409:   # another replica made it first: read theirs
                    raise
            s = self.kube.get(path)
            if s is None:
                raise KubeError(404, f"pool key Secret {ns}/{name} vanished after it was made")
        value = base64.b64decode((s.get("data") or {}).get(DATA_KEY, ""))
        if len(value) < 32:
            raise KubeError(422, f"pool key Secret {ns}/{name}: its '{DATA_KEY}' is shorter than 32 bytes")
        return value
