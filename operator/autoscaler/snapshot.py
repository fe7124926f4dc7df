"""The autoscaler's contract: what it sees (a :class:`PoolSnapshot`) and what it decides (a
:class:`Decision`). The Kubernetes backend, the local fleet and the simulator all build the same
snapshot and act on the same decision, so the policy cannot tell them apart.

Units: seconds, tokens, requests; rates per second. Latencies are the role's target metric (TTFT for
prefill, measured at the router on remotely prefilled requests; TPOT for decode) at the percentile the
spec names, over the snapshot's window.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

Role = Literal["prefill", "decode"]

# What a scrape said, kept apart because they call for opposite actions:
#   ok       data with traffic in it;
#   idle     the scrape answered, and nothing arrived in the window (NaN percentiles): scale to min;
#   no_data  failed, absent or stale scrapes: hold the count (never below min).
Signal = Literal["ok", "idle", "no_data"]


@dataclass(frozen=True)
class RoleSnapshot:
    """One role's state over the last window.

    Attributes:
        role: ``prefill`` or ``decode``.
        signal: ``ok`` | ``idle`` | ``no_data`` (see module docs).
        window_s: length of the window the rates and percentiles cover (seconds).
        arrivals_per_s: requests reaching this role per second: for prefill every request the router
            accepts, on arrival (wherever it is then prefilled); for decode the requests joining it
            (at their first token).
        prompt_tokens_per_s: prompt tokens arriving per second, whole prompts (prefill's demand; the
            prefix cache's share is not taken off).
        output_tokens_per_s: tokens generated per second (decode's demand).
        running: sequences running, summed over replicas (for decode, decoding: its local prefills
            being computed count as waiting).
        waiting: sequences queued in the workers, summed over replicas (a decode worker's sequences
            awaiting their KV from a prefill worker are prefill's queue, not counted here; its local
            prefills, queued or being computed, are).
        kv_usage: mean KV-cache usage over ready replicas, 0..1.
        latency: the target metric's percentile (seconds); None when no request finished in the window.
        ready: replicas serving.
        starting: replicas created and not yet ready (capacity on the way).
        draining: replicas draining (no new requests; not counted as capacity).
        unresponsive: replicas ready (or once ready) whose last scrapes all failed: dead or hung
            (SIGSTOPped, wedged) processes not yet removed. Not counted as capacity, so the policy
            sizes as if they were gone and replaces them; they count again once they answer.
    """
    role: Role
    signal: Signal = "ok"
    window_s: float = 30.0
    arrivals_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    latency: Optional[float] = None
    ready: int = 0
    starting: int = 0
    draining: int = 0
    unresponsive: int = 0

    @property
    def replicas(self) -> int:
        """Replicas that count toward the desired count: ready plus starting."""
        return self.ready + self.starting


@dataclass(frozen=True)
class PoolSnapshot:
    """Both roles and the router at one instant.

    Attributes:
        at: the source's clock (seconds; wall time for real fleets, simulated time in the simulator).
        prefill, decode: the roles.
        router_queued: requests the router holds for lack of a ready worker (``tandem:router_queued_requests``);
            > 0 with zero replicas is the wake-up signal of a scale-to-zero pool.
        rolling_out: a previous change is still being applied (pods not yet created or not yet gone);
            the policy makes no new decision while it is true.
    """
    at: float
    prefill: RoleSnapshot
    decode: RoleSnapshot
    router_queued: int = 0
    rolling_out: bool = False

    def role(self, name: Role) -> RoleSnapshot:
        return self.prefill if name == "prefill" else self.decode


@dataclass
class RoleDecision:
    """What the policy wants for one role, and why.

    Attributes:
        role: ``prefill`` or ``decode``.
        current: replicas (ready + starting) when deciding.
        desired: the count to apply, after every bound and behavior limit.
        recommended: the unbounded count the demand and latency called for.
        signal: the snapshot's signal this decision saw.
        reason: one human sentence (goes to status and Events).
        limited_by: the bound that decided, when one did: ``minReplicas`` | ``maxReplicas`` |
            ``gpuBudget`` | ``ratio`` | ``stabilization`` | ``maxStep`` | ``rollout``; None otherwise.
        inputs: the figures used (observed latency, target, demand, capacity per replica, forecast...).
    """
    role: Role
    current: int
    desired: int
    recommended: int
    signal: Signal
    reason: str
    limited_by: Optional[str] = None
    inputs: dict = field(default_factory=dict)

    @property
    def delta(self) -> int:
        return self.desired - self.current


@dataclass
class Decision:
    """One tick's decision for the pool.

    Attributes:
        at: the snapshot's clock (seconds).
        prefill, decode: per-role decisions.
        absorb_bursts: prefill on decode workers with headroom (the router's local-prefill path) until
            the next decision, because remote prefill would break the TTFT target while new prefill
            replicas start (after TokenScale, arXiv 2512.03416); behind a deep prefill backlog also
            past decode's TPOT slack (``Autoscaler(absorb_deep_backlog=)``).
        advisory: the pool is in advisory mode: record, do not act.
        priority: when the GPU budget binds, the role that got the GPUs and why; else None.
    """
    at: float
    prefill: RoleDecision
    decode: RoleDecision
    absorb_bursts: bool = False
    advisory: bool = False
    priority: Optional[str] = None

    def role(self, name: Role) -> RoleDecision:
        return self.prefill if name == "prefill" else self.decode

    @property
    def changes(self) -> bool:
        return self.prefill.delta != 0 or self.decode.delta != 0

    def to_dict(self) -> dict:
        """A JSON-ready form (status.autoscaler.decisions, simulator output)."""
        return asdict(self)
