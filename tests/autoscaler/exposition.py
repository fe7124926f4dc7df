"""Exposition text of stand-in pods for the metric-source tests (tests/autoscaler/test_metric_sources.py
and test_prometheus_source.py): states a real worker or router cannot be held in on demand. The real
series are checked on real processes in tests/serving/test_abuse.py and the fleet tests."""
from __future__ import annotations

from tandem.worker.api import metrics as M
from tandem.worker.api.metrics import Metrics


def gauges(role: str, **values: float) -> str:
    """A worker's exposition with these gauges (``RUNNING=4`` names ``metrics.RUNNING``), pool "p"."""
    return "".join(f'{getattr(M, k)}{{role="{role}",pool="p"}} {v}\n' for k, v in values.items())


def older_router(router: Metrics) -> str:
    """``router``'s exposition without the series a router older than the arrival counters lacks."""
    return "\n".join(line for line in router.render().decode().splitlines()
                     if M.ROUTER_REQUESTS not in line and M.ROUTER_PROMPT_TOKENS not in line) + "\n"
