"""Which prefill peers a decode worker may connect to (docs/security.md, "Prefill peers").

A prefill worker signs its own URL: ``GET /health`` carries ``peer_claim``, ``<expiry>:<HMAC>``, the
HMAC-SHA256 of ``url|expiry`` under a key derived from the pool secret for this purpose alone
(tandem.worker.api.keys.PEER_CLAIM). The router, which polls ``/health`` and holds only the pool-token
key, forwards the claim of the prefill worker it picked (``X-Tandem-Prefill-Peer-Claim``) beside its
URL; the decode worker checks it before it connects anywhere. So a prefill peer is a URL a member of
the pool vouched for within the last ``CLAIM_TTL_SECONDS``: a compromised router, or anyone else holding
a pool token, can name only the pool's own prefill workers, never an arbitrary host.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import time
from typing import Optional

from tandem.worker.api.keys import PEER_CLAIM, derive
from tandem.worker.api.names import worker_url

CLAIM_HEADER = "X-Tandem-Prefill-Peer-Claim"
#: seconds a claim stays valid (the prefill worker makes a fresh one for every /health answer; the
#: router polls every second)
CLAIM_TTL_SECONDS = 120
_CLAIM_RE = re.compile(r"(\d{1,12}):([0-9a-f]{64})")


def _mac(secret: bytes, url: str, expiry: str) -> str:
    return hmac.new(derive(secret, PEER_CLAIM), f"{url.rstrip('/')}|{expiry}".encode(), hashlib.sha256).hexdigest()


def make_claim(secret: bytes, url: str, now: Optional[float] = None, ttl: float = CLAIM_TTL_SECONDS) -> str:
    """The claim that ``url`` (this prefill worker's own address) is a member of the pool."""
    expiry = str(int((time.time() if now is None else now) + ttl))
    return f"{expiry}:{_mac(secret, url, expiry)}"


def verify_claim(secret: bytes, url: str, claim: Optional[str], now: Optional[float] = None) -> bool:
    """Whether ``claim`` vouches for ``url`` and has not expired (constant-time MAC compare)."""
    m = _CLAIM_RE.fullmatch(claim or "")
    if m is None:
        return False
    expiry, mac = m.groups()
    now = time.time() if now is None else now
    return hmac.compare_digest(_mac(secret, url, expiry), mac) and now <= int(expiry) <= now + 2 * CLAIM_TTL_SECONDS


def own_url(host: str, port: int, pod_ip: Optional[str]) -> Optional[str]:
    """This worker's URL as the router discovers it: ``POD_IP`` in a pod (the Endpoints' address),
    else the address it listens on; None for a wildcard address outside a pod (nothing to vouch for)."""
    ip = pod_ip or host
    if not ip or ip in ("0.0.0.0", "::"):
        return None
    return worker_url(ip, port)
