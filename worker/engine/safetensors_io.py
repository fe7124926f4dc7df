"""Read safetensors files one tensor at a time, straight into the serving dtype and device.

Why not ``safetensors.safe_open``: on the CPU it hands out tensors backed by an ``mmap`` of the file,
and every page a conversion or a copy touches stays resident in the process (and counted in its RSS
and its cgroup) until the last tensor of that file is gone. Measured on a 512 MiB bf16 file converted
to fp32: peak RSS 1.5x the fp32 result, and up to 2x when tensors are copied out (bench/load_model.py
has the figures). Reading each tensor with ``readinto`` into a buffer of its own size goes through the
page cache instead, which is not the process's memory: host memory stays at the weights already
placed plus one tensor (or, on a GPU, near one tensor).

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data;
offsets are relative to the end of the header.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterator

import torch

from tandem.worker.api.source import ModelLoadError

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: a header larger than this is not a real one (the format caps it at 100 MB)
MAX_HEADER = 100_000_000


def read_header(path: Path) -> tuple[int, dict]:
    """``(data start offset, {name: entry})`` of one safetensors file.

    Raises ModelLoadError naming the file when the header is missing, truncated, not JSON, or names
    data outside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{path}: corrupt safetensors file: {size} bytes, no header")
        (n,) = struct.unpack("<Q", raw)
        if n == 0 or n > MAX_HEADER or 8 + n > size:
            raise ModelLoadError(f"{path}: corrupt safetensors file: header length {n} "
                                 f"in a file of {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ModelLoadError(f"{path}: corrupt safetensors file: header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    start = 8 + n
    for name, e in header.items():
        try:
            b, end = e["data_offsets"]
            dt = ST_DTYPES[e["dtype"]]
            numel = 1
            for s in e["shape"]:
                numel *= int(s)
        except (KeyError, TypeError, ValueError) as err:
            raise ModelLoadError(f"{path}: corrupt safetensors file: tensor {name!r}: bad entry "
                                 f"{e!r} ({type(err).__name__}: {err})") from None
        if end - b != numel * dt.itemsize or start + end > size or b < 0:
            raise ModelLoadError(f"{path}: corrupt safetensors file: tensor {name!r} spans bytes "
                                 f"{b}..{end} (expected {numel * dt.itemsize} bytes) in a file of "
                                 f"{size - start} data bytes")
    return start, header


def iter_tensors(files: list[Path], on_bytes: Callable[[str, str, tuple, memoryview], None] | None = None,
                 staged: Callable[[torch.dtype], bool] = lambda dtype: False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``files``, each read into a CPU tensor of its
    stored dtype. ``on_bytes(name, stored dtype, shape, raw bytes)`` sees each tensor's bytes first
    (the content digest).

    A tensor whose stored dtype ``staged`` accepts is read into one staging buffer reused for every
    such tensor (the caller converts or copies it away before taking the next: it is overwritten);
    the others get a buffer of their own, which the caller may keep. Reusing the buffer saves a fresh
    allocation, and its page faults, per converted tensor."""
    stage = torch.empty(0, dtype=torch.uint8)
    for path in files:
        start, header = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
                e = header[name]
                b, end = e["data_offsets"]
                if staged(ST_DTYPES[e["dtype"]]):
                    if stage.numel() < end - b:
                        stage = torch.empty(end - b, dtype=torch.uint8)
                    buf = stage[:end - b]
                else:
                    buf = torch.empty(end - b, dtype=torch.uint8)
                view = memoryview(buf.numpy())
                got = 0
                while got < len(view):   # preadv may return short counts on very large reads
                    n = os.preadv(fd, [view[got:]], start + b + got)
                    if n <= 0:
                        raise ModelLoadError(f"{path}: truncated safetensors file: tensor {name!r}")
                    got += n
                shape = tuple(int(s) for s in e["shape"])
                if on_bytes is not None:
                    on_bytes(name, e["dtype"], shape, view)
                yield name, buf.view(ST_DTYPES[e["dtype"]]).reshape(shape)
        finally:
            os.close(fd)


def stored_bytes(files: list[Path]) -> int:
    """Total tensor bytes in ``files`` (from their headers)."""
    total = 0
    for path in files:
        _, header = read_header(path)
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
    return total
