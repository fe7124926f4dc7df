"""Seeded request traces, the format ``tandem bench serve --dataset trace`` and the simulator replay.

A trace is JSON Lines. The first line is the header, ``{"tandem_trace": 1, "generator": KIND,
"params": {...}}`` (every parameter, the seed included, so the file says how to make it again); each
later line is a request: ``timestamp`` (seconds from the start), ``prompt_tokens``, ``output_tokens``,
and optionally ``prefix_group``, ``session`` and ``hash_ids`` (prefix blocks of ``params.block_tokens``
tokens each, from an imported trace: :mod:`tandem.worker.bench.trace_import`). A file without the header line is read too (records
only), so traces from elsewhere can be replayed.

Arrivals are a non-homogeneous Poisson process drawn by thinning (Lewis and Shedler, 1979): draw at
the peak rate, keep each arrival with probability rate(t) / peak. Lengths are log-normal around a
median (sigma 0: fixed).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Iterator, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

VERSION = 1
GENERATORS = ("step", "diurnal", "bursts", "prompt-shift", "output-shift")


class TraceRecord(BaseModel):
    """One request of a trace (other fields are kept as they are)."""
    model_config = ConfigDict(extra="allow")
    timestamp: float = Field(ge=0, allow_inf_nan=False, description="seconds from the trace's start")
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    prefix_group: Optional[int] = Field(None, ge=0)
    hash_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, description="prefix blocks (imported traces): equal ids, the same block of the header's "
                          "params.block_tokens tokens")


def json_objects(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number from 1, object) for each non-blank line of a JSON Lines file. Raises ValueError
    ``FILE:LINE: why`` for a line that is not a JSON object, OSError when the file cannot be read."""
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: a record is a JSON object, not {type(obj).__name__}")
        yield n, obj


def field_error(path, line: int, e: ValidationError) -> ValueError:
    """``FILE:LINE: FIELD: why`` for the first error of a record's validation."""
    err = e.errors()[0]
    field = ".".join(str(x) for x in err["loc"]) or "row"
    return ValueError(f"{path}:{line}: {field}: {err['msg']}")


def read_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records) of a trace file, records sorted by timestamp. Raises ValueError naming the file,
    the line and the field for a line that is not a JSON object or a record that is not valid
    (:class:`TraceRecord`), and OSError for a file that cannot be read."""
    header, records = {}, []
    for n, obj in json_objects(path):
        if n == 1 and "tandem_trace" in obj:
            header = obj
            continue
        if n == 1 and "tandem_dataset" in obj:
            raise ValueError(f"{path}: a saved dataset, not a trace (replay it with `bench serve "
                             "--load-dataset`)")
        try:
            rec = TraceRecord.model_validate(obj)
        except ValidationError as e:
            if not records and "input_length" in obj:
                raise ValueError(f"{path}:{n}: a Mooncake record, not a tandem trace's (convert the file with "
                                 "`tandem bench trace import --format mooncake`)") from None
            raise field_error(path, n, e) from None
        records.append({**obj, "timestamp": rec.timestamp, "prompt_tokens": rec.prompt_tokens,
                        "output_tokens": rec.output_tokens})
    records.sort(key=lambda r: r["timestamp"])
    return header, records


#: the most requests :func:`generate` makes (a bigger trace is a typo, and it would not fit in memory)
MAX_REQUESTS = 10_000_000


def _positive(least: float | None = None, **values) -> None:
    """Each given value (None: not set) is a finite number; > 0 when ``least`` is None, else >= least.
    Raises ValueError naming the first one that is not."""
    for name, v in values.items():
        if v is None:
            continue
        bad = not math.isfinite(v) or (v <= 0 if least is None else v < least)
        if bad:
            bound = "> 0" if least is None else f">= {least:g}"
            raise ValueError(f"{name.replace('_', '-')} must be a finite number {bound} (got {v:g})")


def write_trace(path: str | Path, generator: str, params: dict, records: list[dict]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"tandem_trace": VERSION, "generator": generator, "params": params}) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")


def rate_fn(kind: str, p: dict):
    """rate(t) in requests per second for a generator's parameters."""
    if kind == "step":
        return lambda t: np.where(t < p["at"], p["rate"], p["to_rate"])
    if kind == "diurnal":
        return lambda t: p["rate"] * (1 + p["amplitude"] * np.sin(2 * math.pi * t / p["period"]))
    if kind == "bursts":
        return lambda t: np.where((t % p["burst_every"]) < p["burst_length"], p["burst_rate"], p["rate"])
    return lambda t: np.full_like(np.asarray(t, dtype=float), p["rate"])


