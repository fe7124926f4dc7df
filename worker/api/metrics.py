"""The Prometheus metrics of the router and the workers, in vLLM's style with the ``tandem:`` prefix; every series carries role and pool.

Latency histograms are observed by the server (or the router, with role="router"). Engine counters
and gauges are read from the engine at scrape time, so the engine keeps one set of numbers.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.worker.api.auth import ENDPOINTS

# The names the autoscaler reads (operator/autoscaler/pods_source.py, prometheus_source.py); counters
# are exposed with a ``_total`` suffix and histograms as ``_bucket``, ``_sum`` and ``_count``.
TTFT = "tandem:time_to_first_token_seconds"
TPOT = "tandem:request_time_per_output_token_seconds"
E2E = "tandem:e2e_request_latency_seconds"
ROUTING_DECISIONS = "tandem:router_routing_decisions"
ROUTER_QUEUED = "tandem:router_queued_requests"
ROUTER_REQUESTS = "tandem:router_requests_received"
ROUTER_PROMPT_TOKENS = "tandem:router_prompt_tokens"
PROMPT_TOKENS_COMPUTED = "tandem:prompt_tokens_computed"
GENERATION_TOKENS = "tandem:generation_tokens"
RUNNING = "tandem:num_requests_running"
WAITING = "tandem:num_requests_waiting"
AWAITING_KV = "tandem:num_requests_awaiting_remote_kv"
PREFILLING = "tandem:num_requests_prefilling"
KV_USAGE = "tandem:kv_cache_usage_perc"

# The autoscaler reads percentiles from these buckets (linear interpolation inside a bucket, as
# Prometheus' histogram_quantile does), so between 20 ms and 2 s (TTFT) and 10 ms and 0.3 s (TPOT), where
# SLO targets plausibly sit, consecutive edges are at most 25 % apart: an interpolated percentile is then
# off by a fraction of that, inside a 10 % tolerance band around any target (docs/autoscaler-actuation.md).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.075, 0.09, 0.1, 0.125, 0.15,
                0.175, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.005, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.075, 0.09,
                0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
#: The router labels its TTFT by where the prompt was prefilled: the prefill pool scales on "remote".
PREFILL_PLACES = ("remote", "local")
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)


class Metrics:
    """The metric set of one process.

    Args:
        role: ``both`` | ``prefill`` | ``decode`` | ``router``.
        pool: the InferencePool name.
        engine: the process's :class:`LLMEngine`, if it has one (its counters are exported).
    """

    def __init__(self, role: str, pool: str, engine=None):
        self.registry = CollectorRegistry()
        self.labels = {"role": role, "pool": pool}
        self.engine = engine
        names = ["role", "pool"]
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        if role == "router":   # by prefill place: the prefill pool's SLO is the TTFT of remote prefills
            ttft = Histogram(TTFT, "Time to first token (s), by where the "
                             "prompt was prefilled (remote: a prefill worker; local: the decode worker).",
                             names + ["prefill"], buckets=TTFT_BUCKETS, registry=r)
            self.ttft_by_place = {p: ttft.labels(**self.labels, prefill=p) for p in PREFILL_PLACES}
            self.ttft = self.ttft_by_place["local"]
        else:
            self.ttft = hist(TTFT, "Time to first token (s).", TTFT_BUCKETS)
        self.itl = hist("tandem:inter_token_latency_seconds", "Gap between consecutive tokens (s).", TPOT_BUCKETS)
        self.tpot = hist(TPOT,
                         "(E2E - TTFT) / (output tokens - 1) per request (s).", TPOT_BUCKETS)
        self.e2e = hist(E2E, "Request latency (s).", E2E_BUCKETS)
        self.queue_time = hist("tandem:request_queue_time_seconds", "Arrival to first scheduling (s).", TTFT_BUCKETS)
        self.prefill_time = hist("tandem:request_prefill_time_seconds", "First scheduling to first token (s).",
                                 TTFT_BUCKETS)
        self.kv_transfer_seconds = hist("tandem:kv_transfer_seconds", "Duration of one KV transfer (s).",
                                        TTFT_BUCKETS)
        self.kv_transfer_bytes = Counter("tandem:kv_transfer_bytes", "KV bytes sent or received.",
                                         names + ["direction"], registry=r)
        self.requests = Counter("tandem:request_success", "Finished requests by finish reason.",
                                names + ["finished_reason"], registry=r)
        self.routing = Counter(ROUTING_DECISIONS, "Router decisions and why.",
                               names + ["decision"], registry=r)
        self.router_queued = Gauge(ROUTER_QUEUED, "Requests the router holds for lack of "
                                   "a ready worker.", names, registry=r).labels(**self.labels)
        self.router_stream_errors = Counter(
            "tandem:router_stream_errors", "Streams the router ended with an SSE error event after they had "
            "begun, by reason (decode_worker_lost: the decode worker's connection broke; decode_worker_timeout: "
            "it sent nothing for the stream idle timeout).", names + ["reason"], registry=r)
        self.router_retries = Counter(
            "tandem:router_retries", "Requests the router sent again, before their first token, to another "
            "worker, by reason (unreachable, draining, hung: a worker stopped answering its health checks).",
            names + ["reason"], registry=r)
        self.router_stream_resumes = Counter(
            "tandem:router_stream_resumes", "Clients' reconnections to a broken stream (Last-Event-ID), by outcome "
            "(resumed; not_found: the worker no longer has it for this client; unknown_worker: its decode worker "
            "is not discovered; unreachable; refused).", names + ["outcome"], registry=r)
        self.auth_failures = Counter("tandem:auth_failures", "Requests and KV transfers refused for want of "
                                     "a valid API key, pool token or KV handshake proof.",
                                     names + ["endpoint"], registry=r)
        self.in_flight = Gauge("tandem:requests_in_flight", "Requests this process is serving.", names,
                               registry=r).labels(**self.labels)
        # every known label value from the start, at 0: a series that appears only on its first event
        # cannot be told apart from one that is not exported at all
        for direction in ("sent", "received"):
            self.kv_transfer_bytes.labels(**self.labels, direction=direction)
        for endpoint in ENDPOINTS:
            self.auth_failures.labels(**self.labels, endpoint=endpoint)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(**self.labels, finished_reason=reason)
        if role == "router":
            # counted when a request is accepted, before it is routed: the autoscaler's demand is what
            # arrives, not what got through (routing decisions are counted at the first token, which a
            # backlog delays)
            self.router_requests = Counter(
                ROUTER_REQUESTS, "Requests the router accepted (valid, within the context limit), counted "
                "on arrival; one answered 503 for want of a ready decode worker counts too (it is demand).",
                names, registry=r).labels(**self.labels)
            self.router_prompt_tokens = Counter(
                ROUTER_PROMPT_TOKENS, "Prompt tokens of the requests the router accepted, counted on arrival "
                "(whole prompts: the prefix cache's share included).", names, registry=r).labels(**self.labels)
            for decision in ("remote", "short_prompt", "decode_cached", "no_prefill_worker", "model_mismatch",
                             "absorb_burst"):
                self.routing.labels(**self.labels, decision=decision)
            for reason in ("decode_worker_lost", "decode_worker_timeout"):
                self.router_stream_errors.labels(**self.labels, reason=reason)
            for reason in ("unreachable", "draining", "hung"):
                self.router_retries.labels(**self.labels, reason=reason)
            for outcome in ("resumed", "not_found", "unknown_worker", "unreachable", "refused"):
                self.router_stream_resumes.labels(**self.labels, outcome=outcome)
        if engine is not None:
            r.register(_EngineCollector(engine, self.labels))

    def request_received(self, prompt_tokens: int) -> None:
        """(router) Count one accepted request of ``prompt_tokens`` prompt tokens, on its arrival."""
        self.router_requests.inc()
        self.router_prompt_tokens.inc(prompt_tokens)

    def observe_request(self, ttft: float | None, e2e: float, num_output_tokens: int,
                        itls: list[float] | None = None, prefill: str | None = None) -> None:
        """Record one finished request's latencies (seconds). TPOT only with >= 2 output tokens.
        ``prefill`` (router only): ``remote`` or ``local``, the TTFT series it goes to."""
        if ttft is not None:
            (self.ttft_by_place[prefill] if prefill and hasattr(self, "ttft_by_place") else self.ttft).observe(ttft)
            if num_output_tokens >= 2:
                self.tpot.observe((e2e - ttft) / (num_output_tokens - 1))
        self.e2e.observe(e2e)
        for gap in itls or ():
            self.itl.observe(gap)

    def auth_refused(self, endpoint: str) -> None:
        """Count one refused request (``endpoint``: a path of :data:`auth.ENDPOINTS`, or "kv")."""
        self.auth_failures.labels(**self.labels, endpoint=endpoint).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenTimer:
    """TTFT and the inter-token gaps of one streamed request, timed from ``t0`` (monotonic seconds)."""

    def __init__(self, t0: float):
        self.t0, self.ttft, self.last, self.itls, self.tokens = t0, None, None, [], 0

    def tick(self) -> None:
        """A token (or a chunk of token text) went out now."""
        now = time.monotonic()
        if self.ttft is None:
            self.ttft = now - self.t0
        else:
            self.itls.append(now - self.last)
        self.last = now
        self.tokens += 1


class _EngineCollector:
    def __init__(self, engine, labels):
        self.engine, self.labels = engine, labels

    def collect(self):
        e, names, values = self.engine, list(self.labels), list(self.labels.values())
        bm, st = e.block_manager, e.stats

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        yield counter("tandem:prompt_tokens", "Prompt tokens received.", st.prompt_tokens)
        yield counter(PROMPT_TOKENS_COMPUTED, "Prompt tokens this worker ran through the model.",
                      st.prompt_tokens_computed)
        yield counter(GENERATION_TOKENS, "Tokens generated.", st.generation_tokens)
        yield counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      bm.prefix_queries)
        yield counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.", bm.prefix_hits)
        yield counter("tandem:preemptions", "Sequences preempted (to be recomputed).", e.scheduler.num_preemptions)
        yield counter("tandem:local_prefill_fallbacks", "Remote prefills given up for a local prefill.",
                      st.local_prefill_fallbacks)
        yield counter("tandem:request_errors", "Requests failed by an error in their own scheduling, model "
                      "step, sampling or detokenizing (the engine went on with the others).",
                      st.request_errors)
        aborts = CounterMetricFamily("tandem:request_aborts", "Requests aborted (client gone, transfer or "
                                     "engine failure), by the state they were in.", labels=names + ["state"])
        for state in ("queued", "awaiting_kv", "receiving_kv", "running"):
            aborts.add_metric(values + [state], st.aborts.get(state, 0))
        yield aborts
        sch = e.scheduler
        # the engine thread moves sequences between these while this one reads them: each is read
        # once, so that a gauge that is part of another never exceeds it in one scrape
        running = list(sch.running)
        remote = len(sch.remote)
        prefilling = sum(1 for q in running if q.in_prefill)
        yield gauge(RUNNING, "Sequences in the running batch.", len(running))
        yield gauge(PREFILLING, f"Sequences in the running batch whose prompt is not all computed yet: a "
                    f"local, chunked or recomputed prefill (part of {RUNNING}).", prefilling)
        yield gauge(WAITING, "Sequences not running: queued (for prefill, or for room in the batch) or "
                    "awaiting remote KV.", len(sch.waiting) + remote + len(sch.handed_over))
        yield gauge(AWAITING_KV, "Sequences awaiting their prompt's KV from a prefill worker (part of "
                    f"{WAITING}).", remote)
        yield gauge(KV_USAGE, "Fraction of KV blocks held by requests (0..1).", bm.usage())
        yield gauge("tandem:kv_cache_free_blocks", "KV blocks free or cached-free.", bm.num_free_blocks)
