"""The fleet on a simulated clock: a discrete-event model of the router, the prefill and decode replicas,
their start-up and drain, driving a policy's ``decide`` every tick.

The model (seconds, tokens; costs from the calibration through :class:`~tandem.operator.autoscaler.capacity.PerfModel`):

- router: sends each request to the prefill replica with the least work queued and to the decode replica
  with the fewest running sequences; with no ready replica of a role it queues the request
  (``router_queued``, the scale-from-zero signal). When the last decision set ``absorb_bursts`` and the
  chosen prefill replica would finish later than the TTFT target, it prefills on a decode replica that
  runs nothing instead (the local-prefill path; a busy one would stall its batch).
- prefill replica: engine steps, first come, first served. A step takes every prompt waiting when it
  starts, up to the token budget (``max_batched_tokens``; at least one prompt), holds the replica for
  :meth:`~tandem.operator.autoscaler.capacity.PerfModel.remote_prefill_batch_seconds` (the batch's
  prefill compute, then the longest of its prompts' KV transfer tails), and every first token of the
  batch comes at its end. One prompt alone takes the calibrated remote-prefill time.
- decode replica: continuous batching; between two events the batch is fixed, so every running sequence
  advances at one token per ``decode_step_seconds(batch, mean context)``. A local prefill stalls the
  batch for its calibrated prefill time (no chunked prefill).
- start-up: a new replica serves after ``startup_s``; it costs GPU time from its creation.
- scale-down: a starting replica is cancelled first (newest first); else the least-loaded ready replica
  drains (takes no new work, finishes what it holds, then goes).
- metrics: every tick the simulator builds the :class:`PoolSnapshot` a scraper would, over the last
  ``window_s``: arrivals and prompt tokens at the router, generated tokens, the p90 TTFT of remote
  prefills, the p90 TPOT of finished requests, running and waiting counts, replicas by state.

Not modelled: the KV cache's capacity (no preemption), prefix caching, network jitter, failures.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.snapshot import Decision, PoolSnapshot, RoleSnapshot

from tandem.worker.api.names import WORKER_ROLES as ROLES


@dataclass
class Request:
    i: int
    arrival: float
    prompt: int
    output: int
    first_token: float = math.nan
    finish: float = math.nan
    local: bool = False

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / (self.output - 1) if self.output > 1 else math.nan


@dataclass
class Replica:
    rid: int
    role: str
    created: float
    ready_at: float
    gone_at: float = math.inf
    draining: bool = False
    cancelled: bool = False
    # prefill
    waiting: deque = field(default_factory=deque)  # request ids for the next engine steps
    queued_s: float = 0.0                          # their remote-prefill seconds one at a time (routing)
    batch: list = field(default_factory=list)      # request ids in the step now running
    step_end: float = 0.0                          # when that step ends
    # decode
    running: dict = field(default_factory=dict)    # request id -> [remaining tokens, context tokens]
    last: float = 0.0
    pause_until: float = 0.0
    version: int = 0
    pending_local: int = 0

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.draining and self.gone_at > now and not self.cancelled

    def alive(self, now: float) -> bool:
        return self.gone_at > now and not self.cancelled


class Fleet:
    """One simulation run. Call :meth:`run`; results are in ``requests``, ``timeline`` and ``decisions``.

    Args:
        perf: the performance model.
        policy: an object with ``decide(PoolSnapshot) -> Decision``.
        records: the trace's requests (dicts with timestamp, prompt_tokens, output_tokens), sorted.
        initial: replicas per role at t=0 (ready at once).
        startup_s: start-up time of a new replica; ``policy.ignores_startup`` (the oracle) makes it 0.
        tick_s, window_s: the policy's period and the metrics window (seconds).
        targets: the SLO per role (seconds), for the absorption rule.
        gpus: GPUs per replica of each role.
        duration: the run's length (seconds); requests still running at the end are finished off.
        max_batched_tokens: a prefill step's token budget (the engine's ``max_num_batched_tokens``).
        bounds: {role: (min, max)} replicas the pool allows; every policy's decision is held to them, as
            the pool's spec holds any autoscaler (tandem's policy applies them itself).

    Raises ValueError for a tick that is not > 0 or a negative start-up time.
    """

    def __init__(self, perf: PerfModel, policy, records: list[dict], initial: dict, startup_s: float = 120.0,
                 tick_s: float = 15.0, window_s: float = 30.0, targets: Optional[dict] = None,
                 gpus: Optional[dict] = None, duration: Optional[float] = None, max_batched_tokens: int = 2048,
                 bounds: Optional[dict] = None):
        if not (math.isfinite(tick_s) and tick_s > 0) or not (math.isfinite(startup_s) and startup_s >= 0):
            raise ValueError(f"tick_s must be > 0 and startup_s >= 0 (got {tick_s:g}, {startup_s:g})")
        self.perf, self.policy = perf, policy
        self.initial, self.bounds = dict(initial), bounds
        self.startup_s = 0.0 if getattr(policy, "ignores_startup", False) else float(startup_s)
        self.tick_s, self.window_s = float(tick_s), float(window_s)
        self.targets = targets or {"prefill": math.inf, "decode": math.inf}
        self.gpus = gpus or {"prefill": 1, "decode": 1}
        self.max_batched_tokens = int(max_batched_tokens)
        self.requests = [Request(i, float(r["timestamp"]), int(r["prompt_tokens"]), int(r["output_tokens"]))
                         for i, r in enumerate(records)]
        self.duration = float(duration if duration is not None else
                              (self.requests[-1].arrival if self.requests else 0.0))
        self.replicas: list[Replica] = []
        self.live: dict = {"prefill": [], "decode": []}   # not yet gone (routing scans only these)
        self.events: list = []
        self.seq = 0
        self.router_queue: list[int] = []
        self.absorb = False
        self.decisions: list[Decision] = []
        self.timeline: list[dict] = []
        # logs in time order (events run in time order), for the metrics windows
        self.arr_t: list[float] = []
        self.arr_prompt: list[int] = []
        self.ft_t: list[float] = []
        self.ft_ttft: list[float] = []
        self.fin_t: list[float] = []
        self.fin_tpot: list[float] = []
        self.dec_in_t: list[float] = []
        self.dec_in_out: list[int] = []
        self.gen_t: list[float] = [0.0]
        self.gen_v: list[float] = [0.0]
        self.generated = 0.0
        for role in ROLES:
            for _ in range(initial[role]):
                self._add_replica(role, 0.0, 0.0)

    # ---- events ------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def _add_replica(self, role: str, now: float, startup: float) -> Replica:
        r = Replica(len(self.replicas), role, now, now + startup, last=now)
        self.replicas.append(r)
        self.live[role].append(r)
        if startup > 0:
            self._push(now + startup, "ready", r.rid)
        return r

    def run(self) -> "Fleet":
        for req in self.requests:
            self._push(req.arrival, "arrive", req.i)
        t = self.window_s   # the first tick sees a full metrics window
        while t <= self.duration:
            self._push(t, "tick")
            t += self.tick_s
        while self.events:
            now, _, kind, args = heapq.heappop(self.events)
            getattr(self, "_on_" + kind)(now, *args)
        end = max([self.duration] + [r.finish for r in self.requests if not math.isnan(r.finish)])
        for r in self.replicas:
            if r.gone_at == math.inf:
                r.gone_at = end
        self.end = end
        return self

    def _on_arrive(self, now: float, i: int) -> None:
        req = self.requests[i]
        self.arr_t.append(now)
        self.arr_prompt.append(req.prompt)
        self._route(now, i)

    def _route(self, now: float, i: int) -> bool:
        req = self.requests[i]
        pre = [r for r in self.live["prefill"] if r.ready(now)]
        dec = [r for r in self.live["decode"] if r.ready(now)]
        if not dec or (not pre and not self.absorb):
            self.router_queue.append(i)
            return False
        s = self.perf.remote_prefill_seconds(req.prompt)
        p = min(pre, key=lambda r: (self._free_at(now, r), r.rid)) if pre else None
        done = (self._free_at(now, p) + s) if p is not None else math.inf
        if self.absorb and done - now > self.targets["prefill"]:
            # only a decode replica with nothing running has headroom here: a local prefill stalls the
            # whole batch (no chunked prefill), which would break the TPOT of every running sequence
            idle = [r for r in dec if not r.running and not r.pending_local]
            if idle:
                self._local_prefill(now, idle[0], req)
                return True
        if p is None:   # no prefill replica and no idle decode one: wait at the router
            self.router_queue.append(i)
            return False
        p.waiting.append(i)
        p.queued_s += s
        if not p.batch and p.ready_at <= now:
            self._start_step(now, p)
        return True

    def _free_at(self, now: float, p: Replica) -> float:
        """When prefill replica ``p`` would be free for one more prompt, serving its queue one prompt at a
        time (the router's estimate: batching only makes it sooner)."""
        return max(now, p.step_end) + p.queued_s

    def _start_step(self, now: float, p: Replica) -> None:
        batch, tokens = [], 0
        while p.waiting and (not batch or tokens + self.requests[p.waiting[0]].prompt <= self.max_batched_tokens):
            i = p.waiting.popleft()
            batch.append(i)
            tokens += self.requests[i].prompt
            p.queued_s -= self.perf.remote_prefill_seconds(self.requests[i].prompt)
        if not p.waiting:
            p.queued_s = 0.0   # no drift from the float sums
        p.batch = batch
        p.step_end = now + self.perf.remote_prefill_batch_seconds([self.requests[i].prompt for i in batch])
        self._push(p.step_end, "prefilled", p.rid)

    def _on_prefilled(self, now: float, prid: int) -> None:
        p = self.replicas[prid]
        batch, p.batch = p.batch, []
        # a join changes no replica's readiness, so the candidates are the same for every request
        dec = [r for r in self.live["decode"] if r.ready(now)]
        if not dec:   # the decode replica it was meant for went away: any alive one takes it
            dec = [r for r in self.live["decode"] if r.alive(now) and r.ready_at <= now]
        for i in batch:
            req = self.requests[i]
            req.first_token = now
            self.ft_t.append(now)
            self.ft_ttft.append(req.ttft)
            if not dec:
                self.router_queue.append(i)   # re-admitted when a decode replica is ready
                continue
            self._join(now, self._least_loaded(dec), req)
        if p.waiting:
            self._start_step(now, p)
        self._maybe_gone(now, p)

    # ---- decode ------------------------------------------------------------------------------
    @staticmethod
    def _least_loaded(dec: list) -> Replica:
        """The router's decode pick: the fewest sequences running or being prefilled there."""
        return min(dec, key=lambda r: (len(r.running) + r.pending_local, r.rid))

    def _step(self, d: Replica) -> float:
        if not d.running:
            return math.inf
        ctx = sum(v[1] for v in d.running.values()) / len(d.running)
        return self.perf.decode_step_seconds(len(d.running), ctx)

    def _advance(self, now: float, d: Replica) -> None:
        start = max(d.last, d.pause_until)
        if d.running and now > start:
            tok = (now - start) / self._step(d)
            for v in d.running.values():
                v[0] -= tok
                v[1] += tok
            self.generated += tok * len(d.running)
            self.gen_t.append(now)
            self.gen_v.append(self.generated)
        d.last = max(d.last, now)

    def _reschedule(self, now: float, d: Replica) -> None:
        d.version += 1
        if not d.running:
            return
        rem = min(v[0] for v in d.running.values())
        t = max(now, d.pause_until) + max(0.0, rem) * self._step(d)
        self._push(t, "decode", d.rid, d.version)

    def _join(self, now: float, d: Replica, req: Request) -> None:
        self._advance(now, d)
        self.dec_in_t.append(now)
        self.dec_in_out.append(req.output)
        if req.output <= 1:
            req.finish = now
            self._finished(now, req)
        else:
            d.running[req.i] = [float(req.output - 1), float(req.prompt + 1)]
        self._reschedule(now, d)

    def _local_prefill(self, now: float, d: Replica, req: Request) -> None:
        self._advance(now, d)
        req.local = True
        p = self.perf.local_prefill_seconds(req.prompt)
        d.pause_until = max(d.pause_until, now) + p
        d.pending_local += 1
        self._push(d.pause_until, "local_done", req.i, d.rid)
        self._reschedule(now, d)

    def _on_local_done(self, now: float, i: int, did: int) -> None:
        req, d = self.requests[i], self.replicas[did]
        d.pending_local -= 1
        req.first_token = now
        self.ft_t.append(now)
        self.ft_ttft.append(math.nan)   # not a remote prefill: the prefill pool's TTFT leaves it out
        self._join(now, d, req)

    def _on_decode(self, now: float, did: int, version: int) -> None:
        d = self.replicas[did]
        if version != d.version:
            return
        self._advance(now, d)
        for rid in [k for k, v in d.running.items() if v[0] <= 1e-6]:
            del d.running[rid]
            req = self.requests[rid]
            req.finish = now
            self._finished(now, req)
        self._reschedule(now, d)
        self._maybe_gone(now, d)

    def _finished(self, now: float, req: Request) -> None:
        if req.output > 1:
            self.fin_t.append(now)
            self.fin_tpot.append(req.tpot)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _on_ready(self, now: float, rid: int) -> None:
        r = self.replicas[rid]
        if r.cancelled:
            return
        r.step_end = max(r.step_end, now)
        r.last = now
        self._drain_router(now)

    def _drain_router(self, now: float) -> None:
        q, self.router_queue = self.router_queue, []
        for i in q:
            req = self.requests[i]
            if not math.isnan(req.first_token):   # prefilled, waiting for a decode replica
                dec = [r for r in self.live["decode"] if r.ready(now)]
                if dec:
                    self._join(now, self._least_loaded(dec), req)
                else:
                    self.router_queue.append(i)
            elif not self._route(now, i):
                pass   # _route queued it again

    def _maybe_gone(self, now: float, r: Replica) -> None:
        if not r.draining or r.gone_at != math.inf:
            return
        if (r.role == "prefill" and not r.batch and not r.waiting) or \
                (r.role == "decode" and not r.running and r.pending_local == 0):
            r.gone_at = now
            self.live[r.role].remove(r)

    def _apply(self, now: float, role: str, desired: int) -> None:
        mine = [r for r in self.live[role] if r.alive(now) and not r.draining]
        delta = desired - len(mine)
        for _ in range(delta):
            self._add_replica(role, now, self.startup_s)
        if delta < 0:
            starting = sorted([r for r in mine if r.ready_at > now], key=lambda r: -r.created)
            ready = sorted([r for r in mine if r.ready_at <= now], key=lambda r: (self._load(now, r), r.rid))
            for r in (starting + ready)[:-delta]:
                if r.ready_at > now:
                    r.cancelled, r.gone_at = True, now
                    self.live[role].remove(r)
                else:
                    r.draining = True
                    if r.role == "decode":
                        self._advance(now, r)
                    self._maybe_gone(now, r)
        if delta > 0 and self.startup_s == 0:
            self._drain_router(now)

    def _load(self, now: float, r: Replica) -> float:
        return self._free_at(now, r) - now if r.role == "prefill" else len(r.running) + r.pending_local

    # ---- metrics and the policy --------------------------------------------------------------
    def snapshot(self, now: float) -> PoolSnapshot:
        w = self.window_s
        lo = now - w
        a0 = _left(self.arr_t, lo)
        arrivals = (len(self.arr_t) - a0) / w
        prompt_tps = float(sum(self.arr_prompt[a0:])) / w
        f0 = _left(self.ft_t, lo)
        ttfts = np.asarray(self.ft_ttft[f0:], dtype=float)
        ttfts = ttfts[~np.isnan(ttfts)]
        t0 = _left(self.fin_t, lo)
        tpots = np.asarray(self.fin_tpot[t0:], dtype=float)
        d0 = _left(self.dec_in_t, lo)
        dec_arr = (len(self.dec_in_t) - d0) / w
        for r in self.live["decode"]:
            self._advance(now, r)
        g0 = _left(self.gen_t, lo)
        before = self.gen_v[g0 - 1] if g0 > 0 else 0.0
        out_tps = (self.generated - before) / w
        roles = {}
        for role in ROLES:
            mine = [r for r in self.live[role] if r.alive(now)]
            ready = [r for r in mine if r.ready(now)]
            starting = [r for r in mine if r.ready_at > now and not r.draining]
            draining = [r for r in mine if r.draining]
            if role == "prefill":
                waiting = sum(len(r.waiting) for r in mine)
                running = sum(len(r.batch) for r in mine)
                lat = float(np.percentile(ttfts, 90)) if ttfts.size else None
                arr = arrivals
            else:
                waiting = sum(r.pending_local for r in mine)
                running = sum(len(r.running) for r in mine)
                lat = float(np.percentile(tpots, 90)) if tpots.size else None
                arr = dec_arr
            busy = arrivals > 0 or running > 0 or waiting > 0 or self.router_queue
            roles[role] = RoleSnapshot(role, "ok" if busy else "idle", w, arr, prompt_tps if role == "prefill" else 0.0,
                                       out_tps if role == "decode" else 0.0, float(running), float(waiting), 0.0,
                                       lat, len(ready), len(starting), len(draining))
        rolling = any(r.draining for role in ROLES for r in self.live[role])
        return PoolSnapshot(now, roles["prefill"], roles["decode"], len(self.router_queue), rolling)

    def _on_tick(self, now: float) -> None:
        for role in ROLES:
            for r in list(self.live[role]):
                self._maybe_gone(now, r)
        snap = self.snapshot(now)
        dec = self.policy.decide(snap)
        self.decisions.append(dec)
        self.absorb = bool(dec.absorb_bursts)
        if not dec.advisory:
            for role in ROLES:
                want = dec.role(role).desired
                if self.bounds is not None:
                    lo, hi = self.bounds[role]
                    want = max(lo, min(hi, want))
                self._apply(now, role, want)
        self.timeline.append({"t": now, "prefill": self._count(now, "prefill"), "decode": self._count(now, "decode"),
                              "ttft_p90": snap.prefill.latency, "tpot_p90": snap.decode.latency,
                              "absorb": self.absorb})
        if self.router_queue:
            self._drain_router(now)

    def _count(self, now: float, role: str) -> int:
        return sum(1 for r in self.live[role] if not r.draining)


def _left(xs: list, x: float) -> int:
    import bisect
    return bisect.bisect_left(xs, x)
