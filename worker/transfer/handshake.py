"""The pool-secret proofs of the KV transfer handshake: an HMAC-SHA256 challenge-response in both
directions, so neither side sends the secret and neither proof can be replayed on another connection.

    prefill -> decode   CHALLENGE {nonce: Ns}
    decode -> prefill   HELLO {..., auth: {nonce: Nc, mac: HMAC(k, "hello" | Ns | Nc | hello body)}}
    prefill -> decode   ACCEPT {..., auth: {mac: HMAC(k, "accept" | Ns | Nc)}}

The prefill worker checks the HELLO's proof before it looks at the prompt (no block is allocated and
no token computed for a client that fails it); the decode worker checks the ACCEPT's proof before it
writes any received block into its cache. The HELLO's proof covers its whole body (layout, prompt,
sampling parameters), so a proof cannot be moved onto another prompt. This is the pattern of
challenge-response authentication in RFC 2104 (HMAC) terms; the nonces are 128-bit random values.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Optional


def new_nonce() -> str:
    """A fresh 128-bit random nonce as 32 hex characters."""
    return secrets.token_hex(16)


def _canonical(hello: dict) -> bytes:
    return json.dumps({k: v for k, v in hello.items() if k != "auth"}, sort_keys=True,
                      separators=(",", ":")).encode()


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).hexdigest()


def sign_hello(secret: bytes, server_nonce: str, hello: dict) -> dict:
    """``hello`` with its ``auth`` field: a fresh client nonce and the MAC over the body."""
    nonce = new_nonce()
    mac = _mac(secret, b"hello", server_nonce.encode(), nonce.encode(), _canonical(hello))
    return {**hello, "auth": {"nonce": nonce, "mac": mac}}


def verify_hello(secret: Optional[bytes], server_nonce: str, hello: dict) -> bool:
    """Whether a HELLO proves ``secret`` for this connection's nonce (True when there is no secret)."""
    if secret is None:
        return True
    auth = hello.get("auth")
    if not isinstance(auth, dict) or not isinstance(auth.get("nonce"), str) or not isinstance(auth.get("mac"), str):
        return False
    want = _mac(secret, b"hello", server_nonce.encode(), auth["nonce"].encode(), _canonical(hello))
    return hmac.compare_digest(want.encode(), auth["mac"].encode())


def accept_proof(secret: Optional[bytes], server_nonce: str, hello: dict) -> dict:
    """The ``auth`` field of the ACCEPT frame ({} when there is no secret)."""
    if secret is None:
        return {}
    nonce = (hello.get("auth") or {}).get("nonce", "")
    return {"auth": {"mac": _mac(secret, b"accept", server_nonce.encode(), nonce.encode())}}


def verify_accept(secret: Optional[bytes], server_nonce: str, signed_hello: dict, accept: dict) -> bool:
    """Whether an ACCEPT proves ``secret`` (True when the decode side has no secret)."""
    if secret is None:
        return True
    mac = (accept.get("auth") or {}).get("mac")
    if not isinstance(mac, str):
        return False
    want = _mac(secret, b"accept", server_nonce.encode(), signed_hello["auth"]["nonce"].encode())
    return hmac.compare_digest(want.encode(), mac.encode())
