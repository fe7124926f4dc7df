"""What both backends (kube_loop.py, fleet_loop.py) do with a decision: read which roles they act on and
at which percentile, whether a decision is acted on, pick the replica to drain, drain it over HTTP, and
write the decision down (status entries, one-line reasons). Standard library only; imports no kopf.

Drain (docs/autoscaler-actuation.md): ``POST /drain`` makes a worker stop admitting work and turn not-ready;
``GET /drain`` answers ``{"draining", "in_flight", "drained"}``. A prefill worker counts its pending KV
transfers in ``in_flight``, so it reports drained only after they end.
"""
from __future__ import annotations

import json
import math
import time
import urllib.request
from typing import Callable, Optional

from tandem.worker.api.names import WORKER_ROLES

from .snapshot import Decision, PoolSnapshot


def percentiles(spec) -> dict[str, float]:
    """The percentile each worker role's SLO is read at (``autoscaling.target.percentile``; 90 unset)."""
    def pct(a):
        return a.target.percentile if a and a.target else 90.0
    return {r: pct(getattr(spec, r).autoscaling) for r in WORKER_ROLES}


def enabled_roles(spec) -> dict[str, bool]:
    """Which worker roles the autoscaler acts on (``autoscaling.enabled``)."""
    return {r: bool(getattr(spec, r).autoscaling and getattr(spec, r).autoscaling.enabled) for r in WORKER_ROLES}


def acted_on(spec, decision: Decision) -> bool:
    """Whether a backend carries ``decision`` out: the pool's mode is active and the policy did not
    mark the decision advisory."""
    return spec.autoscaling.mode == "active" and not decision.advisory


def http_json(method: str, url: str, timeout: float = 5.0, headers: Optional[dict] = None,
              body: Optional[dict] = None) -> dict:
    """One JSON request (a POST sends ``body``, default ``{}``); raises OSError (URLError included) or
    ValueError."""
    data = json.dumps(body or {}).encode() if method == "POST" else None
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def load_of(url: str, timeout: float = 2.0) -> float:
    """A worker's load for the drain choice: requests (and KV transfers) in flight, from /health;
    ``inf`` when it does not answer (an unreachable worker is not drained: it cannot confirm)."""
    try:
        return float(http_json("GET", url.rstrip("/") + "/health", timeout).get("in_flight", 0))
    except (OSError, ValueError):
        return math.inf


def least_loaded(candidates: list, url_of: Callable[[object], str],
                 load: Callable[[str], float] = load_of) -> Optional[object]:
    """The candidate with the least load (ties: the first in order); None when none answers."""
    best, best_load = None, math.inf
    for c in candidates:
        v = load(url_of(c))
        if v < best_load:
            best, best_load = c, v
    return best


def start_drain(url: str, timeout: float = 5.0, headers: Optional[dict] = None) -> dict:
    """POST /drain, then GET /drain at once: the state the worker is drained in (``in_flight`` is what
    it still had to finish). ``headers``: the pool token (a worker takes a drain only from its pool,
    docs/security.md). Raises OSError or ValueError when the worker does not answer."""
    http_json("POST", url.rstrip("/") + "/drain", timeout, headers)
    return http_json("GET", url.rstrip("/") + "/drain", timeout)


def push_absorb_bursts(url: str, seconds: float, timeout: float = 2.0, headers: Optional[dict] = None) -> dict:
    """Tell a router to prefill bursts on decode workers with headroom (TokenScale's burst absorption)
    for the next ``seconds`` (0 stops it): ``POST /absorb-bursts``. The router forgets it when the time
    is up, so a leader that dies leaves nothing on. ``headers``: the pool token (the router takes this
    only from its pool). Raises OSError or ValueError when the router does not answer."""
    return http_json("POST", url.rstrip("/") + "/absorb-bursts", timeout, headers, {"seconds": seconds})


def wait_drained(url: str, timeout: float, poll_s: float = 0.5, stop: Optional[Callable[[], bool]] = None) -> bool:
    """Poll GET /drain until it reports drained (True), or ``timeout`` seconds pass (False). A worker
    that stops answering counts as drained: nothing of it can finish anymore."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if stop is not None and stop():
            return False
        try:
            if http_json("GET", url.rstrip("/") + "/drain").get("drained"):
                return True
        except (OSError, ValueError):
            return True
        time.sleep(poll_s)
    return False


def _num(x):
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else round(x, 6)
    return x


def decision_record(decision: Decision, snapshot: PoolSnapshot, acted: bool) -> dict:
    """One entry of ``status.lastScalingDecisions``: per role the current and desired count, the
    signal (ok | idle | no_data), the observed latency, demand, the policy's inputs and its reason."""
    out = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(decision.at)), "acted": acted,
           "advisory": decision.advisory, "routerQueued": snapshot.router_queued}
    if decision.absorb_bursts:
        out["absorbBursts"] = True
    if decision.priority:
        out["priority"] = decision.priority
    for role in ("prefill", "decode"):
        d, s = decision.role(role), snapshot.role(role)
        out[role] = {"current": d.current, "desired": d.desired, "recommended": d.recommended,
                     "signal": d.signal, "reason": d.reason, "limitedBy": d.limited_by,
                     "observed": _num(s.latency), "arrivalsPerSecond": _num(round(s.arrivals_per_s, 4)),
                     "ready": s.ready, "starting": s.starting, "draining": s.draining,
                     "unresponsive": s.unresponsive,
                     "inputs": {k: _num(v) for k, v in (d.inputs or {}).items()
                                if isinstance(v, (int, float, str, bool)) or v is None}}
    return out


def summary(decision: Decision) -> str:
    """One line for logs and Events: ``decode 1 -> 2 (reason); prefill 1 (reason)``."""
    parts = []
    for role in ("prefill", "decode"):
        d = decision.role(role)
        head = f"{role} {d.current} -> {d.desired}" if d.delta else f"{role} {d.current}"
        lim = f", limited by {d.limited_by}" if d.limited_by else ""
        parts.append(f"{head} ({d.signal}: {d.reason}{lim})")
    return "; ".join(parts)
