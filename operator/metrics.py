"""The operator's own Prometheus metrics (TANDEM_METRICS_PORT): reconcile passes, applies, errors."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram, start_http_server


@dataclass
class Metrics:
    passes: Counter
    applies: Counter
    errors: Counter
    invalid: Counter
    duration: Histogram

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
    )
    start_http_server(port)
    return m
