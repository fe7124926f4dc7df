"""The KV transfer wire format: length-prefixed frames of JSON metadata plus an optional binary payload.

A frame is ``magic (4 bytes, b"TKV1") | type (u8) | json length (u32) | payload length (u64)``, little
endian, then the JSON and the payload. One connection carries one transfer:

    decode -> prefill   HELLO   {layout, request_id, prompt_token_ids, params}
    prefill -> decode   ACCEPT  {} | REJECT {message}
    prefill -> decode   BLOCKS  {first_block, shape, dtype} + raw KV bytes   (repeated, as chunks finish)
    prefill -> decode   DONE    {token_id, logprob, top_logprobs}  | ERROR {message}

The layout (model fingerprint, dtype, block size, layer count, KV heads, head dim) must match exactly,
or the prefill worker refuses with a message that names both layouts.
"""
from __future__ import annotations

import asyncio
import enum
import json
import struct
import warnings

import torch

MAGIC = b"TKV1"
HEADER = struct.Struct("<4sBIQ")
MAX_JSON = 64 * 1024 * 1024


class FrameType(enum.IntEnum):
    HELLO = 1
    ACCEPT = 2
    REJECT = 3
    BLOCKS = 4
    DONE = 5
    ERROR = 6


class TransferError(RuntimeError):
    """A KV transfer failed (refused, broken connection, bad frame, or deadline passed)."""


def encode_frame(ftype: FrameType, meta: dict, payload: bytes | memoryview = b"") -> list:
    """The frame as buffers for ``writer.writelines`` (the payload is not copied)."""
    body = json.dumps(meta, separators=(",", ":")).encode()
    return [HEADER.pack(MAGIC, int(ftype), len(body), len(payload)), body, payload]


async def read_frame(reader: asyncio.StreamReader) -> tuple[FrameType, dict, bytes]:
    """Read one frame. Raises TransferError on a bad header, asyncio.IncompleteReadError on EOF."""
    magic, ftype, jlen, plen = HEADER.unpack(await reader.readexactly(HEADER.size))
    if magic != MAGIC or jlen > MAX_JSON:
        raise TransferError(f"bad frame header {magic!r}")
    meta = json.loads(await reader.readexactly(jlen)) if jlen else {}
    payload = await reader.readexactly(plen) if plen else b""
    try:
        return FrameType(ftype), meta, payload
    except ValueError:
        raise TransferError(f"unknown frame type {ftype}") from None


_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)}


def tensor_to_payload(t: torch.Tensor) -> tuple[dict, memoryview]:
    """``(meta, bytes)`` of a CPU tensor, dtype and shape kept."""
    t = t.contiguous()
    return {"shape": list(t.shape), "dtype": str(t.dtype)}, memoryview(t.view(torch.uint8).numpy()).cast("B")


def payload_to_tensor(meta: dict, payload: bytes) -> torch.Tensor:
    """Inverse of :func:`tensor_to_payload`. Raises TransferError on a size mismatch."""
    dtype = _DTYPES.get(meta.get("dtype"))
    if dtype is None:
        raise TransferError(f"unsupported KV dtype {meta.get('dtype')!r}")
    with warnings.catch_warnings():  # read-only bytes: the tensor is only ever copied from
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    try:
        return flat.view(dtype).reshape(meta["shape"])
    except RuntimeError as e:
        raise TransferError(f"KV payload does not match its shape {meta.get('shape')}: {e}") from None
