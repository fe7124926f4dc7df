"""The operator's autoscaler thread: :class:`~.kube_loop.KubeAutoscaler` ticks on a thread of its own,
acting only while this operator replica holds the Lease (:mod:`.lease`). Configured by environment
(the chart sets it): TANDEM_AUTOSCALER_INTERVAL_SECONDS, TANDEM_AUTOSCALER_WINDOW_SECONDS,
TANDEM_AUTOSCALER_LEASE (namespace/name), TANDEM_AUTOSCALER_LEASE_SECONDS, TANDEM_NAMESPACES, POD_NAME,
POD_NAMESPACE. Started by operator/handlers.py; imports no Kopf."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from typing import Any, Callable

from ..kube import Kube
from .kube_loop import KubeAutoscaler
from .lease import LeaderLease

log = logging.getLogger("tandem.operator")


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


async def run_autoscaler(state: dict, events: Callable, metrics: Any) -> None:
    """Tick the autoscaler forever (until cancelled), each tick on the autoscaler's own thread. The
    :class:`KubeAutoscaler` is kept in ``state["autoscaler"]`` so that cleanup can stop it."""
    interval = float(_env("TANDEM_AUTOSCALER_INTERVAL_SECONDS", "5"))
    lease_ns, _, lease_name = _env("TANDEM_AUTOSCALER_LEASE", "").partition("/")
    kube = Kube()
    lease = LeaderLease(kube, lease_ns or _env("POD_NAMESPACE", "default"), lease_name or "tandem-operator-autoscaler",
                        _env("POD_NAME") or socket.gethostname(),
                        duration_s=float(_env("TANDEM_AUTOSCALER_LEASE_SECONDS", "15")),
                        renew_s=min(interval, 5.0))
    auto = state["autoscaler"] = KubeAutoscaler(
        kube, lease, events=events, metrics=metrics,
        namespaces=[n for n in _env("TANDEM_NAMESPACES").split(",") if n],
        window_s=float(_env("TANDEM_AUTOSCALER_WINDOW_SECONDS", "30")), interval_s=interval)
    # its own thread, not the loop's default executor: the reconcile pass shares that one, and a Lease
    # attempt queued behind slow API calls there would let a standby miss its takeover (client-go runs
    # leader election on its own goroutine for the same reason). The tick is .loop.run_every's, as the
    # local fleet's; a tick at least 0.5 s after the last one ended.
    thread = threading.Thread(target=auto.run, kwargs={"min_wait_s": 0.5}, name="autoscaler", daemon=True)
    thread.start()
    try:
        await asyncio.Event().wait()     # until cancelled
    finally:
        auto.stop(release_lease=False)   # no API call on the event loop: cleanup releases the Lease
