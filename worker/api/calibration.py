"""The performance model the simulator and the autoscaler read: fitted formulas, versioned YAML.

The contract between ``tandem bench calibrate``, which fits it against a running worker
(worker/bench/calibrate.py), and the autoscaler and the simulator, which predict latencies from it
(operator/autoscaler/capacity.py); each formula is written once, here, as a function of its
coefficients that takes floats or numpy arrays alike.

Formulas (seconds; fitted by non-negative least squares, scipy.optimize.nnls, so every term keeps its
physical sign):
- ``prefill``: a + b*n + c*n^2 + d*n*k, n = prompt tokens computed, k = cached-prefix tokens (the n*k
  term is attention of the new tokens over the cached ones). Measured as the TTFT of a 1-token request.
- ``decode_step``: d + g*(batch>1) + e*batch + f*batch*context, context = tokens in each sequence's
  KV. The (batch>1) step is the jump from a matrix-vector to a matrix-matrix product: measured on the
  CPU, batch 1 took 53 ms and batch 2 95 ms, batch 4 99 ms, batch 8 113 ms; a line through batch 1
  misses every other batch by 30%. On a GPU g comes out near 0.
- ``kv_transfer`` (optional): g + h*bytes, the decode worker's wait for a remote prefill's KV
  (``tandem:kv_transfer_seconds``: handshake, the prefill worker's compute, which the streamed KV
  overlaps, and the writes into the decode worker's cache).
An optional ``capacity`` section is not a fit but a measurement of the autoscaler's model against
these fits: ``prefill_factor``, the ratio of the prefill load a pool really serves at its TTFT target
to what the model's one-prompt-at-a-time queue sizes it for (``bench/capacity_by_size.py --role prefill
--write``), which caps how far the autoscaler's capacity probe raises its factor.
The schema is in docs/bench.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

API_VERSION = "bench.tandem.dev/v1"
KIND = "Calibration"


def prefill_formula(coef, n, k):
    """Prefill seconds of ``n`` computed prompt tokens over ``k`` cached ones: a + b*n + c*n^2 + d*n*k."""
    a, b, c, d = coef
    return a + b * n + c * n * n + d * n * k


def decode_step_formula(coef, batch, context):
    """Seconds of one decode step of ``batch`` sequences of ``context`` KV tokens each:
    d + g*(batch>1) + e*batch + f*batch*context."""
    d, g, e, f = coef
    return d + g * (batch > 1) + e * batch + f * batch * context


def kv_transfer_formula(coef, nbytes):
    """Seconds the decode worker waits for ``nbytes`` of remote KV: g + h*bytes."""
    g, h = coef
    return g + h * nbytes


@dataclass(frozen=True)
class Formula:
    name: str
    text: str
    inputs: tuple[str, ...]
    coefficients: tuple[str, ...]
    value: Callable    # value(coef, *inputs): the formula itself, linear in its coefficients

    def terms(self, x: np.ndarray) -> np.ndarray:
        """The design matrix (one column per coefficient) for inputs ``x`` of shape (points, inputs):
        column i is the formula evaluated with coefficient i set to 1 and the others to 0."""
        x = np.atleast_2d(np.asarray(x, dtype=float))
        cols = [x[:, i] for i in range(x.shape[1])]
        unit = np.eye(len(self.coefficients))
        return np.column_stack([np.broadcast_to(self.value(u, *cols), (len(x),)) for u in unit])


FORMULAS = {
    "prefill": Formula("prefill", "a + b*n + c*n^2 + d*n*k", ("n", "k"), ("a", "b", "c", "d"), prefill_formula),
    "decode_step": Formula("decode_step", "d + g*(batch>1) + e*batch + f*batch*context", ("batch", "context"),
                           ("d", "g", "e", "f"), decode_step_formula),
    "kv_transfer": Formula("kv_transfer", "g + h*bytes", ("bytes",), ("g", "h"), kv_transfer_formula),
}


@dataclass
class Fit:
    formula: Formula
    coef: np.ndarray
    samples: list[list[float]] = field(default_factory=list)   # inputs..., seconds

    def predict(self, *inputs) -> float:
        """Seconds for one point, e.g. ``predict(n, k)`` for prefill."""
        return float((self.formula.terms([inputs]) @ self.coef)[0])

    def quality(self) -> dict:
        """r2, mean and max absolute relative error over the fitted samples."""
        s = np.asarray(self.samples, dtype=float)
        y, yhat = s[:, -1], self.formula.terms(s[:, :-1]) @ self.coef
        rel = np.abs(yhat - y) / np.maximum(y, 1e-12)
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1 - float(((y - yhat) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
        return {"points": int(len(y)), "r2": round(r2, 4), "mean_abs_rel_err": round(float(rel.mean()), 4),
                "max_abs_rel_err": round(float(rel.max()), 4)}

    def ranges(self) -> dict:
        """{input name: [least, most]} over the fitted samples: where the fit was measured."""
        s = np.asarray(self.samples, dtype=float)
        return {name: [float(s[:, i].min()), float(s[:, i].max())] for i, name in enumerate(self.formula.inputs)}

    def to_dict(self) -> dict:
        return {"formula": self.formula.text, "unit": "seconds",
                "coefficients": {k: float(v) for k, v in zip(self.formula.coefficients, self.coef)},
                "fit": self.quality(), "range": self.ranges(),
                "samples": [[float(v) for v in row] for row in self.samples]}


def fit(name: str, samples: list[list[float]]) -> Fit:
    """Fit formula ``name`` to ``samples`` (rows of inputs..., seconds) with non-negative coefficients.

    Raises ValueError with fewer samples than coefficients."""
    from scipy.optimize import nnls
    f = FORMULAS[name]
    s = np.asarray(samples, dtype=float)
    if len(s) < len(f.coefficients):
        raise ValueError(f"{name}: {len(s)} samples for {len(f.coefficients)} coefficients")
    # relative least squares: each point weighs by 1/y, so small prompts count as much as large ones
    w = 1.0 / np.maximum(s[:, -1], 1e-9)
    coef, _ = nnls(f.terms(s[:, :-1]) * w[:, None], s[:, -1] * w)
    return Fit(f, coef, s.tolist())


@dataclass
class Calibration:
    """A loaded calibration file. ``fits`` holds ``prefill`` and ``decode_step``, maybe ``kv_transfer``;
    ``capacity`` the optional measured factors (``prefill_factor``: a positive float; ``measured``: how)."""
    model: str
    fits: dict[str, Fit]
    measured: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    capacity: dict = field(default_factory=dict)

    def prefill_seconds(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted prefill latency (s) of a prompt with ``cached_tokens`` of it already cached."""
        return self.fits["prefill"].predict(prompt_tokens - cached_tokens, cached_tokens)

    def decode_step_seconds(self, batch: int, context: float) -> float:
        """Predicted decode step (s) for ``batch`` sequences of mean KV length ``context`` tokens."""
        return self.fits["decode_step"].predict(batch, context)

    def kv_transfer_seconds(self, nbytes: float) -> float | None:
        f = self.fits.get("kv_transfer")
        return None if f is None else f.predict(nbytes)

    def to_dict(self) -> dict:
        return {"apiVersion": API_VERSION, "kind": KIND, "model": self.model, "measured": self.measured,
                "engine": self.engine, **{k: f.to_dict() for k, f in self.fits.items()},
                **({"capacity": self.capacity} if self.capacity else {})}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False, width=120))

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """Raises ValueError for another apiVersion/kind, a missing prefill or decode_step section, or a
        ``capacity.prefill_factor`` that is not a positive finite number."""
        if d.get("apiVersion") != API_VERSION or d.get("kind") != KIND:
            raise ValueError(f"not a calibration ({API_VERSION}, kind {KIND}): "
                             f"{d.get('apiVersion')}, {d.get('kind')}")
        fits = {}
        for name, formula in FORMULAS.items():
            sec = d.get(name)
            if sec is None:
                if name != "kv_transfer":
                    raise ValueError(f"calibration has no {name} section")
                continue
            coef = np.array([float(sec["coefficients"][c]) for c in formula.coefficients])
            fits[name] = Fit(formula, coef, sec.get("samples", []))
        capacity = d.get("capacity") or {}
        if not isinstance(capacity, dict):
            raise ValueError(f"calibration capacity: a mapping, not {capacity!r}")
        capacity = dict(capacity)
        v = capacity.get("prefill_factor")
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"calibration capacity.prefill_factor: a positive finite number, not {v!r}")
            capacity["prefill_factor"] = float(v)
        return cls(d.get("model", ""), fits, d.get("measured", {}), d.get("engine", {}), capacity)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """A calibration file, or a Kubernetes ConfigMap manifest holding one under ``calibration.yaml``.

        Raises OSError when unreadable, ValueError when it is not a calibration."""
        d = yaml.safe_load(Path(path).read_text())
        if isinstance(d, dict) and d.get("kind") == "ConfigMap":
            d = yaml.safe_load((d.get("data") or {}).get("calibration.yaml", "") or "{}")
        return cls.from_dict(d or {})
