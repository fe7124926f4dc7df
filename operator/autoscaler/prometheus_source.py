"""The Prometheus metric source: the same snapshot as :class:`PodsSource`, from the Prometheus HTTP API
(``GET /api/v1/query``) over the series Prometheus scraped from the same pods.

The built-in queries mirror the pods source over a ``[window]`` range (``rate`` and ``increase``
handle counter resets; ``histogram_quantile`` is the same interpolation):

- prefill latency: ``histogram_quantile(q, sum by (le) (rate(tandem:time_to_first_token_seconds_bucket
  {role="router", pool=P, prefill="remote"}[W])))``; decode: the same over
  ``tandem:request_time_per_output_token_seconds_bucket``. ``spec.autoscaling.metrics.queries.ttft`` and
  ``.tpot`` replace them (any PromQL answering seconds; ``$pool``, ``$window`` and ``$quantile`` are
  substituted);
- prefill's arrivals and demand from the routers' ``tandem:router_requests_received_total`` and
  ``tandem:router_prompt_tokens_total`` (counted on arrival; a router without them gives its remote
  routing decisions, instance by instance with PromQL's ``unless on (instance)``, combined as
  :func:`~.pods_source.prefill_arrivals` does), decode's from
  ``tandem:router_routing_decisions_total`` and the decode workers' ``tandem:generation_tokens_total``;
  running, waiting and KV usage from the workers' gauges (decode's queue as
  :func:`~.pods_source.decode_queue` reads it), ``router_queued`` from the routers' gauge.

Signals: ``no_data`` when Prometheus does not answer, or holds no current router series of the pool
(a failed or stale scrape leaves the instant vector empty: Prometheus' staleness handling); ``idle``
and ``ok`` as in the pods source. Replica counts (ready, starting, draining) come from the backend's
targets, as Prometheus does not know which pod is draining.

Dead and hung workers, as in the pods source: a worker whose target Prometheus failed to scrape
(``up{instance="host:port"} == 0``, the series every scrape writes), and that is ready or has been
scraped before, is counted ``unresponsive`` and not as capacity; it counts again once ``up`` is 1. The
``instance`` label is the scraped address, which is the worker's own (``Worker.url``) in the pods'
and file-based discovery that tandem's chart and tests use.
"""
from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
import urllib.request
from typing import Callable, Optional

from tandem.worker.api import metrics as M

from .pods_source import Targets, Worker, decode_queue, prefill_arrivals
from .snapshot import PoolSnapshot, Role, RoleSnapshot


class PrometheusError(Exception):
    """Prometheus did not answer a query, or answered an error (message from the API)."""


