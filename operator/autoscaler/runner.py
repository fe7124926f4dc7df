"""The operator's autoscaler thread: :class:`~.kube_loop.KubeAutoscaler` ticks on a thread of its own,
acting only while this operator replica holds the Lease (:mod:`.lease`). Configured by environment
(the chart sets it): TANDEM_AUTOSCALER_INTERVAL_SECONDS, TANDEM_AUTOSCALER_WINDOW_SECONDS,
TANDEM_AUTOSCALER_LEASE (namespace/name), TANDEM_AUTOSCALER_LEASE_SECONDS, TANDEM_NAMESPACES, POD_NAME,
POD_NAMESPACE. Started by operator/handlers.py; imports no Kopf."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import time
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
    # leader election on its own goroutine for the same reason)
    own = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoscaler")
    loop = asyncio.get_running_loop()
    try:
        while True:
            t0 = time.monotonic()
            try:
                await loop.run_in_executor(own, auto.tick)
            except Exception:  # noqa: BLE001 - nothing stops the loop
                log.exception("autoscaler tick failed")
            await asyncio.sleep(max(0.5, interval - (time.monotonic() - t0)))
    finally:
        own.shutdown(wait=False)
