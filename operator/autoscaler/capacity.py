"""Per-replica latency and capacity at the SLO, from a calibration (the performance model the policy and
the simulator share).

Units: seconds, tokens, bytes. Two roles, two models:

- prefill: a replica serves remote prefills one at a time (first come, first served); a request holds it
  for :meth:`PerfModel.remote_prefill_seconds` (the prefill compute, or the KV push when that is longer,
  since on the measured CPU fleet the push is the longer part and both run on the worker's cores).
  With Poisson arrivals at utilization rho the wait is M/G/1's: P(W > t) ~= rho exp(-t / w), with
  w = s (1 + cv^2) / (2 (1 - rho)) the mean wait of a request that does wait (Kingman's heavy-traffic
  approximation, exponential tail). p90 TTFT = s + that tail's 90th percentile.
- decode: continuous batching; every running sequence advances one token per step, and a step of
  ``b`` sequences costs ``decode_step_seconds(b, context)``. A sequence's TPOT is the mean step over
  its life, so the p90 TPOT at ``m`` mean running sequences per replica is taken at an effective batch
  1 + m + z sqrt(m) / 2 (one's own sequence, the Poisson mean of the others, and half the 90th
  percentile's spread: the mean over a sequence's life halves the spread of a point sample),
  interpolated linearly between integer batches.

Both are first-order models; the policy multiplies their latency by a correction learned online
(observed / predicted), as Dynamo's planner corrects its profiled interpolation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

#: KV bytes per token of SmolLM2-135M in float32 (30 layers x 3 KV heads x 64 dims x K and V x 4 bytes),
#: the model the committed calibration measured; the calibration's ``engine.kv_bytes_per_token``
#: overrides it when present.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4

Z90 = 1.2816   # the standard normal's 90th percentile


def _bisect(f, lo: float, hi: float, iters: int = 50) -> float:
    """The largest x in [lo, hi] with f(x) true, for f true at lo and monotone (true, then false)."""
    if f(hi):
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class PerfModel:
    """Latency of one replica of each role, from a :class:`~tandem.worker.bench.calibration.Calibration`.

    Args:
        calibration: the fitted formulas (prefill, decode_step, optional kv_transfer).
        kv_bytes_per_token: bytes of KV one prompt token moves from prefill to decode.
        cv2: squared coefficient of variation of the prefill service time (1 for exponential, 0 for fixed
            lengths); 0.5 suits log-normal prompt lengths with sigma near 0.3-0.5.
    """
    calibration: object
    kv_bytes_per_token: float = SMOLLM2_KV_BYTES_PER_TOKEN
    cv2: float = 0.5

    @classmethod
    def of(cls, calibration) -> Optional["PerfModel"]:
        if calibration is None:
            return None
        bpt = (calibration.engine or {}).get("kv_bytes_per_token", SMOLLM2_KV_BYTES_PER_TOKEN)
        return cls(calibration, float(bpt))

    # ---- prefill ----------------------------------------------------------------------------
    def local_prefill_seconds(self, prompt_tokens: float) -> float:
        """Prefill computed where the sequence decodes (no KV transfer), seconds."""
        return max(1e-4, self.calibration.prefill_seconds(prompt_tokens))

    def remote_prefill_seconds(self, prompt_tokens: float) -> float:
        """TTFT of one remote prefill on an idle prefill replica, and the time it holds that replica (s)."""
        p = self.local_prefill_seconds(prompt_tokens)
        kv = self.calibration.kv_transfer_seconds(prompt_tokens * self.kv_bytes_per_token)
        return p if kv is None else max(p, kv)

    def prefill_p90(self, rho: float, service_s: float) -> float:
        """p90 TTFT (s) of a prefill replica at utilization ``rho`` with mean service ``service_s``."""
        if rho >= 1:
            return math.inf
        if rho <= 0.1:
            return service_s
        w = service_s * (1 + self.cv2) / (2 * (1 - rho))
        return service_s + w * math.log(10 * rho)

    def prefill_capacity(self, target_s: float, service_s: float, correction: float = 1.0) -> float:
        """Utilization per replica (erlangs: busy seconds per second) at which the corrected p90 TTFT
        meets ``target_s``; 0 when even an idle replica misses it."""
        if correction * service_s > target_s:
            return 0.0
        return _bisect(lambda r: correction * self.prefill_p90(r, service_s) <= target_s, 0.0, 0.99)

    # ---- decode -----------------------------------------------------------------------------
    def decode_step_seconds(self, batch: float, context: float) -> float:
        """One decode step (s) at a possibly fractional ``batch``, interpolated between integers."""
        batch = max(1.0, batch)
        lo = math.floor(batch)
        f = self.calibration.decode_step_seconds
        a = f(lo, context)
        if batch == lo:
            return max(1e-4, a)
        return max(1e-4, a + (batch - lo) * (f(lo + 1, context) - a))

    def decode_p90(self, running: float, context: float) -> float:
        """p90 TPOT (s) at ``running`` mean sequences per replica of mean KV length ``context``."""
        m = max(0.0, running)
        return self.decode_step_seconds(1 + m + Z90 * math.sqrt(m) / 2, context)

    def decode_capacity(self, target_s: float, context: float, correction: float = 1.0,
                        most: float = 512.0) -> float:
        """Mean running sequences per replica at which the corrected p90 TPOT meets ``target_s``."""
        if correction * self.decode_step_seconds(1, context) > target_s:
            return 0.0
        return _bisect(lambda m: correction * self.decode_p90(m, context) <= target_s, 0.0, most)
