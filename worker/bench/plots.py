"""PNG plots (matplotlib, headless): latency CDFs of a run, and throughput and latency against
request rate for a sweep."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.worker.bench.runner import RunResult


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(result: RunResult, path: str | Path, title: str = "") -> None:
    """TTFT, TPOT, ITL and E2E empirical CDFs (ms) of the successful requests, one panel each."""
    plt = _plt()
    ok = [r for r in result.records if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [g for r in ok for g in r.itls], "E2E": [r.e2e for r in ok]}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (name, vals) in zip(axes, series.items()):
        x = np.sort(np.asarray(vals, dtype=float) * 1000.0)
        if x.size:
            ax.step(x, np.arange(1, x.size + 1) / x.size, where="post")
        ax.set_title(f"{name} CDF (n={x.size})")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"{result.dataset_kind}: {result.load.describe()}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def sweep_plot(points: list[dict], path: str | Path, title: str = "") -> None:
    """Throughput and p50/p90 TTFT and TPOT against the offered request rate, one point per rate."""
    plt = _plt()
    rates = [p["load"]["request_rate"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(rates, [p["request_throughput"] for p in points], "o-", label="completed")
    if points and points[0].get("goodput") is not None:
        axes[0].plot(rates, [p["goodput"] for p in points], "s--", label="goodput")
    axes[0].plot(rates, rates, ":", color="grey", label="offered")
    axes[0].set_ylabel("requests/s")
    axes[0].set_title("throughput vs rate")
    for ax, key, name in ((axes[1], "ttft_ms", "TTFT"), (axes[2], "tpot_ms", "TPOT")):
        for stat in ("p50", "p90"):
            ax.plot(rates, [p[key][stat] for p in points], "o-", label=f"{name} {stat}")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs rate")
    for ax in axes:
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def compare_cdfs(runs: list[tuple[str, list[dict]]], path: str | Path, title: str = "") -> None:
    """TTFT and TPOT empirical CDFs (ms), one line per run (name, rows of its ``requests.jsonl``):
    the successful requests only, as in the summary."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key in zip(axes, ("ttft", "tpot")):
        for name, rows in runs:
            x = np.sort([r[key] * 1000.0 for r in rows if r["status"] == "ok" and r.get(key) is not None])
            if x.size:
                ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=f"{name} (n={x.size})")
        ax.set_title(f"{key.upper()} CDF")
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
