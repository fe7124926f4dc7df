"""The operator's one reconcile loop and the queue that feeds it.

Kopf's handlers and child-Deployment events only name a pool (:func:`enqueue`); every pass runs in
:func:`resync_loop`, so a pool seen by Kopf and by the loop's first listing at start is applied once.
The loop also runs a pass for every pool every ``interval`` seconds (status refresh, drift repair).
Transient API errors back off per pool (operator/backoff.py); a child refused as invalid parks the pool
until its generation changes (operator/reconcile.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from .backoff import Backoff
from .kube import KubeError
from .reconcile import Reconciler, list_pools

log = logging.getLogger("tandem.operator")


class WorkQueue:
    """Pools named for a pass soon, and the event that wakes the loop for them."""

    def __init__(self):
        self.pending: set[tuple[str, str]] = set()
        self.wake: Optional[asyncio.Event] = None   # made in the loop's event loop

    def enqueue(self, body: Any) -> None:
        """Hand a pool (its body, or any mapping with its metadata) to the reconcile loop."""
        md = body.get("metadata", {})
        self.pending.add((md.get("namespace") or "default", md["name"]))
        if self.wake is not None:
            self.wake.set()

    def take(self) -> set[tuple[str, str]]:
        named = set(self.pending)
        self.pending.clear()
        return named


async def resync_loop(queue: WorkQueue, reconciler: Callable[[], Reconciler], interval: float,
                      namespaces: list[str], backoff: Backoff, metrics: Callable[[], Any]) -> None:
    """The one place passes run: every ``interval`` seconds for every pool, and soon after Kopf or a
    child Deployment names a pool. Transient failures back off per pool; a pool whose child was
    refused as invalid is left alone by the reconciler until its generation changes."""
    wake = queue.wake = asyncio.Event()
    last_full = 0.0
    while True:
        timeout = max(0.5, interval - (time.monotonic() - last_full))
        due = backoff.next_due()
        if due is not None:
            timeout = max(0.5, min(timeout, due))
        try:
            await asyncio.wait_for(wake.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            pass
        wake.clear()
        await asyncio.sleep(0.5)  # coalesce bursts of child events
        full = time.monotonic() - last_full >= interval
        named = queue.take()
        try:
            pools = await asyncio.to_thread(list_pools, reconciler().kube, namespaces)
        except KubeError as e:
            log.warning("resync: listing pools failed: %s", e)
            queue.pending |= named
            continue
        if full:
            last_full = time.monotonic()
        rec = reconciler()
        by_ns: dict[str, list[dict]] = {}
        for body in pools:
            md = body["metadata"]
            key = (md.get("namespace") or "default", md["name"])
            if md.get("deletionTimestamp"):
                continue
            if not full and key not in named and not backoff.due(key):
                continue
            if backoff.waiting(key, md.get("generation")):
                continue  # its retry comes at its own time
            by_ns.setdefault(key[0], []).append(body)
        for ns, bodies in by_ns.items():
            snap, caps = None, None
            if len(bodies) > 1:  # one LIST per kind instead of one GET per child
                try:
                    caps = await asyncio.to_thread(rec.capabilities)
                    snap = await asyncio.to_thread(rec.snapshot, ns, caps)
                except KubeError as e:
                    log.warning("resync: snapshot of %s failed, reading children one by one: %s", ns, e)
                    snap, caps = None, None
            for body in bodies:
                md = body["metadata"]
                key = (ns, md["name"])
                t0 = time.perf_counter()
                try:
                    res = await asyncio.to_thread(rec.reconcile, body, caps, snap)
                except KubeError as e:
                    m = metrics()
                    if m:
                        m.errors.inc()
                    delay = backoff.failed(key, md.get("generation"))
                    log.warning("pool %s/%s: %s; retrying in %.0fs", ns, md["name"], e, delay)
                    continue
                except Exception:  # noqa: BLE001 - nothing crashes the operator
                    log.exception("pass of %s/%s crashed", ns, md["name"])
                    backoff.failed(key, md.get("generation"))
                    continue
                backoff.succeeded(key)
                _report(metrics(), res, ns, md["name"], time.perf_counter() - t0)


def _report(m, res, ns: str, name: str, seconds: float) -> None:
    if m:
        m.observe(res, seconds)
    if res.parked:
        return
    if res.problems:
        if res.status_written:  # once per change, not once per pass
            log.info("pool %s/%s: invalid spec: %s", ns, name, "; ".join(f"{p}: {msg}" for p, msg in res.problems))
    elif res.rejected and res.status_written:
        log.warning("pool %s/%s: the API server rejected %s", ns, name,
                    "; ".join(f"{c}: {msg}" for c, msg in res.rejected))
    elif res.applied:
        log.info("pool %s/%s: applied %s", ns, name, ", ".join(res.applied))
