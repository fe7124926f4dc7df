"""Kubernetes HPA's scaling behavior, the arithmetic shared by tandem's policy (``policy.Autoscaler._behave``)
and the simulator's oracle held to the pool's behavior (``simulate.baselines.BehavedReactiveOracle``):
stabilization windows and step limits per period. It follows ``stabilizeRecommendationWithBehaviors`` and
``calculateScaleUpLimitWithScalingRules`` / ``calculateScaleDownLimitWithBehaviors`` in
kubernetes/kubernetes pkg/controller/podautoscaler/horizontal.go, with one policy per direction (the
spec's ``maxStep`` per ``periodSeconds``; :func:`step_room` says where it differs)."""
from __future__ import annotations

from typing import Iterable


def stabilized(cur: int, want: int, recs: Iterable[tuple[float, int]], at: float, window: float,
               strict: bool = False) -> int:
    """The recommendation ``want`` (replicas) after the stabilization window (seconds): a scale-up takes the
    lowest recommendation of the window, a scale-down the highest, neither past ``cur``. ``recs`` are
    (time in seconds, recommendation) pairs; ``strict`` keeps HPA's cut-off (a sample exactly one window old
    is out), else it is in."""
    inside = [v for t, v in recs if (t > at - window if strict else t >= at - window)]
    if want > cur:
        return max(cur, min([want] + inside))
    if want < cur:
        return min(cur, max([want] + inside))
    return want


def step_room(changes: Iterable[tuple[float, int]], at: float, period: float, step: int, up: bool) -> int:
    """How many replicas one direction may still move by: ``step`` per ``period`` (seconds), less what the
    ``changes`` (time, applied delta) in that direction moved within the last period. Only moves in the
    same direction count: current upstream HPA starts the period from the count before both directions'
    moves in it (``periodStartReplicas``), so it gives a scale-up back the replicas removed within its
    period; neither tandem's policy nor the held oracle does."""
    used = sum(abs(d) for t, d in changes if (d > 0 if up else d < 0) and t > at - period)
    return max(0, step - used)
