"""Run outputs: the JSON summary, the per-request JSON Lines file, the terminal table, and
``tandem bench compare``."""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path

from tandem.worker.bench.runner import RunResult

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def write_requests(result: RunResult, path: str | Path) -> None:
    """One JSON object per request. Times are Unix seconds (so they join with other time series, such
    as replica counts): intended and actual send, first token, every content chunk, end."""
    off = result.start_unix - result.start_mono

    def unix(t):
        return None if t is None else t + off

    with open(path, "w") as f:
        for r in result.records:
            f.write(json.dumps({
                "id": r.id, "session": r.session, "turn": r.turn, "scheduled": r.scheduled,
                "intended_send": unix(r.intended_mono), "send": unix(r.send_mono),
                "first_token": unix(r.first_token_mono), "token_times": [unix(t) for t in r.token_times_mono],
                "end": unix(r.end_mono), "ttft": r.ttft if r.ok else None, "tpot": r.tpot,
                "e2e": r.e2e if r.ok else None, "prompt_tokens_asked": r.prompt_tokens_asked,
                "output_tokens_asked": r.output_tokens_asked, "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens, "token_source": r.token_source, "status": r.status,
                "error_kind": r.error_kind,
                "error": r.error}) + "\n")


def write_summary(summary: dict, path: str | Path) -> None:
    """``summary`` as strict JSON: a value that is not a finite number (an open-loop rate of inf, the
    percentiles of a run with no request) is written as null, which every JSON parser reads."""
    Path(path).write_text(json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")


def _finite(v):
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    if isinstance(v, (bool, str)) or v is None:
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    v = float(v)
    return v if math.isfinite(v) else None


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.2f}"
    return str(v)


def _counted_by(summary: dict) -> str:
    """``usage: 12, tokenizer (package:...): 4``: how the successful requests' tokens were counted."""
    parts = []
    for k, v in (summary.get("token_counts") or {}).items():
        src = f" ({summary['tokenizer']})" if k == "tokenizer" and summary.get("tokenizer") else ""
        parts.append(f"{k}{src}: {v}")
    return ", ".join(parts) or "-"


def print_summary(summary: dict, console=None) -> None:
    """The summary as a table on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    t = Table(title=f"tandem bench serve: {summary['dataset']}, {summary['load']['describe']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("requests (completed / failed)", f"{summary['completed']} / {summary['failed']}"),
            ("errors by kind", ", ".join(f"{k}: {v}" for k, v in summary["errors_by_kind"].items()) or "-"),
            ("tokens counted by (requests)", _counted_by(summary)),
            ("duration (s)", _fmt(summary["duration_s"])),
            ("request throughput (req/s)", _fmt(summary["request_throughput"])),
            ("output token throughput (tok/s)", _fmt(summary["output_throughput"])),
            ("total token throughput (tok/s)", _fmt(summary["total_token_throughput"]))]
    if summary["slo"]:
        rows += [(f"goodput (req/s) at {summary['slo']}", _fmt(summary["goodput"])),
                 ("SLO attainment", _fmt(summary["slo_attainment"]))]
    for key in LATENCIES:
        s = summary[key]
        for stat in [k for k in s if k not in ("std", "count")]:
            rows.append((f"{key[:-3].upper()} {stat} (ms)", _fmt(s[stat])))
    lag = summary["send_lag"]
    if lag.get("count"):
        rows.append(("send lag mean / p99 / max (ms)",
                     f"{lag['mean_ms']:.2f} / {lag['p99_ms']:.2f} / {lag['max_ms']:.2f}"))
    if "achieved_send_rate" in summary:
        rows.append(("achieved send rate (req/s)", _fmt(summary["achieved_send_rate"])))
    if "achieved_concurrency" in summary:
        rows.append(("mean requests in flight", _fmt(summary["achieved_concurrency"])))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("slo", "errors_by_kind", "load"):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = v
    return out


def compare(a: dict, b: dict) -> list[tuple[str, float, float, float | None]]:
    """(metric, A, B, B/A) for every numeric metric the two summaries share."""
    fa, fb = _flatten(a), _flatten(b)
    rows = []
    for k in fa:
        if k in fb and not k.endswith((".count", "start_unix")):
            ratio = fb[k] / fa[k] if fa[k] else None
            rows.append((k, fa[k], fb[k], ratio))
    return rows


def print_compare(a: dict, b: dict, names=("A", "B"), console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    t = Table(title=f"{names[0]} vs {names[1]}")
    for c in ("metric", names[0], names[1], "B/A"):
        t.add_column(c, justify="left" if c == "metric" else "right")
    for k, va, vb, ratio in compare(a, b):
        t.add_row(k, _fmt(float(va)), _fmt(float(vb)), "-" if ratio is None else f"{ratio:.3f}")
    console.print(t)


# ---- side by side: several servers (or loads) on the same dataset ------------------------------------

def load_run(path: str | Path) -> dict:
    """A run for the side-by-side table: ``path`` is a ``summary.json`` or the folder holding it (with
    ``requests.jsonl`` beside it when the run wrote one). Returns ``{"summary", "requests", "dir"}``;
    ``requests`` is None without the file. Raises OSError or ValueError for a missing or bad file."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    summary = json.loads((folder / "summary.json" if path.is_dir() else path).read_text())
    req = folder / "requests.jsonl"
    rows = [json.loads(x) for x in req.read_text().splitlines() if x.strip()] if req.is_file() else None
    return {"summary": summary, "requests": rows, "dir": folder}


