"""The default metric source: every pod's /metrics, scraped directly (no Prometheus needed).

Each tick the backend (the operator or the local fleet) names its targets: the router(s), and the
prefill and decode workers with their state (ready, starting, draining). The source scrapes them all at
once, keeps each target's scrapes for one window, and turns the difference between the newest scrape
and the oldest one inside the window into a :class:`PoolSnapshot`:

- latency: the percentile of the router's histograms (``role="router"``), from bucket increases summed
  over router replicas: prefill's TTFT of remotely prefilled requests (``prefill="remote"``), decode's
  TPOT (docs/architecture.md: the router sees what the client sees);
- prefill's arrivals and demand: the router's ``tandem:router_requests_received_total`` and
  ``tandem:router_prompt_tokens_total``, counted as requests arrive, every one of them (a prompt
  prefilled on a decode worker is prefill's demand too), per second over the window actually covered;
- decode's arrivals and demand: the router's ``tandem:router_routing_decisions_total`` (counted at the
  first token, when a request joins decode) and the decode workers' ``tandem:generation_tokens_total``;
- running, waiting and KV usage from the workers' gauges, as :func:`decode_queue` reads them: decode's
  waiting leaves out the sequences awaiting their KV from a prefill worker
  (``tandem:num_requests_awaiting_remote_kv``: they wait on prefill) and counts its local prefills
  (``tandem:num_requests_prefilling``) as waiting, not running;
- a router without the arrival counters (an older image) gives prefill's arrivals from its ``remote``
  routing decisions; prefill's demand comes from the prefill workers'
  ``tandem:prompt_tokens_computed_total`` when no router has the counters, and from the newer routers'
  mean prompt when some do (a rollout: :func:`prefill_arrivals`);
- ``router_queued``: the routers' ``tandem:router_queued_requests``.

Signals (snapshot.py): ``no_data`` when no router answered a fresh scrape, or the router has not been
seen across enough of a window to difference (the first ticks after a start); ``idle`` when the routers
answered, nothing arrived or finished in the window, no worker holds a request and the router queues
none; ``ok`` otherwise (the latency may still be None: requests in flight or queued, none finished).

Dead and hung workers: a worker whose last :data:`MISSED_SCRAPES` scrapes failed, and that is ready or
has answered before, is counted ``unresponsive``, not ready: a SIGSTOPped or wedged process has not
exited and a pod's Ready condition lags its probe, so the backend still calls it ready. The policy then
sizes the role without it (and so starts a replacement); it counts again as soon as it answers.
"""
from __future__ import annotations

import collections
import concurrent.futures
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

from tandem.worker.api import metrics as M
from tandem.worker.api.metrics import TPOT, TTFT

from .scrape import Scrape, add_buckets, buckets_delta, counter_delta, histogram_quantile, parse
from .snapshot import PoolSnapshot, Role, RoleSnapshot

WorkerState = Literal["ready", "starting", "draining"]

ROUTED = M.ROUTING_DECISIONS + "_total"
RECEIVED = M.ROUTER_REQUESTS + "_total"
PROMPT_TOKENS = M.ROUTER_PROMPT_TOKENS + "_total"
GENERATED = M.GENERATION_TOKENS + "_total"
COMPUTED = M.PROMPT_TOKENS_COMPUTED + "_total"
#: consecutive failed scrapes after which a worker that has answered is no longer counted as capacity
#: (the router likewise takes a worker out of routing after two missed health polls)
MISSED_SCRAPES = 2
E2E_COUNT = M.E2E + "_count"


@dataclass(frozen=True)
class Worker:
    """One worker process or pod: its base URL (``http://ip:port``) and state."""
    url: str
    state: WorkerState = "ready"
    name: str = ""


@dataclass
class Targets:
    """What to scrape this tick."""
    routers: list[str] = field(default_factory=list)
    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)

    def workers(self, role: Role) -> list[Worker]:
        return self.prefill if role == "prefill" else self.decode


def decode_queue(value: Callable[[str], float], role: Role) -> tuple[float, float]:
    """(running, waiting) of one worker, from ``value(metric name)``, as the simulator counts them
    (operator/simulate/fleet.py): a decode worker's sequences awaiting their KV from a prefill worker
    are prefill's queue, not its own (a prefill worker has none), and its prompts still being prefilled
    there (local prefills) are waiting for decode, not running (a prefill worker's running prompts stay
    running). Never below 0."""
    running, waiting = value(M.RUNNING), value(M.WAITING) - value(M.AWAITING_KV)
    if role == "decode":
        prefilling = value(M.PREFILLING)
        running, waiting = running - prefilling, waiting + prefilling
    return max(0.0, running), max(0.0, waiting)


