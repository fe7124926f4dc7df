"""The KV transfer wire format: length-prefixed frames of JSON metadata plus an optional binary payload.

A frame is ``magic (4 bytes, b"TKV2") | type (u8) | json length (u32) | payload length (u64) | tag
(32 bytes)``, little endian, then the JSON and the payload. One connection carries one transfer:

    prefill -> decode   CHALLENGE {nonce}                        (as soon as the connection opens)
    decode -> prefill   HELLO   {proof} + payload: the HELLO body {layout, request_id, prompt_token_ids, params}
    prefill -> decode   ACCEPT  {request_id, auth?} | REJECT {message}
    prefill -> decode   BLOCKS  {first_block, shape, dtype} + raw KV bytes   (repeated, as chunks finish)
    prefill -> decode   DONE    {token_id, logprob, top_logprobs}  | ERROR {message}

The HELLO's JSON part is only its proof (:mod:`tandem.worker.transfer.handshake`, at most
``PROOF_MAX_JSON`` bytes); the body travels as the payload and is read, hashed and parsed only after
the proof is checked, and only up to the prefill worker's :func:`hello_limit`. With a pool secret the
frames after ACCEPT carry a tag (HMAC) checked before they are used; otherwise the tag is zeros.

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

from tandem.worker.transfer.handshake import NO_TAG


def layout_mismatch(prefill: dict, decode) -> str:
    """The REJECT message for two KV layouts that differ: every differing field with both values,
    then both layouts. A dtype difference says so first: with ``dtype: auto`` two workers of one
    pool resolve differently when their hosts differ (bf16 on a CPU with AVX-512-BF16 or AMX, fp32
    on one without), and their KV cannot be exchanged."""
    if not isinstance(decode, dict):
        return f"KV layout mismatch: prefill worker has {prefill}, decode worker sent {decode!r}"
    diff = [f"{k}: prefill {prefill.get(k)!r}, decode {decode.get(k)!r}"
            for k in sorted(set(prefill) | set(decode)) if prefill.get(k) != decode.get(k)]
    hint = ""
    if prefill.get("dtype") != decode.get("dtype"):
        hint = (" (the workers serve different dtypes: with dtype auto, each resolves it for its own "
                "host; pin spec.model.dtype, or schedule both roles on like hosts)")
    return (f"KV layout mismatch{hint}: {'; '.join(diff)}. "
            f"Prefill worker has {prefill}, decode worker sent {decode}")


MAGIC = b"TKV2"
HEADER = struct.Struct("<4sBIQ32s")
#: the most JSON bytes of a frame from a prefill worker (REJECT messages name two layouts; DONE has
#: at most 20 top logprobs)
MAX_JSON = 1024 * 1024


def hello_limit(max_model_len: int, block_size: int) -> int:
    """The most bytes a real HELLO body needs: a prompt of ``max_model_len`` tokens (rounded up to
    whole blocks) as JSON integers of at most 10 digits and a comma, plus 16 KiB for the layout and
    the sampling parameters (the decode worker sends no stop strings: the prefill computes one token)."""
    tokens = -(-max_model_len // block_size) * block_size
    return 11 * tokens + 16 * 1024


class FrameType(enum.IntEnum):
    HELLO = 1
    ACCEPT = 2
    REJECT = 3
    BLOCKS = 4
    DONE = 5
    ERROR = 6
    CHALLENGE = 7


class TransferError(RuntimeError):
    """A KV transfer failed (refused, broken connection, bad frame, or deadline passed)."""


class RequestFailed(TransferError):
    """The prefill worker refused or failed the request because of the request itself (a REJECT or
    ERROR frame with ``request_error``): prefilling it locally would fail the same way, so the decode
    worker fails it instead. ``field`` and ``status`` say how (``status`` 400: invalid, 500: it failed
    in the engine)."""

    def __init__(self, message: str, field: str | None = None, status: int = 500):
        super().__init__(message)
        self.field, self.status = field, status


def encode_frame(ftype: FrameType, meta: dict, payload: bytes | memoryview = b"", mac=None) -> list:
    """The frame as buffers: header, JSON, payload (not copied). ``mac`` (a handshake.FrameMac) tags it."""
    body = json.dumps(meta, separators=(",", ":")).encode()
    tag = mac.tag(ftype, body, payload) if mac is not None else NO_TAG
    return [HEADER.pack(MAGIC, int(ftype), len(body), len(payload), tag), body, payload]


def write_frame(writer, ftype: FrameType, meta: dict, payload: bytes | memoryview = b"", mac=None) -> None:
    """Write one frame to a StreamWriter or transport. The payload goes in its own ``write`` call:
    ``writelines`` would join it into a fresh multi-MB bytes object first (a copy into new pages)."""
    header, body, payload = encode_frame(ftype, meta, payload, mac)
    writer.write(header + body)
    if payload:
        writer.write(payload)


def parse_header(raw: bytes | bytearray, max_payload: int, max_json: int = MAX_JSON) -> tuple[int, int, int, bytes]:
    """``(frame type, json length, payload length, tag)`` of a frame header.

    Raises TransferError if it is not one, or if its lengths pass ``max_json`` or ``max_payload``
    bytes (the lengths come from the peer: nothing is allocated for them before this check)."""
    magic, ftype, jlen, plen, tag = HEADER.unpack(raw)
    if magic != MAGIC:
        raise TransferError(f"bad frame header {magic!r}")
    if jlen > max_json or plen > max_payload:
        raise TransferError(f"frame too large: {jlen} bytes of JSON (limit {max_json}), {plen} of payload "
                            f"(limit {max_payload})")
    return ftype, jlen, plen, tag


def parse_json(raw: bytes | bytearray) -> dict:
    """A frame's JSON part, which must be an object. Raises TransferError otherwise."""
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError as e:   # also UnicodeDecodeError
        raise TransferError(f"bad frame JSON: {e}") from None
    if not isinstance(meta, dict):
        raise TransferError(f"bad frame JSON: a {type(meta).__name__}, not an object")
    return meta


