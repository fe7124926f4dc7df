"""The summary of a run, with vLLM's definitions (docs/architecture.md).

- TTFT: send to the first chunk with token text. TPOT: (E2E - TTFT) / (output tokens - 1), for
  requests with >= 2 output tokens. ITL: every gap between consecutive content chunks, pooled over
  requests. E2E: send to the end of the stream. Latencies are reported in milliseconds.
- Throughput: successful requests, output tokens and prompt + output tokens per second of the run's
  duration (from the first intended send to the last response's end). Token counts come from the
  server's usage, or from the tokenizer for streams without usage (``token_counts`` says how many
  requests were counted each way, ``tokenizer`` which one counted; counting.py).
- Goodput: successful requests per second that meet every SLO given (vLLM's ``--goodput``).
  SLO attainment: the fraction of all requests, failed ones included, that meet every SLO.
- Send lag: actual minus intended send time of the requests on the up-front schedule.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from tandem.worker.bench.client import RequestRecord
from tandem.worker.bench.runner import RunResult

DEFAULT_PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")


def parse_slo(items: list[str] | None) -> dict[str, float]:
    """``["ttft=0.5", "tpot=0.05"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds).

    Raises ValueError for an unknown key or a value that is not a positive number."""
    out = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            k, _, v = part.partition("=")
            if k not in SLO_KEYS:
                raise ValueError(f"unknown SLO {k!r} (one of {', '.join(SLO_KEYS)})")
            if float(v) <= 0:
                raise ValueError(f"SLO {k} must be > 0 seconds")
            out[k] = float(v)
    return out


def stats_ms(values: list[float], percentiles=DEFAULT_PERCENTILES) -> dict:
    """mean, std and percentiles of ``values`` (seconds) in milliseconds; NaN when empty."""
    a = np.asarray(values, dtype=float) * 1000.0
    if a.size == 0:
        return {"mean": float("nan"), "std": float("nan"), **{f"p{p:g}": float("nan") for p in percentiles},
                "count": 0}
    return {"mean": float(a.mean()), "std": float(a.std()),
            **{f"p{p:g}": float(np.percentile(a, p)) for p in percentiles}, "count": int(a.size)}


def meets_values(ok: bool, ttft: float | None, tpot: float | None, e2e: float | None,
                 slo: dict[str, float]) -> bool:
    """Whether a request that succeeded (``ok``) with these latencies (s) met every SLO (a TPOT SLO
    is met by a 1-token answer, whose TPOT is None)."""
    if not ok:
        return False
    if "ttft" in slo and ttft > slo["ttft"]:
        return False
    if "tpot" in slo and tpot is not None and tpot > slo["tpot"]:
        return False
    return not ("e2e" in slo and e2e > slo["e2e"])


def meets(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a request succeeded and met every SLO (:func:`meets_values`)."""
    return meets_values(rec.ok, rec.ttft, rec.tpot, rec.e2e, slo)


def summarize(result: RunResult, slo: dict[str, float] | None = None, percentiles=DEFAULT_PERCENTILES) -> dict:
    """The JSON summary of a run (see the module docstring for the definitions)."""
    slo = slo or {}
    recs = result.records
    ok = [r for r in recs if r.ok]
    dur = result.duration
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = [r for r in recs if meets(r, slo)]
    lags = [r.send_mono - r.intended_mono for r in recs if r.scheduled and r.intended_mono is not None]
    lag = {"count": len(lags)}
    if lags:
        a = np.asarray(lags) * 1000.0
        lag.update(mean_ms=float(a.mean()), p99_ms=float(np.percentile(a, 99)), max_ms=float(a.max()))
    load = result.load
    summary = {
        "dataset": result.dataset_kind,
        "load": {"mode": "closed" if load.closed else "open", "describe": load.describe(),
                 "arrival": None if load.closed else load.arrival,
                 "request_rate": None if load.closed else load.rate,
                 "burstiness": load.burstiness, "concurrency": load.concurrency or None, "seed": load.seed},
        "start_unix": result.start_unix,
        "duration_s": dur,
        "requests": len(recs),
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "errors_by_kind": dict(Counter(r.error_kind for r in recs if not r.ok)),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": stats_ms([r.ttft for r in ok], percentiles),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None], percentiles),
        "itl_ms": stats_ms([g for r in ok for g in r.itls], percentiles),
        "e2e_ms": stats_ms([r.e2e for r in ok], percentiles),
        "slo": slo,
        "goodput": len(good) / dur if slo else None,
        "slo_attainment": len(good) / len(recs) if slo and recs else None,
        "send_lag": lag,
        "completion_tokens_mismatch": sum(1 for r in ok if r.completion_tokens != r.output_tokens_asked),
        "token_counts": dict(Counter(r.token_source for r in ok)),
        "tokenizer": result.extra.get("tokenizer"),
    }
    # the closed loop has no request rate of its own to report
    if load.closed:
        summary["achieved_concurrency"] = sum(r.e2e for r in ok) / dur if ok else 0.0
    else:
        sched = [r for r in recs if r.scheduled]
        if len(sched) > 1:
            span = max(r.send_mono for r in sched) - min(r.send_mono for r in sched)
            summary["achieved_send_rate"] = (len(sched) - 1) / span if span > 0 else float("inf")
    return summary