class PrometheusSource:
    """Builds snapshots from PromQL.

    Args:
        url: Prometheus' base URL (``http://prometheus:9090``).
        pool: the pool name (the ``pool`` label every tandem series carries).
        window_s: the range of ``rate``/``increase`` (seconds; at least two scrape intervals).
        percentiles: each role's target percentile (0..100).
        queries: ``spec.autoscaling.metrics.queries`` (ttft / tpot overrides) or None.
        timeout_s: per-query timeout (seconds).
        clock: wall-clock seconds (snapshot.at and the query's evaluation time).
    """

    def __init__(self, url: str, pool: str, window_s: float, percentiles: dict[str, float], queries=None,
                 timeout_s: float = 5.0, clock: Callable[[], float] = time.time):
        self.url, self.pool, self.window_s = url.rstrip("/"), pool, float(window_s)
        self.percentiles = {"prefill": 90.0, "decode": 90.0, **percentiles}
        self.overrides = {"ttft": getattr(queries, "ttft", None), "tpot": getattr(queries, "tpot", None)}
        self.timeout_s, self.clock = timeout_s, clock
        self.answered: set[str] = set()   # instances Prometheus has scraped with success

    def close(self) -> None:
        pass

    # ---- PromQL -----------------------------------------------------------------------------
    def query(self, promql: str, at: Optional[float] = None) -> list[tuple[dict, float]]:
        """An instant query: ``[(labels, value)]``. Raises PrometheusError."""
        q = {"query": promql}
        if at is not None:
            q["time"] = f"{at:.3f}"
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(q)}",
                                        timeout=self.timeout_s) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                doc = json.loads(e.read())
            except ValueError:
                raise PrometheusError(f"HTTP {e.code} for {promql!r}") from None
        except (OSError, ValueError) as e:
            raise PrometheusError(f"{type(e).__name__}: {e}") from None
        if doc.get("status") != "success":
            raise PrometheusError(f"{doc.get('errorType')}: {doc.get('error')} (query {promql!r})")
        data = doc.get("data") or {}
        if data.get("resultType") == "scalar":
            return [({}, float(data["result"][1]))]
        return [(s.get("metric") or {}, float(s["value"][1])) for s in data.get("result") or []]

    def _scalar(self, promql: str, at: float) -> Optional[float]:
        rows = self.query(promql, at)
        vals = [v for _, v in rows if not math.isnan(v)]
        return sum(vals) if vals else None

    def _sel(self, role: str, **extra: str) -> str:
        labels = {"pool": self.pool, "role": role, **extra}
        return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"

    def latency_query(self, role: Role) -> str:
        w = f"{int(round(self.window_s))}s"
        q = self.percentiles[role] / 100.0
        metric = "ttft" if role == "prefill" else "tpot"
        custom = self.overrides[metric]
        if custom:
            return custom.replace("$pool", self.pool).replace("$window", w).replace("$quantile", repr(q))
        if role == "prefill":
            sel, name = self._sel("router", prefill="remote"), M.TTFT + "_bucket"
        else:
            sel, name = self._sel("router"), M.TPOT + "_bucket"
        return f"histogram_quantile({q}, sum by (le) (rate({name}{sel}[{w}])))"

    # ---- the snapshot -----------------------------------------------------------------------
    def observe(self, targets: Targets, rolling_out: bool = False) -> PoolSnapshot:
        now = self.clock()
        down: set[str] = set()
        try:
            down = self._down(targets, now)
            present = self._scalar(f"count({M.ROUTING_DECISIONS}_total{self._sel('router')})", now)
            snap = None if not present else self._snapshot(targets, rolling_out, now, down)
        except PrometheusError:
            snap = None
        if snap is None:
            roles = {r: self._counts(r, targets, down, signal="no_data") for r in ("prefill", "decode")}
            return PoolSnapshot(at=now, prefill=roles["prefill"], decode=roles["decode"], rolling_out=rolling_out)
        return snap

    @staticmethod
    def instance(w: Worker) -> str:
        """The ``instance`` label Prometheus gives a worker's target: its ``host:port``."""
        return w.url.split("://", 1)[-1].rstrip("/")

    def _down(self, targets: Targets, now: float) -> set[str]:
        """Instances of the workers whose last scrape failed (``up == 0``) and that are ready or were
        scraped before: dead or hung. Raises PrometheusError."""
        workers = targets.workers("prefill") + targets.workers("decode")
        if not workers:
            return set()
        # a raw (backquoted) PromQL string: the regex's escaped dots pass as they are
        names = "|".join(re.escape(self.instance(w)) for w in workers)
        up = {labels.get("instance"): v for labels, v in self.query(f"up{{instance=~`{names}`}}", now)}
        self.answered |= {i for i, v in up.items() if v == 1}
        return {self.instance(w) for w in workers
                if up.get(self.instance(w)) == 0 and w.state != "draining"
                and (w.state == "ready" or self.instance(w) in self.answered)}

    def _counts(self, role: Role, targets: Targets, down: set[str], **kw) -> RoleSnapshot:
        ws = targets.workers(role)
        gone = [w for w in ws if self.instance(w) in down]
        return RoleSnapshot(role=role, ready=sum(w.state == "ready" and w not in gone for w in ws),
                            starting=sum(w.state == "starting" and w not in gone for w in ws),
                            draining=sum(w.state == "draining" for w in ws), unresponsive=len(gone), **kw)

    def _snapshot(self, targets: Targets, rolling_out: bool, now: float, down: set[str]) -> PoolSnapshot:
        w = f"{int(round(self.window_s))}s"
        r = self._sel("router")
        queued = int(self._scalar(f"sum({M.ROUTER_QUEUED}{r})", now) or 0)
        finished = self._scalar(f"sum(increase({M.E2E}_count{r}[{w}]))", now) or 0.0
        # as pods_source.py reads them: prefill's on arrival at the router (an older router's remote
        # decisions; the prefill workers' computed tokens where no router has the counters), decode's
        # at the first token
        pre = self._sel("prefill")
        new_rate = f"sum by (instance) (rate({M.ROUTER_REQUESTS}_total{r}[{w}]))"
        received, tokens = prefill_arrivals(
            self._scalar(f"sum({new_rate})", now),
            self._scalar(f"sum(rate({M.ROUTER_PROMPT_TOKENS}_total{r}[{w}]))", now) or 0.0,
            self._scalar(f"sum(sum by (instance) (rate({M.ROUTING_DECISIONS}_total"
                         f"{self._sel('router', decision='remote')}[{w}])) unless on (instance) {new_rate})", now) or 0.0)
        if tokens is None:
            tokens = self._scalar(f"sum(rate({M.PROMPT_TOKENS_COMPUTED}_total{pre}[{w}]))", now) or 0.0
        roles = {}
        for role in ("prefill", "decode"):
            if role == "prefill":
                arrivals, demand = received, tokens
            else:
                arrivals = self._scalar(f"sum(rate({M.ROUTING_DECISIONS}_total{r}[{w}]))", now) or 0.0
                demand = self._scalar(f"sum(rate({M.GENERATION_TOKENS}_total{self._sel(role)}[{w}]))", now) or 0.0
            # asked for as decode_queue reads them: a prefill worker's prefilling gauge is not needed
            running, waiting = decode_queue(lambda name: self._scalar(f"sum({name}{self._sel(role)})", now) or 0.0,
                                            role)
            kv = self._scalar(f"avg({M.KV_USAGE}{self._sel(role)})", now) or 0.0
            latency = self._scalar(self.latency_query(role), now)
            idle = received == 0 and arrivals == 0 and finished == 0 and running == 0 and waiting == 0 \
                and queued == 0
            roles[role] = self._counts(
                role, targets, down, signal="idle" if idle else "ok", window_s=self.window_s, arrivals_per_s=arrivals,
                prompt_tokens_per_s=demand if role == "prefill" else 0.0,
                output_tokens_per_s=demand if role == "decode" else 0.0,
                running=running, waiting=waiting, kv_usage=kv,
                latency=latency if latency is not None and math.isfinite(latency) else None)
        return PoolSnapshot(at=now, prefill=roles["prefill"], decode=roles["decode"], router_queued=queued,
                            rolling_out=rolling_out)
