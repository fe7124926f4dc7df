"""The operator's own Prometheus metrics (TANDEM_METRICS_PORT): reconcile passes, applies, errors, and
the autoscaler's decisions (``tandem:autoscaler_*``, labelled by namespace, pool and role)."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram, start_http_server


@dataclass
class Metrics:
    passes: Counter
    applies: Counter
    errors: Counter
    invalid: Counter
    duration: Histogram
    desired: Gauge = None
    slo_ratio: Gauge = None
    signal: Counter = None
    actions: Counter = None
    leader: Gauge = None
    ticks: Counter = None

    def observe(self, res, seconds: float) -> None:
        self.passes.inc()
        self.applies.inc(len(res.applied))
        if res.problems:
            self.invalid.inc()
        self.duration.observe(seconds)


def start(port: int) -> Metrics:
    m = Metrics(
        passes=Counter("tandem_operator_reconcile_total", "Reconcile passes run by handlers"),
        applies=Counter("tandem_operator_applied_objects_total", "Child objects applied (server-side apply)"),
        errors=Counter("tandem_operator_api_errors_total", "Reconcile passes that failed on the API and were retried"),
        invalid=Counter("tandem_operator_invalid_spec_total", "Reconcile passes that found an invalid spec"),
        duration=Histogram("tandem_operator_reconcile_seconds", "Duration of a reconcile pass"),
        **autoscaler_metrics(),
    )
    start_http_server(port)
    return m


def autoscaler_metrics(registry=None) -> dict:
    """The autoscaler's series (in the default registry unless one is given)."""
    kw = {} if registry is None else {"registry": registry}
    names = ["namespace", "pool", "role"]
    return dict(
        desired=Gauge("tandem:autoscaler_desired_replicas", "Replicas the autoscaler wants per role.", names, **kw),
        slo_ratio=Gauge("tandem:autoscaler_slo_ratio", "Observed percentile / target (TTFT for prefill, "
                        "TPOT for decode); > 1 breaks the SLO.", names, **kw),
        signal=Counter("tandem:autoscaler_signals", "Decisions by the signal they saw (ok, idle, no_data).",
                       names + ["signal"], **kw),
        actions=Counter("tandem:autoscaler_scaling_actions", "Decisions that changed a role's replicas.",
                        names + ["direction"], **kw),
        leader=Gauge("tandem:autoscaler_leader", "1 while this operator replica holds the autoscaler's Lease.",
                     **kw),
        ticks=Counter("tandem:autoscaler_ticks", "Autoscaler ticks by outcome: decided (at least one pool "
                      "observed and decided), api_unavailable (the API server did not answer: nothing decided, "
                      "nothing acted on), not_leader (another replica holds the Lease), no_pools.",
                      ["outcome"], **kw),
    )
