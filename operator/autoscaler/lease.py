"""One leader for the autoscaler: a ``coordination.k8s.io/v1`` Lease, as client-go's leader election
(k8s.io/client-go/tools/leaderelection) holds it.

Kopf peering pauses Kopf's handlers, not the operator's own loops, so the autoscaler takes its own
lock. The holder renews ``renewTime`` every ``renew_s``; a candidate takes the Lease over once it has
seen the same record unchanged for ``duration_s`` on its own clock (client-go's rule: no comparison of
two machines' clocks). Every write carries the ``resourceVersion`` it read, so of two candidates that
race for an expired Lease exactly one succeeds (the other gets 409). A holder that fails to renew for
``duration_s`` stops acting before anyone else may take over: it counts itself leader only until its
last successful renewal plus ``duration_s`` minus a ``renew_s`` margin.

Takeover after the holder dies is bounded by ``duration_s + renew_s`` (the candidate's next attempt).
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Callable, Optional

from ..kube import Kube, KubeError, object_path

log = logging.getLogger("tandem.autoscaler.lease")


def _micro(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderLease:
    """A Lease ``namespace/name`` held by ``identity`` (a pod name).

    Args:
        kube: the operator's API client.
        namespace, name: where the Lease lives (the operator's namespace).
        identity: this replica's name, written to ``holderIdentity``.
        duration_s: ``leaseDurationSeconds``: how long a silent holder keeps the Lease.
        renew_s: seconds between renewals (and between attempts of a candidate).
        clock: monotonic seconds (tests).
    """

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, duration_s: float = 15.0,
                 renew_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if renew_s >= duration_s:
            raise ValueError(f"renew_s ({renew_s}) must be shorter than duration_s ({duration_s})")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration_s, self.renew_s, self.clock = float(duration_s), float(renew_s), clock
        self.path = object_path("coordination.k8s.io/v1", "leases", namespace, name)
        self._seen: Optional[tuple] = None      # (holder, renewTime) last read
        self._seen_at = 0.0                     # when it was first read unchanged
        self._renewed_at: Optional[float] = None
        self.transitions = 0

    @property
    def held(self) -> bool:
        """Whether this replica may act now (its last renewal is recent enough)."""
        return (self._renewed_at is not None
                and self.clock() - self._renewed_at < self.duration_s - self.renew_s)

    def _spec(self, transitions: int, acquired: Optional[str]) -> dict:
        now = _micro(time.time())
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration_s),
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    def try_acquire(self) -> bool:
        """Create, renew or take over the Lease; returns whether this replica holds it. API errors count
        as not holding (the holder then stops acting once its renewal is too old)."""
        try:
            return self._try()
        except KubeError as e:
            log.warning("lease %s/%s: %s", self.namespace, self.name, e)
            return self.held

    def _try(self) -> bool:
        cur = self.kube.get(self.path)
        now = self.clock()
        if cur is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(0, None)}
            try:
                self.kube.request("POST", object_path("coordination.k8s.io/v1", "leases", self.namespace),
                                  body=body, retry=False)
            except KubeError as e:
                if e.status == 409:   # another replica created it first
                    return False
                raise
            self._renewed_at = now
            log.info("lease %s/%s acquired by %s (created)", self.namespace, self.name, self.identity)
            return True
        spec = cur.get("spec") or {}
        holder = spec.get("holderIdentity")
        record = (holder, spec.get("renewTime"))
        if record != self._seen:
            self._seen, self._seen_at = record, now
        mine = holder == self.identity
        expired = not holder or now - self._seen_at >= float(spec.get("leaseDurationSeconds") or self.duration_s)
        if not mine and not expired:
            self._renewed_at = None
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        body = {**cur, "spec": self._spec(transitions, spec.get("acquireTime") if mine else None)}
        try:
            self.kube.request("PUT", self.path, body=body, retry=False)
        except KubeError as e:
            if e.status == 409:   # someone else wrote it since we read it
                self._renewed_at = None
                return False
            raise
        if not mine:
            log.info("lease %s/%s taken over by %s from %s", self.namespace, self.name, self.identity, holder)
        self._renewed_at = now
        self.transitions = transitions
        return True

    def release(self) -> None:
        """Give the Lease up (on a clean shutdown), so a standby takes over at its next attempt."""
        if self._renewed_at is None:
            return
        try:
            cur = self.kube.get(self.path)
            if cur and (cur.get("spec") or {}).get("holderIdentity") == self.identity:
                cur["spec"]["holderIdentity"] = ""
                self.kube.request("PUT", self.path, body=cur, retry=False)
        except KubeError as e:
            log.warning("lease release: %s", e)
        self._renewed_at = None