def side_by_side(runs: list[tuple[str, dict]], slo: dict | None = None) -> list[dict]:
    """One row per run (name, :func:`load_run`'s dict): load, completed/failed, errors by kind, output
    tok/s, TTFT and TPOT p50/p99 (ms), goodput (req/s) and how tokens were counted. With ``slo``
    (seconds, as ``--slo``) goodput is recomputed from ``requests.jsonl`` at that SLO, so runs taken
    without one (or with different ones) are judged alike; else the run's own goodput is shown."""
    from tandem.worker.bench.metrics import meets_values
    rows = []
    for name, run in runs:
        s = run["summary"]
        goodput = s.get("goodput")
        if slo and run["requests"] is not None:
            good = sum(meets_values(r["status"] == "ok", r.get("ttft"), r.get("tpot"), r.get("e2e"), slo)
                       for r in run["requests"])
            goodput = good / s["duration_s"]
        load = s.get("load") or {}
        rows.append({
            "server": name, "dataset": s.get("dataset"), "load": load.get("describe", "-"),
            "completed": s.get("completed"), "failed": s.get("failed"),
            "errors": ", ".join(f"{k} {v}" for k, v in (s.get("errors_by_kind") or {}).items()) or "-",
            "output_tok_s": s.get("output_throughput"),
            "ttft_p50": (s.get("ttft_ms") or {}).get("p50"), "ttft_p99": (s.get("ttft_ms") or {}).get("p99"),
            "tpot_p50": (s.get("tpot_ms") or {}).get("p50"), "tpot_p99": (s.get("tpot_ms") or {}).get("p99"),
            "goodput": goodput,
            "counted_by": ", ".join(f"{k} {v}" for k, v in (s.get("token_counts") or {}).items()) or "-",
            "length_mismatch": s.get("completion_tokens_mismatch")})
    return rows


SIDE_COLUMNS = (("server", "server"), ("dataset", "dataset"), ("load", "load"),
                ("done / failed", None), ("errors", "errors"), ("output tok/s", "output_tok_s"),
                ("TTFT p50 / p99 (ms)", ("ttft_p50", "ttft_p99")), ("TPOT p50 / p99 (ms)", ("tpot_p50", "tpot_p99")),
                ("goodput (req/s)", "goodput"), ("tokens counted by", "counted_by"),
                ("length != asked", "length_mismatch"))


def _cell(row: dict, key) -> str:
    if key is None:
        return f"{row['completed']} / {row['failed']}"
    if isinstance(key, tuple):
        return " / ".join(_fmt1(row[k]) for k in key)
    return _fmt1(row[key])


def _fmt1(v) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else (f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}")
    return "-" if v is None else str(v)


def side_by_side_markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (for bench/RESULTS.md)."""
    head = [c for c, _ in SIDE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(_cell(r, k) for _, k in SIDE_COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def print_side_by_side(rows: list[dict], title: str = "", console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    t = Table(title=title or "tandem bench compare")
    for c, _ in SIDE_COLUMNS:
        t.add_column(c, justify="left" if c in ("server", "dataset", "load", "errors", "tokens counted by")
                     else "right")
    for r in rows:
        t.add_row(*(_cell(r, k) for _, k in SIDE_COLUMNS))
    console.print(t)