def fetch_metrics(url: str, timeout: float) -> str:
    """GET ``url``/metrics; raises OSError (URLError included) when it does not answer 200."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return r.read().decode()


def prefill_arrivals(new_n: Optional[float], new_tokens: float, old_n: float) -> tuple[float, Optional[float]]:
    """(requests, prompt tokens) that arrived for prefill over a window: every accepted prompt is
    prefill's demand, wherever it is prefilled, counted on arrival by the routers that have the
    counters (``new_n`` requests and ``new_tokens`` prompt tokens; ``new_n`` None when no router has
    them). A router older than the counters (the router runs the pool's image, which may lag the
    operator's, and both run side by side during a rollout) gives its remote routing decisions
    (``old_n``), its prompts taken at the mean size the newer routers counted. Tokens are None where
    no router counted any: the prefill workers' computed tokens stand in, as before the counters."""
    if new_n is None or (new_n == 0 and old_n > 0):
        return (new_n or 0.0) + old_n, None
    return new_n + old_n, (new_tokens * (new_n + old_n) / new_n if new_n > 0 else new_tokens)


class PodsSource:
    """Scrapes targets and builds snapshots over a sliding window.

    Args:
        window_s: the window rates and percentiles cover (seconds).
        percentiles: the percentile (0..100) each role's target names, e.g. ``{"prefill": 90, "decode": 90}``.
        timeout_s: per-scrape timeout (seconds).
        stale_s: a router scrape older than this is no data (default: the window).
        fetch: ``(url, timeout) -> exposition text``; the default is an HTTP GET of /metrics.
        clock: wall-clock seconds (snapshot.at).
    """

    def __init__(self, window_s: float, percentiles: dict[str, float], timeout_s: float = 2.0,
                 stale_s: Optional[float] = None, fetch: Callable[[str, float], str] = fetch_metrics,
                 clock: Callable[[], float] = time.time):
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s, self.timeout_s = float(window_s), timeout_s
        self.stale_s = stale_s if stale_s is not None else float(window_s)
        self.percentiles = {"prefill": 90.0, "decode": 90.0, **percentiles}
        self.fetch, self.clock = fetch, clock
        self.history: dict[str, collections.deque[Scrape]] = {}
        #: targets that have answered a scrape at least once (a starting pod that never has is starting,
        #: one that has and stopped answering is dead or hung)
        self.answered: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="scrape")

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    # ---- scraping ---------------------------------------------------------------------------
    def _scrape(self, url: str) -> Scrape:
        at = self.clock()
        try:
            return parse(self.fetch(url, self.timeout_s), at)
        except Exception as e:  # noqa: BLE001 - any failure is "no data" for this target
            return Scrape(at=at, ok=False, error=f"{type(e).__name__}: {e}")

    def scrape(self, targets: Targets) -> None:
        """Scrape every target once (concurrently) and keep the results; forget targets that left."""
        urls = list(dict.fromkeys(targets.routers + [w.url for w in targets.prefill + targets.decode]))
        for gone in set(self.history) - set(urls):
            del self.history[gone]
            self.answered.discard(gone)
        for url, s in zip(urls, self._pool.map(self._scrape, urls)):
            h = self.history.setdefault(url, collections.deque())
            h.append(s)
            if s.ok:
                self.answered.add(url)
            # keep one scrape older than the window: the base of the next difference
            while len(h) > 2 and h[1].at <= s.at - self.window_s:
                h.popleft()

    def _pair(self, url: str, now: float, router: bool = False) -> tuple[Optional[Scrape], Optional[Scrape]]:
        """(newest ok scrape if fresh, oldest ok scrape no older than a window before it). A router's
        scrape without the router's series is absent data, not zero traffic."""
        ok = [s for s in self.history.get(url, ()) if s.ok and (not router or ROUTED in s.samples)]
        if not ok or ok[-1].at < now - self.stale_s:
            return None, None
        new = ok[-1]
        base = next((s for s in ok if s.at >= new.at - self.window_s and s is not new), None)
        return new, base

    def unresponsive(self, w: Worker) -> bool:
        """Whether ``w`` is dead or hung: its last :data:`MISSED_SCRAPES` scrapes failed, and it is ready
        (it answered its readiness check) or has answered a scrape before. A process that is SIGSTOPped,
        wedged or gone but not yet removed stays "ready" to its backend (a stopped process has not
        exited; a pod's Ready condition lags its probe), yet serves nothing: it must not be counted as
        capacity. A draining worker is not capacity anyway."""
        if w.state == "draining" or (w.state != "ready" and w.url not in self.answered):
            return False
        recent = list(self.history.get(w.url, ()))[-MISSED_SCRAPES:]
        return len(recent) == MISSED_SCRAPES and not any(s.ok for s in recent)

    # ---- the snapshot -----------------------------------------------------------------------
    def observe(self, targets: Targets, rolling_out: bool = False) -> PoolSnapshot:
        """Scrape now and return the snapshot of the last window."""
        self.scrape(targets)
        return self.snapshot(targets, rolling_out)

    def snapshot(self, targets: Targets, rolling_out: bool = False) -> PoolSnapshot:
        now = self.clock()
        pairs = [self._pair(u, now, router=True) for u in targets.routers]
        fresh = [(n, b) for n, b in pairs if n is not None]
        queued = int(sum(n.sum(M.ROUTER_QUEUED) for n, _ in fresh))
        # a window is covered once some router's base is at least half a window old
        spans = [n.at - b.at for n, b in fresh if b is not None]
        span = max(spans) if spans else 0.0
        no_data = not fresh or span < self.window_s / 2
        newer = [(n, b) for n, b in fresh if RECEIVED in n.samples]
        older = [(n, b) for n, b in fresh if RECEIVED not in n.samples]
        received, tokens = prefill_arrivals(
            sum(counter_delta(n, b, RECEIVED, role="router") for n, b in newer) if newer else None,
            sum(counter_delta(n, b, PROMPT_TOKENS, role="router") for n, b in newer),
            sum(counter_delta(n, b, ROUTED, role="router", decision="remote") for n, b in older))
        roles = {r: self._role(r, targets, fresh, span, no_data, now, queued, received, tokens)
                 for r in ("prefill", "decode")}
        return PoolSnapshot(at=now, prefill=roles["prefill"], decode=roles["decode"], router_queued=queued,
                            rolling_out=rolling_out)

    def _role(self, role: Role, targets: Targets, fresh, span: float, no_data: bool, now: float,
              queued: int, received: float, tokens: Optional[float]) -> RoleSnapshot:
        workers = targets.workers(role)
        counts = collections.Counter("unresponsive" if self.unresponsive(w) else w.state for w in workers)
        common = dict(role=role, ready=counts["ready"], starting=counts["starting"], draining=counts["draining"],
                      unresponsive=counts["unresponsive"])
        if no_data:
            return RoleSnapshot(signal="no_data", window_s=span, **common)
        buckets: dict = {}
        if role == "prefill":
            arrivals, demand = received, tokens or 0.0
            for n, b in fresh:
                buckets = add_buckets(buckets, buckets_delta(n, b, TTFT, role="router", prefill="remote"))
        else:
            arrivals = demand = 0.0
            for n, b in fresh:
                buckets = add_buckets(buckets, buckets_delta(n, b, TPOT, role="router"))
                arrivals += counter_delta(n, b, ROUTED, role="router")
        finished = sum(counter_delta(n, b, E2E_COUNT, role="router") for n, b in fresh)
        latency = histogram_quantile(self.percentiles[role] / 100.0, buckets) if buckets else None
        running = waiting = 0.0
        kv: list[float] = []
        for w in workers:
            new, base = self._pair(w.url, now)
            if new is None:
                continue
            if role == "decode":
                demand += counter_delta(new, base, GENERATED)
            elif tokens is None:
                demand += counter_delta(new, base, COMPUTED)
            run, wait = decode_queue(new.sum, role)
            running += run
            waiting += wait
            if w.state == "ready":
                kv.append(new.sum(M.KV_USAGE))
        # a request the router holds is demand, not idleness: it waits for exactly these workers; nor
        # is a pool whose requests arrived and all await their prefill (decode's own gauges read 0)
        idle = received == 0 and arrivals == 0 and finished == 0 and running == 0 and waiting == 0 and queued == 0
        return RoleSnapshot(
            signal="idle" if idle else "ok", window_s=span, arrivals_per_s=arrivals / span,
            prompt_tokens_per_s=demand / span if role == "prefill" else 0.0,
            output_tokens_per_s=demand / span if role == "decode" else 0.0,
            running=running, waiting=waiting, kv_usage=sum(kv) / len(kv) if kv else 0.0,
            latency=latency, **common)
