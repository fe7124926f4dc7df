"""Per-replica latency and capacity at the SLO, from a calibration (the performance model the policy and
the simulator share).

Units: seconds, tokens, bytes. Two roles, two models:

- prefill: a replica serves remote prefills one at a time (first come, first served); a request holds it
  for :meth:`PerfModel.remote_prefill_seconds` (the prefill compute, or the KV push when that is longer,
  since on the measured CPU fleet the push is the longer part and both run on the worker's cores).
  With Poisson arrivals at utilization rho the wait is M/G/1's: P(W > t) ~= rho exp(-t / w), with
  w = s (1 + cv^2) / (2 (1 - rho)) the mean wait of a request that does wait (Kingman's heavy-traffic
  approximation, exponential tail). p90 TTFT = s + that tail's 90th percentile. The engine in fact
  prefills the prompts waiting at a step together (:meth:`PerfModel.remote_prefill_batch_seconds`,
  which the simulator uses), so under a queue a replica serves more than this model says: the
  policy's prefill sizing errs on the side of more replicas.
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

from tandem.worker.api.calibration import decode_step_formula

#: KV bytes per token of SmolLM2-135M in float32 (30 layers x 3 KV heads x 64 dims x K and V x 4 bytes),
#: the model the committed calibration measured; the calibration's ``engine.kv_bytes_per_token``
#: overrides it when present.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4

Z90 = 1.2816   # the standard normal's 90th percentile


def erlang_c(c: int, a: float) -> float:
    """Erlang C: the chance that an arrival waits in an M/M/c queue with offered load ``a`` erlangs."""
    if a >= c:
        return 1.0
    term, total = 1.0, 1.0          # a^k / k!, summed for k < c
    for k in range(1, c):
        term *= a / k
        total += term
    last = term * a / c * c / (c - a)
    return last / (total + last)


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
    """Latency of one replica of each role, from a :class:`~tandem.worker.api.calibration.Calibration`.

    Args:
        calibration: the fitted formulas (prefill, decode_step, optional kv_transfer).
        kv_bytes_per_token: bytes of KV one prompt token moves from prefill to decode.
        cv2: squared coefficient of variation of the prefill service time (1 for exponential, 0 for fixed
            lengths); 0.2 covers log-normal prompt lengths with sigma up to about 0.4.
    """
    calibration: object
    kv_bytes_per_token: float = SMOLLM2_KV_BYTES_PER_TOKEN
    cv2: float = 0.2

    def __post_init__(self):
        # The formulas of worker/api/calibration.py on plain floats: the simulator evaluates them some
        # 10^5 times a run, and numpy's per-call overhead made that most of its time. A test checks that
        # both agree.
        fits = self.calibration.fits
        self._pf = tuple(float(x) for x in fits["prefill"].coef)
        self._ds = tuple(float(x) for x in fits["decode_step"].coef)
        kv = fits.get("kv_transfer")
        self._kv = None if kv is None else tuple(float(x) for x in kv.coef)
        self._remote: dict = {}
        #: the measured prefill capacity factor (the calibration's ``capacity.prefill_factor``), or None
        self.prefill_factor: Optional[float] = self.calibration.capacity.get("prefill_factor")

    @classmethod
    def of(cls, calibration) -> Optional["PerfModel"]:
        if calibration is None:
            return None
        bpt = (calibration.engine or {}).get("kv_bytes_per_token", SMOLLM2_KV_BYTES_PER_TOKEN)
        return cls(calibration, float(bpt))

    # ---- prefill ----------------------------------------------------------------------------
    def local_prefill_seconds(self, prompt_tokens: float) -> float:
        """Prefill computed where the sequence decodes (no KV transfer), seconds."""
        a, b, c, _ = self._pf   # no cached prefix here: the n*k term is 0
        n = float(prompt_tokens)
        return max(1e-4, a + b * n + c * n * n)

    def cached_prefill_seconds(self, prompt_tokens: float, cached_tokens: float = 0.0) -> float:
        """Prefill compute (s) of a prompt whose first ``cached_tokens`` are in the prefix cache: the
        calibration's a + b*n + c*n^2 + d*n*k at n = the uncached tokens, k = the cached ones."""
        a, b, c, d = self._pf
        n, k = max(0.0, float(prompt_tokens) - cached_tokens), float(cached_tokens)
        return max(1e-4, a + b * n + c * n * n + d * n * k)

    def kv_transfer_seconds(self, prompt_tokens: float) -> float:
        """The prefill-to-decode KV transfer of a whole prompt (s) by the calibration's fit (0 without one)."""
        if self._kv is None:
            return 0.0
        return self._kv[0] + self._kv[1] * prompt_tokens * self.kv_bytes_per_token

    def remote_prefill_seconds(self, prompt_tokens: float) -> float:
        """TTFT of one remote prefill on an idle prefill replica, and the time it holds that replica (s)."""
        got = self._remote.get(prompt_tokens)
        if got is None:
            p = self.local_prefill_seconds(prompt_tokens)
            if self._kv is not None:
                p = max(p, self._kv[0] + self._kv[1] * prompt_tokens * self.kv_bytes_per_token)
            got = self._remote[prompt_tokens] = p
        return got

    def remote_prefill_batch_seconds(self, prompts: list) -> float:
        """Time (s) a prefill replica takes over one engine step that prefills ``prompts`` (token counts)
        together and pushes their KV: the batch's compute (the fit's fixed cost once, its linear term on
        the sum of tokens, its quadratic attention term per prompt), then the longest of the prompts'
        transfer tails (what one prompt's remote prefill takes past its compute). The KV streams out
        while the step computes, so a batch's pushes end one tail after its compute, not one push per
        prompt later (the back-to-back steps of a real CPU fleet at 80% load took 1.05 s for two
        128-token prompts and 1.53 s for three, against 1.06 s and 1.48 s by this model; bench/RESULTS.md).
        One prompt gives :meth:`remote_prefill_seconds`. The engine batches the prompts waiting at a
        step up to its token budget (chunked prefill, as vLLM's scheduler does), which is where a queue
        drains faster than one prompt at a time."""
        if len(prompts) == 1:
            return self.remote_prefill_seconds(prompts[0])
        a, b, c, _ = self._pf
        compute = max(1e-4, a + b * float(sum(prompts)) + c * sum(float(n) * n for n in prompts))
        tail = max(self.remote_prefill_seconds(n) - self.local_prefill_seconds(n) for n in prompts)
        return compute + tail

    def prefill_p90(self, rho: float, service_s: float, cv2: Optional[float] = None) -> float:
        """p90 TTFT (s) of a prefill replica at utilization ``rho`` with mean service ``service_s`` and
        squared coefficient of variation ``cv2`` (default: the model's)."""
        if rho >= 1:
            return math.inf
        if rho <= 0.1:
            return service_s
        w = service_s * (1 + (self.cv2 if cv2 is None else cv2)) / (2 * (1 - rho))
        return service_s + w * math.log(10 * rho)

    def prefill_pool_p90(self, replicas: int, load: float, service_s: float,
                         base_s: Optional[float] = None) -> float:
        """p90 TTFT (s) of ``replicas`` prefill replicas fed ``load`` erlangs (arrivals/s x service s) by a
        router that sends each prompt to the replica with the least work queued: the pool acts as one
        M/G/c queue. Erlang C gives the chance to wait; the wait's tail is exponential at rate
        (c - a) / s, stretched by (1 + cv^2) / 2 (Allen-Cunneen). ``base_s``: the p90 without a wait
        (default ``service_s``, the mean service, as sizing uses it)."""
        c, a = int(replicas), float(load)
        base = service_s if base_s is None else base_s
        if c <= 0 or a >= c:
            return math.inf
        if a <= 0:
            return base
        wait = erlang_c(c, a)
        if wait <= 0.1:
            return base
        return base + math.log(10 * wait) * service_s * (1 + self.cv2) / (2 * (c - a))

    def prefill_pool_load(self, replicas: int, p90_s: float, service_s: float,
                          base_s: Optional[float] = None) -> float:
        """The most load (erlangs) at which ``replicas`` prefill replicas keep their p90 TTFT
        (:meth:`prefill_pool_p90`, s) within ``p90_s``: the load a measured p90 allows at most (0 when
        even an idle pool's p90 is above it)."""
        return _bisect(lambda a: self.prefill_pool_p90(replicas, a, service_s, base_s) <= p90_s,
                       0.0, replicas * 0.999)

    def prefill_replicas(self, load: float, service_s: float, target_s: float, most: int = 10000) -> int:
        """The fewest prefill replicas whose p90 TTFT meets ``target_s`` at ``load`` erlangs; ``most`` when
        none does (the service alone misses the target)."""
        if service_s > target_s:
            return most
        c = max(1, math.ceil(load))
        while c < most and self.prefill_pool_p90(c, load, service_s) > target_s:
            c += 1
        return c

    def prefill_capacity(self, target_s: float, service_s: float, correction: float = 1.0,
                         cv2: Optional[float] = None) -> float:
        """Utilization per replica (erlangs: busy seconds per second) at which the corrected p90 TTFT
        meets ``target_s``; 0 when even an idle replica misses it."""
        if correction * service_s > target_s:
            return 0.0
        return _bisect(lambda r: correction * self.prefill_p90(r, service_s, cv2) <= target_s, 0.0, 0.99)

    def service_moments(self, prompts) -> tuple[float, float]:
        """(mean, squared coefficient of variation) of the remote-prefill service (s) over ``prompts``
        (token counts): what a queue of these prompts sees. With heavy-tailed lengths the mean service
        is well above the service of the mean prompt (the fit's quadratic term), and cv^2 above 1."""
        xs = [self.remote_prefill_seconds(float(n)) for n in prompts]
        if not xs:
            return 0.0, 0.0
        mean = sum(xs) / len(xs)
        var = sum((x - mean) ** 2 for x in xs) / len(xs)
        return mean, (var / (mean * mean) if mean > 0 else 0.0)

    # ---- decode -----------------------------------------------------------------------------
    def decode_step_seconds(self, batch: float, context: float) -> float:
        """One decode step (s) at a possibly fractional ``batch``, interpolated between integers."""
        batch = max(1.0, batch)
        lo = math.floor(batch)
        coef = self._ds

        def f(b, c):
            return decode_step_formula(coef, b, c)
        a = f(lo, context)
        if batch == lo:
            return max(1e-4, a)
        return max(1e-4, a + (batch - lo) * (f(lo + 1, context) - a))

    def decode_slots(self, target_s: float, context: float) -> tuple[float, float]:
        """(sequences one replica can batch at the SLO, step seconds at that batch): the largest batch B
        whose step meets ``target_s``, plus the fraction of its life a sequence may spend at batch B + 1
        before its mean step misses the target. (0, inf) when even batch 1 misses it."""
        f = self.decode_step_seconds
        if f(1, context) > target_s:
            return 0.0, math.inf
        b = 1
        while b < 4096 and f(b + 1, context) <= target_s:
            b += 1
        lo, hi = f(b, context), f(b + 1, context)
        frac = (target_s - lo) / (hi - lo) if hi > lo else 0.0
        return b + min(0.99, max(0.0, frac)), lo

    def decode_replicas(self, tokens_per_s: float, context: float, target_s: float, most: int = 10000,
                        hold_s_per_token: float = 0.0) -> int:
        """The fewest decode replicas whose p90 TPOT meets ``target_s`` at ``tokens_per_s`` generated.

        The router sends each request to the decode replica with the fewest in flight, so a sequence is
        batched past the SLO's batch only when every replica is full: the pool acts as an M/G/c queue
        whose servers are the replicas' whole batch slots at the SLO (:meth:`decode_slots`), its load the
        requests in flight there (tokens/s x the step at that batch), and it meets the p90 when Erlang C
        says fewer than 10% of requests find every slot taken.

        ``hold_s_per_token``: seconds a request holds its decode replica's place before it decodes, per
        token it will generate (its time to first token over its output tokens). The router picks the
        decode replica at arrival and counts the requests still being prefilled as in flight
        (worker/router/policy.py ``pick_decode``), so they take a place in the balance as a running
        sequence does; 0 sizes for the running sequences alone (the scenarios' peak rule). A held place
        costs no compute: it moves the balance, so that a running sequence lands on another replica. The
        router keeps the replicas' in-flight counts within one of each other, so a hold displaces about
        one running sequence per replica, which fills a replica of one slot (the CPU calibration) and
        one of ``k`` slots only in one case of ``k``: the hold is counted at ``1 / whole slots`` of its
        time (on the Azure code trace with the H200 calibration, ~20 slots a replica, counting it whole
        held 4.8 decode replicas where 3 met the SLO in every minute)."""
        slots, step = self.decode_slots(target_s, context)
        if slots <= 0:
            return most
        whole, load = self._decode_queue(tokens_per_s, slots, step, hold_s_per_token)
        c = max(1, math.ceil(load / whole))
        while c < most and erlang_c(c * whole, load) > 0.1:
            c += 1
        return c

    def decode_wait_share(self, replicas: int, tokens_per_s: float, context: float, target_s: float,
                          hold_s_per_token: float = 0.0) -> float:
        """The share of requests that find every decode slot taken (0..1), by Erlang C on the M/G/c queue
        :meth:`decode_replicas` sizes for (same arguments; ``replicas`` the servers' replicas): the
        share that method keeps under 0.1. 1.0 when even a batch of one misses ``target_s`` or there is
        no replica."""
        slots, step = self.decode_slots(target_s, context)
        if slots <= 0 or replicas <= 0:
            return 1.0
        whole, load = self._decode_queue(tokens_per_s, slots, step, hold_s_per_token)
        return erlang_c(replicas * whole, load)

    @staticmethod
    def _decode_queue(tokens_per_s: float, slots: float, step: float, hold_s_per_token: float
                      ) -> tuple[int, float]:
        """(servers per replica, load in erlangs) of decode's M/G/c queue (:meth:`decode_replicas`)."""
        # whole slots only: a sequence that must share past them tends to share for much of its life,
        # so the fractional allowance is left as margin
        whole = max(1, int(slots))
        return whole, tokens_per_s * (step + max(0.0, hold_s_per_token) / whole)

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
