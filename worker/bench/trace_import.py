"""Production request traces into tandem's trace format (:mod:`tandem.worker.bench.trace`):
``tandem bench trace import --format azure|mooncake FILE -o trace.jsonl [--window A:B] [--scale K]``.

Formats read:

- ``azure``: the Azure LLM inference traces (AzurePublicDataset, published with Splitwise, Patel et al.,
  ISCA 2024): CSV with a header ``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP is a date and
  time (``2023-11-16 18:17:03.9799600``), the other two are token counts.
- ``mooncake``: the Mooncake traces (kvcache-ai/Mooncake, Qin et al., FAST 2025): JSON Lines of
  ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, one id per block of
  :data:`MOONCAKE_BLOCK_TOKENS` prompt tokens, equal ids meaning the same prefix block. They are kept as
  the record's ``hash_ids``, and the header's ``params.block_tokens`` says the block size (the simulator's
  prefix cache and ``bench serve`` read both).

Timestamps become seconds from the first request. ``window`` (seconds from that start) cuts a span and
starts it at 0; ``scale`` K then superposes K copies of the span, copy j shifted by j * spread / K seconds
and wrapped around the span's end (docs/bench.md, "Importing production traces", says why), each copy's
``hash_ids`` moved to ids of its own.
"""
from __future__ import annotations

import csv
import math
import statistics
from datetime import datetime
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.worker.bench.trace import field_error, json_objects, write_trace

