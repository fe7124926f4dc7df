"""Block hashes for the prefix cache: the one definition shared by router, prefill and decode.

A full block's hash is SHA-256 over the parent block's hash (32 zero bytes for the first block),
the block's token ids as fixed-width little-endian uint32, and the model fingerprint. Chaining makes
a hash name the whole prefix up to and including its block, as in vLLM's automatic prefix caching.
Never Python's ``hash()``: it is salted per process, and these hashes cross processes.
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, Sequence

import numpy as np

ROOT_HASH = b"\x00" * 32


def fingerprint(**parts) -> bytes:
    """A stable 32-byte digest of keyword ``parts`` (JSON-serialisable), e.g. the model source and dtype."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], model_fingerprint: bytes) -> bytes:
    """The 32-byte hash of one full block of ``token_ids`` whose parent block hashed to ``parent``."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    h.update(model_fingerprint)
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, model_fingerprint: bytes,
                 start: int = 0, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, from block index ``start`` on.

    ``parent`` must be the hash of block ``start - 1`` (``ROOT_HASH`` when ``start`` is 0). The
    trailing partial block, if any, has no hash.
    """
    out = []
    for b in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], model_fingerprint)
        out.append(parent)
    return out


def hex_hashes(hashes: Iterable[bytes]) -> list[str]:
    """Hex strings of ``hashes``, for logs and JSON."""
    return [h.hex() for h in hashes]
