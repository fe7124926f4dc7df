"""The pool-secret proofs of the KV transfer: an HMAC-SHA256 challenge-response in both directions,
then a MAC on every frame, so neither side sends the secret, no proof can be replayed on another
connection, and nothing large is read or parsed before the peer has proved the secret.

    prefill -> decode   CHALLENGE {nonce: Ns}
    decode -> prefill   HELLO  {nonce: Nc, bytes: n, sha256: H, mac: HMAC(k_proof, "hello"|Ns|Nc|n|H)}
                        + the HELLO body (n bytes of JSON whose SHA-256 is H) as the frame's payload
    prefill -> decode   ACCEPT {..., auth: {mac: HMAC(k_proof, "accept"|Ns|Nc)}}
    prefill -> decode   BLOCKS, DONE, ERROR: each with tag HMAC(k_frame(Ns, Nc), seq|type|json|payload)

The prefill worker checks the HELLO's small JSON part (at most :data:`PROOF_MAX_JSON` bytes) before it
reads the body: a client without the secret costs one kilobyte and one HMAC, never a buffer the size
of a prompt. The body's hash is inside the MAC, so a proof cannot be moved onto another prompt. The
decode worker checks the ACCEPT's proof before it writes any received block into its cache, and every
later frame's tag before it uses the frame (a host on the path cannot inject or alter KV blocks).

Keys: the pool secret is never used directly. Each purpose has its own key, derived with HKDF-SHA256
(RFC 5869) from the secret: ``k_proof`` for the handshake, ``k_frame`` for the frame tags (then keyed
per connection on both nonces), and the router's pool token (:mod:`tandem.worker.api.auth`). The
nonces are 128-bit random values; the MACs are RFC 2104 HMACs.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Optional

from tandem.worker.api.keys import KV_FRAME, KV_PROOF, ROUTER_TOKEN, derive  # noqa: F401  (re-exported)

#: the most bytes of JSON a HELLO's proof part may have (it is read before the proof is checked)
PROOF_MAX_JSON = 1024
TAG_BYTES = 32
NO_TAG = bytes(TAG_BYTES)


def new_nonce() -> str:
    """A fresh 128-bit random nonce as 32 hex characters."""
    return secrets.token_hex(16)


def _b(s: str) -> bytes:
    """A peer's string as bytes; lone surrogates (valid JSON escapes) must not raise."""
    return s.encode("utf-8", "surrogatepass")


def _mac(key: bytes, *parts: bytes) -> str:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).hexdigest()


def hello_proof(secret: Optional[bytes], server_nonce: str, body: bytes) -> dict:
    """The JSON part of a HELLO frame whose payload is ``body`` (the HELLO's JSON bytes): a fresh
    client nonce, the body's length and SHA-256, and (with a secret) the MAC over them."""
    nonce, digest = new_nonce(), hashlib.sha256(body).hexdigest()
    proof = {"nonce": nonce, "bytes": len(body), "sha256": digest}
    if secret is not None:
        proof["mac"] = _mac(derive(secret, KV_PROOF), b"hello", _b(server_nonce), nonce.encode(),
                            str(len(body)).encode(), digest.encode())
    return proof


def verify_proof(secret: Optional[bytes], server_nonce: str, proof, body_len: int) -> bool:
    """Whether a HELLO's JSON part is well formed for a body of ``body_len`` bytes and (with a secret)
    proves it for this connection's nonce. Checked before the body is read."""
    if not isinstance(proof, dict) or not isinstance(proof.get("nonce"), str) or \
            not isinstance(proof.get("sha256"), str) or proof.get("bytes") != body_len:
        return False
    if secret is None:
        return True
    mac = proof.get("mac")
    if not isinstance(mac, str):
        return False
    want = _mac(derive(secret, KV_PROOF), b"hello", _b(server_nonce), _b(proof["nonce"]),
                str(body_len).encode(), _b(proof["sha256"]))
    return hmac.compare_digest(want.encode(), _b(mac))


def body_matches(proof: dict, body: bytes) -> bool:
    """Whether ``body`` is the one the (verified) proof names."""
    return hmac.compare_digest(hashlib.sha256(body).hexdigest().encode(),
                               _b(proof["sha256"]))


def accept_proof(secret: Optional[bytes], server_nonce: str, client_nonce: str) -> dict:
    """The ``auth`` field of the ACCEPT frame ({} when there is no secret)."""
    if secret is None:
        return {}
    return {"auth": {"mac": _mac(derive(secret, KV_PROOF), b"accept", _b(server_nonce),
                                 _b(client_nonce))}}


def verify_accept(secret: Optional[bytes], server_nonce: str, client_nonce: str, accept: dict) -> bool:
    """Whether an ACCEPT proves ``secret`` (True when the decode side has no secret)."""
    if secret is None:
        return True
    mac = (accept.get("auth") or {}).get("mac") if isinstance(accept.get("auth"), dict) else None
    if not isinstance(mac, str):
        return False
    want = _mac(derive(secret, KV_PROOF), b"accept", _b(server_nonce), _b(client_nonce))
    return hmac.compare_digest(want.encode(), _b(mac))


class FrameMac:
    """The tags of one connection's frames after the handshake: HMAC-SHA256 keyed on the pool's frame
    key and both nonces, over a sequence number, the frame type and its raw JSON and payload bytes (so
    frames cannot be altered, dropped, reordered or replayed from another connection)."""

    def __init__(self, secret: bytes, server_nonce: str, client_nonce: str):
        self.key = hmac.new(derive(secret, KV_FRAME), _b(f"{server_nonce}\0{client_nonce}"),
                            hashlib.sha256).digest()
        self.seq = 0

    def tag(self, ftype: int, body: bytes, payload) -> bytes:
        """The next frame's tag (advances the sequence)."""
        h = hmac.new(self.key, self.seq.to_bytes(8, "little") + bytes([int(ftype)])
                     + len(body).to_bytes(8, "little") + len(payload).to_bytes(8, "little"), hashlib.sha256)
        h.update(body)
        h.update(payload)
        self.seq += 1
        return h.digest()

    def check(self, ftype: int, body: bytes, payload, tag: bytes) -> bool:
        """Whether ``tag`` is the next frame's (advances the sequence)."""
        return hmac.compare_digest(self.tag(ftype, body, payload), bytes(tag))