def generate(kind: str, duration: float, rate: float, prompt_tokens: int, output_tokens: int, sigma: float = 0.0,
             seed: int = 0, at: float | None = None, to_rate: float | None = None, to_prompt_tokens: int | None = None,
             to_output_tokens: int | None = None, period: float | None = None, amplitude: float = 0.5,
             burst_rate: float | None = None, burst_every: float = 30.0, burst_length: float = 5.0,
             prefix_groups: int = 0) -> tuple[dict, list[dict]]:
    """(params, records) of a trace of ``duration`` seconds.

    Kinds: ``step`` (rate -> to_rate at ``at``), ``diurnal`` (rate * (1 + amplitude sin(2 pi t / period))),
    ``bursts`` (burst_rate for burst_length s every burst_every s, rate otherwise), ``prompt-shift``
    and ``output-shift`` (the median length moves to to_prompt_tokens / to_output_tokens at ``at``).
    Raises ValueError, naming the parameter, for an unknown kind, a duration, rate, period or burst
    spacing that is not a finite number > 0, lengths under 1 token, a negative sigma, rate after a step
    or burst rate, and a trace of more than :data:`MAX_REQUESTS` requests."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown trace generator {kind!r} (one of {', '.join(GENERATORS)})")
    _positive(duration=duration, rate=rate, period=period, burst_every=burst_every, burst_length=burst_length)
    _positive(0, sigma=sigma, to_rate=to_rate, burst_rate=burst_rate, prefix_groups=prefix_groups, at=at)
    _positive(1, prompt_tokens=prompt_tokens, output_tokens=output_tokens, to_prompt_tokens=to_prompt_tokens,
              to_output_tokens=to_output_tokens)
    at = duration / 2 if at is None else at
    p = dict(duration=duration, rate=rate, prompt_tokens=prompt_tokens, output_tokens=output_tokens, sigma=sigma,
             seed=seed, prefix_groups=prefix_groups, at=at)
    if kind == "step":
        p["to_rate"] = 2 * rate if to_rate is None else to_rate
    elif kind == "diurnal":
        p.update(period=duration if period is None else period, amplitude=amplitude)
        if not 0 <= amplitude <= 1:
            raise ValueError("amplitude must be within [0, 1]")
    elif kind == "bursts":
        p.update(burst_rate=4 * rate if burst_rate is None else burst_rate, burst_every=burst_every,
                 burst_length=burst_length)
    elif kind == "prompt-shift":
        p["to_prompt_tokens"] = 2 * prompt_tokens if to_prompt_tokens is None else to_prompt_tokens
    else:
        p["to_output_tokens"] = 2 * output_tokens if to_output_tokens is None else to_output_tokens
    fn = rate_fn(kind, p)
    grid = np.linspace(0, duration, 4096)
    peak = float(np.max(fn(grid)))
    if rate <= 0 or peak <= 0:
        raise ValueError("rates must be > 0")
    if peak * duration > MAX_REQUESTS:
        raise ValueError(f"about {peak * duration:.3g} requests (rate x duration); the most a trace holds is "
                         f"{MAX_REQUESTS:.0e}")
    rng = np.random.default_rng(seed)
    n_max = int(peak * duration * 1.5 + 50)
    t = np.cumsum(rng.exponential(1 / peak, n_max))
    t = t[t < duration]
    keep = rng.uniform(size=t.size) < fn(t) / peak
    t = t[keep]
    pmed = np.where(t < at, prompt_tokens, p.get("to_prompt_tokens", prompt_tokens))
    omed = np.where(t < at, output_tokens, p.get("to_output_tokens", output_tokens))
    noise_p, noise_o = rng.lognormal(0, sigma, t.size), rng.lognormal(0, sigma, t.size)
    groups = rng.integers(0, prefix_groups, t.size) if prefix_groups else None
    records = []
    for i in range(t.size):
        r = {"timestamp": round(float(t[i]), 6), "prompt_tokens": max(1, int(round(pmed[i] * noise_p[i]))),
             "output_tokens": max(1, int(round(omed[i] * noise_o[i])))}
        if groups is not None:
            r["prefix_group"] = int(groups[i])
        records.append(r)
    return p, records


def _trace(args) -> int:
    import sys
    try:
        params, records = generate(args.kind, args.duration, args.rate, args.prompt_tokens, args.output_tokens,
                                   args.sigma, args.seed, args.at, args.to_rate, args.to_prompt_tokens,
                                   args.to_output_tokens, args.period, args.amplitude, args.burst_rate,
                                   args.burst_every, args.burst_length, args.prefix_groups)
        write_trace(args.output, args.kind, params, records)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(records)} requests over {args.duration:g} s ({args.kind}, seed {args.seed})")
    return 0


def add_trace_command(sub) -> None:
    import argparse

    from tandem.worker.bench.trace_import import add_import_command
    top = sub.add_parser("trace", help="write a seeded request trace (JSON Lines) for bench serve and the simulator, "
                                       "or import a production one")
    kinds = top.add_subparsers(dest="kind", required=True, metavar="{" + ",".join(GENERATORS) + ",import}")
    t = argparse.ArgumentParser(add_help=False)   # the generators' options, shared by each kind
    t.add_argument("--output", "-o", required=True)
    t.add_argument("--duration", type=float, default=300.0, help="seconds")
    t.add_argument("--rate", type=float, default=1.0, help="requests per second (the base rate)")
    t.add_argument("--prompt-tokens", type=int, default=256, help="median prompt length")
    t.add_argument("--output-tokens", type=int, default=64, help="median output length")
    t.add_argument("--sigma", type=float, default=0.0, help="log-normal sigma of the lengths (0: fixed)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--at", type=float, default=None, help="step and shifts: when (s; default: half way)")
    t.add_argument("--to-rate", type=float, default=None, help="step: the rate after --at (default 2x)")
    t.add_argument("--to-prompt-tokens", type=int, default=None, help="prompt-shift: the median after --at")
    t.add_argument("--to-output-tokens", type=int, default=None, help="output-shift: the median after --at")
    t.add_argument("--period", type=float, default=None, help="diurnal: seconds per cycle (default: duration)")
    t.add_argument("--amplitude", type=float, default=0.5, help="diurnal: relative swing (0..1)")
    t.add_argument("--burst-rate", type=float, default=None, help="bursts: the rate inside a burst (default 4x)")
    t.add_argument("--burst-every", type=float, default=30.0)
    t.add_argument("--burst-length", type=float, default=5.0)
    t.add_argument("--prefix-groups", type=int, default=0, help="tag requests with one of N prefix groups")
    for kind in GENERATORS:
        kinds.add_parser(kind, parents=[t], help=f"a seeded {kind} trace").set_defaults(func=_trace)
    add_import_command(kinds)
