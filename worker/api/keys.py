"""The pool secret's derived keys: one per purpose, so a key given to one part (the router's pool
token) forges nothing of another's (the KV handshake and its frame tags). HKDF-SHA256 (RFC 5869)
with the purpose as its info; the secret itself is never used as a key."""
from __future__ import annotations

from functools import lru_cache

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KV_PROOF = b"tandem kv proof v2"
KV_FRAME = b"tandem kv frame v2"
ROUTER_TOKEN = b"tandem router token v2"
PEER_CLAIM = b"tandem prefill peer claim v1"


@lru_cache(maxsize=16)
def derive(secret: bytes, purpose: bytes) -> bytes:
    """The 32-byte key for one ``purpose`` (one of the constants above), HKDF-SHA256 of the pool
    secret with the purpose as its info (RFC 5869): knowing one purpose's key gives no other."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose).derive(secret)
