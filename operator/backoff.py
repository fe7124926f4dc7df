"""Per-pool retry delays of the operator's reconcile loop (operator/work_queue.py)."""
from __future__ import annotations

import random
import time
from typing import Optional

#: Transient failures of a pool are retried after RETRY_BASE_SECONDS, doubling up to RETRY_MAX_SECONDS.
RETRY_BASE_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0


class Backoff:
    """Per-pool retry delays after transient API errors (403 quota, 404, 409, 429, 5xx, no answer):
    5 s, 10 s, 20 s ... 300 s, with +-20 % jitter. A new generation (a spec change) retries at once."""

    def __init__(self, base: float = RETRY_BASE_SECONDS, cap: float = RETRY_MAX_SECONDS):
        self.base, self.cap = base, cap
        self._by_pool: dict[tuple[str, str], tuple[int, float, Optional[int]]] = {}

    def failed(self, key: tuple[str, str], generation: Optional[int]) -> float:
        """Record a failure; returns the delay in seconds before the next try."""
        n = self._by_pool.get(key, (0, 0.0, None))[0] + 1
        delay = min(self.base * 2 ** (n - 1), self.cap) * random.uniform(0.8, 1.2)
        self._by_pool[key] = (n, time.monotonic() + delay, generation)
        return delay

    def succeeded(self, key: tuple[str, str]) -> None:
        self._by_pool.pop(key, None)

    def waiting(self, key: tuple[str, str], generation: Optional[int]) -> bool:
        e = self._by_pool.get(key)
        return e is not None and e[2] == generation and time.monotonic() < e[1]

    def due(self, key: tuple[str, str]) -> bool:
        """Whether a failed pool's retry time has come."""
        e = self._by_pool.get(key)
        return e is not None and time.monotonic() >= e[1]

    def next_due(self) -> Optional[float]:
        """Seconds until the earliest retry, or None."""
        if not self._by_pool:
            return None
        return max(0.0, min(e[1] for e in self._by_pool.values()) - time.monotonic())
