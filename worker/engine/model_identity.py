"""What a model *is*, independent of where it is stored: a digest of its content.

Two pods that mount the same model at different paths must agree on block hashes (or every KV transfer
between them is refused), and two different models at the same path must not. So the identity is a
SHA-256 over the content, computed once while the weights are read:

* the parsed model config (:class:`tandem.worker.engine.loader.ModelConfig`, not the raw file, so a
  reformatted ``config.json`` does not matter);
* the tokenizer: the bytes of its files (Hugging Face directory) or its ``tokenizer.*`` metadata (GGUF);
* every weight's name, stored dtype and shape, plus a *sample* of its stored bytes: the first and last
  ``SAMPLE_BYTES`` of each tensor. Hashing every byte of an 8B model costs ~10 s of one core; the
  sample costs ~0.3 s and already tells apart any two trained (or randomly initialised) checkpoints,
  whose every tensor differs. A change confined to the middle of one large tensor is not seen: the
  trade-off is documented in docs/loading.md.

The engine mixes the *resolved* serving dtype and the quantization in
(:func:`tandem.worker.api.block_hash.fingerprint`), reports the result at ``/health``
(``model_fingerprint``), and the router pairs only workers that report the same one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

#: bytes hashed from each end of every tensor's stored data
SAMPLE_BYTES = 64 * 1024


class ContentDigest:
    """Accumulates a model's content digest (SHA-256). Feed tensors in any order: each is hashed on
    its own and the per-tensor digests are combined sorted by name."""

    def __init__(self):
        self._tensors: dict[str, str] = {}
        self._parts: dict[str, str] = {}

    def add_tensor(self, name: str, stored_dtype: str, shape, data: bytes | memoryview) -> None:
        """One tensor: ``data`` is its stored bytes (all of them; only the two ends are hashed)."""
        mv = memoryview(data).cast("B")
        n = len(mv)
        self.add_tensor_ends(name, stored_dtype, shape, n, mv[:SAMPLE_BYTES],
                             mv[max(SAMPLE_BYTES, n - SAMPLE_BYTES):])

    def add_tensor_ends(self, name: str, stored_dtype: str, shape, nbytes: int, head, tail) -> None:
        """One tensor of ``nbytes`` stored bytes, given only its first ``SAMPLE_BYTES`` (``head``) and
        the last ones after those (``tail``, at most ``SAMPLE_BYTES``)."""
        h = hashlib.sha256(json.dumps([name, str(stored_dtype), [int(s) for s in shape], nbytes]).encode())
        h.update(head)
        h.update(tail)
        self._tensors[name] = h.hexdigest()

    def add_part(self, key: str, value) -> None:
        """A named non-tensor part (config, tokenizer); ``value`` is JSON-serialisable or bytes."""
        raw = value if isinstance(value, (bytes, bytearray)) else json.dumps(
            dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value,
            sort_keys=True, default=str).encode()
        self._parts[key] = hashlib.sha256(raw).hexdigest()

    def hexdigest(self) -> str:
        """The digest of everything added so far (64 hex digits)."""
        return hashlib.sha256(json.dumps({"parts": self._parts, "tensors": self._tensors},
                                         sort_keys=True).encode()).hexdigest()


def digest_of_weights(config, weights: dict) -> str:
    """The content digest of an in-memory model (a :class:`LoadedModel` built by hand, as the GPU
    benchmark does): config plus each tensor's name, dtype, shape and end bytes."""
    import torch
    d = ContentDigest()
    d.add_part("config", config)
    for name in sorted(weights):
        t = weights[name].detach()
        flat = t.reshape(-1)
        es = flat.element_size()
        k = SAMPLE_BYTES // es
        head = flat[:k].cpu().contiguous().view(torch.uint8).numpy().tobytes()
        tail = flat[max(k, flat.numel() - k):].cpu().contiguous().view(torch.uint8).numpy().tobytes()
        d.add_tensor_ends(name, str(t.dtype), tuple(t.shape), flat.numel() * es, head, tail)
    return d.hexdigest()