FORMATS = ("azure", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512
#: seconds over which the copies of ``--scale`` are spread (one autoscaler metrics minute: the rate seen
#: per minute is K times the original's, smoothed over at most this span)
SCALE_SPREAD_S = 60.0


class AzureRow(BaseModel):
    model_config = ConfigDict(extra="ignore")
    TIMESTAMP: datetime
    ContextTokens: int = Field(ge=1)
    GeneratedTokens: int = Field(ge=1)


#: an Azure trace's columns, as its header names them
AZURE_COLUMNS = tuple(AzureRow.model_fields)


class MooncakeRow(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timestamp: float = Field(ge=0, allow_inf_nan=False, description="milliseconds")
    input_length: int = Field(ge=1)
    output_length: int = Field(ge=1)
    hash_ids: list[int] = Field(default_factory=list)


def read_azure(path: str | Path) -> list[dict]:
    """Records (timestamp s from the first request, prompt_tokens, output_tokens) of an Azure CSV.
    Raises ValueError ``FILE:LINE: FIELD: why`` for a bad row or a missing column, OSError when unreadable."""
    out = []
    # utf-8-sig: a CSV saved by a spreadsheet starts with a byte-order mark, which would otherwise be part
    # of the first column's name
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = ",".join(AZURE_COLUMNS)
        if reader.fieldnames is None:
            raise ValueError(f"{path}:1: empty file (an Azure trace has a header {header})")
        missing = set(AZURE_COLUMNS) - set(reader.fieldnames)
        if missing:
            raise ValueError(f"{path}:1: {', '.join(sorted(missing))}: missing column (an Azure trace has "
                             f"{header})")
        for row in reader:
            short = [k for k in AZURE_COLUMNS if row.get(k) is None]
            if short:
                raise ValueError(f"{path}:{reader.line_num}: {short[0]}: missing (the row has "
                                 f"{len(reader.fieldnames) - len(short)} fields, the header "
                                 f"{len(reader.fieldnames)})")
            try:
                r = AzureRow.model_validate({k: (v.strip() if isinstance(v, str) else v) for k, v in row.items()
                                             if k is not None})
            except ValidationError as e:
                raise field_error(path, reader.line_num, e) from None
            out.append({"timestamp": r.TIMESTAMP.timestamp(), "prompt_tokens": r.ContextTokens,
                        "output_tokens": r.GeneratedTokens})
    return _rebase(out)


def read_mooncake(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[dict]:
    """Records (timestamp s, prompt_tokens, output_tokens, hash_ids) of a Mooncake JSONL trace.
    Raises ValueError ``FILE:LINE: FIELD: why`` for a line that is not a JSON object, a bad field, or more
    hash_ids than the prompt has blocks; OSError when unreadable."""
    out = []
    for n, obj in json_objects(path):
        try:
            r = MooncakeRow.model_validate(obj)
        except ValidationError as e:
            raise field_error(path, n, e) from None
        blocks = math.ceil(r.input_length / block_tokens)
        if len(r.hash_ids) > blocks:
            raise ValueError(f"{path}:{n}: hash_ids: {len(r.hash_ids)} ids for {r.input_length} tokens "
                             f"(at most {blocks} blocks of {block_tokens})")
        out.append({"timestamp": r.timestamp / 1000.0, "prompt_tokens": r.input_length,
                    "output_tokens": r.output_length, "hash_ids": r.hash_ids})
    return _rebase(out)


def _rebase(records: list[dict]) -> list[dict]:
    records.sort(key=lambda r: r["timestamp"])
    t0 = records[0]["timestamp"] if records else 0.0
    for r in records:
        r["timestamp"] = round(r["timestamp"] - t0, 6)
    return records


def cut_window(records: list[dict], start: float, end: float) -> list[dict]:
    """The records with start <= timestamp < end, timestamps from ``start``. Raises ValueError when
    end <= start or start < 0."""
    if not (0 <= start < end):
        raise ValueError(f"window must be START:END with 0 <= START < END seconds (got {start:g}:{end:g})")
    return [{**r, "timestamp": round(r["timestamp"] - start, 6)} for r in records if start <= r["timestamp"] < end]


def scale(records: list[dict], k: int, duration: float, spread: float = SCALE_SPREAD_S) -> list[dict]:
    """``k`` copies superposed, copy j shifted by j * spread / k seconds and wrapped past ``duration``
    (a request shifted to exactly ``duration`` stays there: copy 0 is the trace unchanged, its last request
    included), its hash_ids offset so that copies share no blocks. Raises ValueError for k < 1."""
    if k < 1 or int(k) != k:
        raise ValueError(f"scale must be a whole number >= 1 (got {k})")
    if k == 1:
        return list(records)
    top = 1 + max((h for r in records for h in r.get("hash_ids") or ()), default=-1)
    out = []
    for j in range(int(k)):
        shift = j * min(spread, duration) / k
        for r in records:
            t = r["timestamp"] + shift
            c = {**r, "timestamp": round(t - duration if 0 < duration < t else t, 6)}
            if r.get("hash_ids") is not None:
                c["hash_ids"] = [h + j * top for h in r["hash_ids"]]
            out.append(c)
    out.sort(key=lambda r: r["timestamp"])
    return out


def fit_lengths(records: list[dict], prompt_median: float, output_median: float,
                prompt_range: tuple[float, float] = (1, math.inf), max_len: float = math.inf) -> list[dict]:
    """The records with every prompt and output length multiplied so that their medians become
    ``prompt_median`` and ``output_median`` tokens (rounded), prompts then clipped to ``prompt_range`` and
    outputs to at least 2 tokens and at most ``max_len`` less the prompt: a trace mapped onto a calibration
    measured at other lengths, its timing and the shape of its length distributions kept (issue 25's check
    of the Azure code trace on the CPU scenarios' calibration: medians 256 and 10, prompts clipped to the
    calibrated 32-1,024). A record's ``hash_ids`` are dropped, since its blocks no longer match its
    tokens. Raises ValueError for a median that is not > 0, an empty range, or no records."""
    if not records:
        raise ValueError("no records to fit")
    if not (prompt_median > 0 and output_median > 0):
        raise ValueError(f"medians must be > 0 tokens (got {prompt_median:g}, {output_median:g})")
    lo, hi = prompt_range
    if not (1 <= lo <= hi) or max_len < lo + 2:
        raise ValueError(f"prompt range {lo:g}-{hi:g} with max_len {max_len:g} leaves no room for a request")
    fp = prompt_median / statistics.median(r["prompt_tokens"] for r in records)
    fo = output_median / statistics.median(r["output_tokens"] for r in records)
    out = []
    for r in records:
        c = {k: v for k, v in r.items() if k != "hash_ids"}
        c["prompt_tokens"] = int(min(hi, max(lo, round(r["prompt_tokens"] * fp))))
        c["output_tokens"] = int(max(2, min(max_len - c["prompt_tokens"], round(r["output_tokens"] * fo))))
        out.append(c)
    return out


def import_trace(fmt: str, path: str | Path, window: Optional[tuple[float, float]] = None, k: int = 1
                 ) -> tuple[dict, list[dict]]:
    """(params, records) of a production trace in tandem's format (see the module docs). Raises ValueError
    for an unknown format, a bad row (``FILE:LINE: FIELD: why``), a bad window or scale, or no requests."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
    records = read_azure(path) if fmt == "azure" else read_mooncake(path)
    if not records:
        raise ValueError(f"{path}: no requests")
    if window is not None:
        records = cut_window(records, *window)
        if not records:
            raise ValueError(f"{path}: no requests in the window {window[0]:g}:{window[1]:g} s")
        duration = window[1] - window[0]
        duration = min(duration, records[-1]["timestamp"] + 1e-6) if math.isinf(duration) else duration
    else:
        duration = records[-1]["timestamp"]
    if k < 1 or int(k) != k:
        raise ValueError(f"scale must be a whole number >= 1 (got {k})")
    records = scale(records, int(k), duration)
    # an open end is written as null: JSON has no Infinity
    params = {"format": fmt, "source": Path(path).name,
              "window": [window[0], None if math.isinf(window[1]) else window[1]] if window else None,
              "scale": int(k), "scale_spread_s": SCALE_SPREAD_S if k > 1 else 0.0, "duration": duration}
    if fmt == "mooncake":
        params["block_tokens"] = MOONCAKE_BLOCK_TOKENS
    return params, records


def parse_window(text: str) -> tuple[float, float]:
    """``A:B`` seconds (B may be empty: to the end). Raises ValueError naming --window."""
    try:
        a, b = text.split(":")
        return float(a or 0), float(b) if b else math.inf
    except ValueError:
        raise ValueError(f"--window {text!r}: give START:END in seconds from the trace's start, e.g. 0:1800") from None


def _import(args) -> int:
    import sys

    try:
        window = parse_window(args.window) if args.window else None
        params, records = import_trace(args.format, args.file, window, args.scale)
        write_trace(args.output, "import", params, records)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(records)} requests over {params['duration']:g} s ({args.format}, x{args.scale})")
    return 0


def add_import_command(sub) -> None:
    t = sub.add_parser("import", help="convert a production trace (Azure CSV, Mooncake JSONL) to a tandem trace")
    t.add_argument("file")
    t.add_argument("--format", required=True, choices=FORMATS)
    t.add_argument("--output", "-o", required=True)
    t.add_argument("--window", default=None, help="START:END seconds from the trace's start (END may be empty)")
    t.add_argument("--scale", type=int, default=1, help="K superposed copies: K x the rate, same duration")
    t.set_defaults(func=_import)