async def read_frame(reader: asyncio.StreamReader, max_payload: int,
                     max_json: int = MAX_JSON) -> tuple[FrameType, dict, bytes]:
    """Read one frame of at most ``max_payload`` payload bytes. Raises TransferError on a bad or too
    large header, asyncio.IncompleteReadError on EOF."""
    ftype, jlen, plen, _ = parse_header(await reader.readexactly(HEADER.size), max_payload, max_json)
    meta = parse_json(await reader.readexactly(jlen)) if jlen else {}
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


class FrameReceiver(asyncio.BufferedProtocol):
    """Receives frames with the socket reading straight into reusable buffers (no StreamReader copies).

    The payload buffer is reused: a frame's payload is valid until :meth:`next_frame` is called again,
    and reading pauses until then, which is the back-pressure (TCP flow control throttles the sender).
    A frame announcing more than ``max_payload`` bytes closes the connection with a TransferError.
    Once ``mac`` (a handshake.FrameMac) is set, every later frame's tag is checked before delivery.
    """

    def __init__(self, max_payload: int):
        self.max_payload = max_payload
        self.mac = None
        self._tag = NO_TAG
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(HEADER.size)
        self._json = bytearray()
        self._payload = bytearray()
        self._ftype, self._plen = 0, 0
        self._frames: asyncio.Queue = asyncio.Queue()
        self._closed: BaseException | None = None
        self._enter(0)

    def _enter(self, stage: int) -> None:
        """Start receiving the header (0), the JSON (1) or the payload (2) of a frame."""
        self._stage, self._pos = stage, 0
        self._view = memoryview((self._header, self._json, self._payload)[stage])
        if stage == 2:
            self._view = self._view[:self._plen]

    # ---- protocol callbacks ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self._closed = exc or ConnectionResetError("connection closed by peer")
        self._frames.put_nowait(self._closed)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._pos:]

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        while self._pos == len(self._view):   # zero-length parts complete at once
            if self._stage == 0:
                try:
                    self._ftype, jlen, self._plen, self._tag = parse_header(self._header, self.max_payload)
                except TransferError as e:
                    self._frames.put_nowait(e)
                    self.transport.close()
                    return
                self._json = bytearray(jlen)
                if len(self._payload) < self._plen:
                    self._payload = bytearray(self._plen)
                self._enter(1)
            elif self._stage == 1:
                self._enter(2)
            else:
                self._deliver()
                return

    def _deliver(self) -> None:
        payload = memoryview(self._payload)[:self._plen]
        try:
            if self.mac is not None and not self.mac.check(self._ftype, bytes(self._json), payload, self._tag):
                raise TransferError(f"frame {self._ftype} fails its MAC: not from the peer that proved the secret")
            frame = (FrameType(self._ftype), parse_json(self._json), payload)
        except ValueError as e:
            frame = TransferError(f"bad frame: {e}")
        except TransferError as e:
            frame = e
        self._frames.put_nowait(frame)
        self._enter(0)
        self.transport.pause_reading()   # until the consumer asks for the next frame

    # ---- consumer -------------------------------------------------------------------------------
    async def next_frame(self) -> tuple[FrameType, dict, memoryview]:
        """The next frame; raises TransferError for a malformed one, ConnectionError when the peer left."""
        if self._frames.empty() and self._closed is None and self.transport is not None:
            self.transport.resume_reading()
        item = await self._frames.get()
        if isinstance(item, BaseException):
            raise item
        return item
