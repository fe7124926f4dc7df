"""The fleet on a simulated clock: a discrete-event model of the router, the prefill and decode replicas,
their start-up and drain, driving a policy's ``decide`` every tick.

The model (seconds, tokens; costs from the calibration through :class:`~tandem.operator.autoscaler.capacity.PerfModel`):

- router (worker/router/policy.py's ``decide``, step for step): at arrival, the ready decode replica with
  the fewest requests in flight (then the most free KV) takes the request; with none ready the request
  waits in the router's queue (``router_queued``, the scale-from-zero signal) until one is. Then the
  prefill: local on that decode replica when the last decision set ``absorb_bursts`` and the replica
  holds at most half its KV, or when it caches at least half the prompt's prefix blocks, or when no
  prefill replica is ready; else remote, on the prefill replica whose prefix cache holds most of the
  prompt's leading blocks among those within 2 requests in flight of the least loaded (prefix affinity
  within a load bound, as SGLang's cache-aware router and Dynamo's KV router).
- prefix cache: each replica keeps the trace's ``hash_ids`` blocks (``block_tokens`` each) it has
  computed or received, least recently used first out, up to its KV capacity. A prompt's leading
  blocks found there are not computed again: prefill costs the calibration's a + b*n + c*n^2 + d*n*k
  with n the uncached and k the cached tokens.
- prefill replica: engine steps, first come, first served. A step takes every prompt waiting when it
  starts, up to the token budget (``max_batched_tokens``; at least one prompt), holds the replica for
  the batch's compute then the longest of its prompts' KV transfer tails, and every first token of the
  batch comes at its end. One uncached prompt alone takes the calibrated remote-prefill time.
- decode replica: continuous batching with a KV capacity (``kv_tokens``: the calibration's
  ``engine.num_blocks x block_size``). A sequence is admitted when its whole KV (prompt + output) fits
  beside the running ones, else it waits, first come first served, for one to finish (an engine
  that does not know the output length preempts instead; the simulator knows it and queues). Between
  two events the batch is fixed, so every running sequence advances at one token per
  ``decode_step_seconds(batch, mean context)``: the replica keeps one token clock for its whole batch
  and a heap of the clock readings at which its sequences end, so an event costs O(log batch), not
  O(batch), and no event happens per step. A local prefill stalls the batch for its compute (no
  chunked prefill).
- start-up: a new replica serves after ``startup_s``; it costs GPU time from its creation.
- scale-down: a starting replica is cancelled first (newest first); else the least-loaded ready replica
  drains (takes no new work, finishes what it holds, then goes).
- metrics: every tick the simulator builds the :class:`PoolSnapshot` a scraper would, over the last
  ``window_s``: arrivals and prompt tokens at the router, generated tokens, the p90 TTFT of remote
  prefills, the p90 TPOT of finished requests, running and waiting (KV-queued) counts, replicas by state.

Not modelled: network jitter, failures, preemption (see decode above).
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from operator import attrgetter
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
    hashes: Optional[list] = None   # prefix blocks (hash_ids of an imported trace)
    first_token: float = math.nan
    finish: float = math.nan
    local: bool = False
    cached: int = 0                 # prompt tokens found in the prefix cache where it was prefilled
    decode: int = -1                # the decode replica the router gave it

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
    in_flight: int = 0                             # requests the router gave it that are not done
    cache: OrderedDict = field(default_factory=OrderedDict)   # prefix block id -> None, LRU
    # prefill
    waiting: deque = field(default_factory=deque)  # request ids for the next engine steps
    batch: list = field(default_factory=list)      # request ids in the step now running
    step_end: float = 0.0                          # when that step ends
    # decode: one token clock for the batch (tokens each running sequence has made since t=0)
    n: int = 0                                     # sequences running
    vt: float = 0.0
    ends: list = field(default_factory=list)       # heap of (clock reading at its last token, request id)
    ctx_base: float = 0.0                          # sum of (context - vt) over the running sequences
    kv_used: int = 0                               # KV tokens held by the running sequences
    kv_queue: deque = field(default_factory=deque) # request ids waiting for KV room
    last: float = 0.0
    pause_until: float = 0.0
    version: int = 0
    pending_local: int = 0

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.draining and self.gone_at > now and not self.cancelled

    def alive(self, now: float) -> bool:
        return self.gone_at > now and not self.cancelled

    def matched(self, hashes) -> int:
        """Leading blocks of ``hashes`` in this replica's prefix cache."""
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def remember(self, hashes, capacity: int) -> None:
        c = self.cache
        for h in hashes:
            c[h] = None
            c.move_to_end(h)
        while len(c) > capacity:
            c.popitem(last=False)


#: the router's load bound for prefix affinity (worker/router/policy.py, pick_prefill)
LOAD_BOUND = 2
#: a decode replica takes an absorbed (local) prefill while at most this share of its KV is held
#: (worker/router/policy.py, BURST_HEADROOM_KV)
BURST_HEADROOM_KV = 0.5


_DECODE_KEY = attrgetter("in_flight", "kv_used", "rid")   # pick_decode: fewest in flight, then most free KV
_PREFILL_KEY = attrgetter("in_flight", "rid")
_IN_FLIGHT = attrgetter("in_flight")


class Fleet:
    """One simulation run. Call :meth:`run`; results are in ``requests``, ``timeline`` and ``decisions``.

    Args:
        perf: the performance model.
        policy: an object with ``decide(PoolSnapshot) -> Decision``.
        records: the trace's requests (dicts with timestamp, prompt_tokens, output_tokens, optional
            hash_ids), sorted by timestamp.
        initial: replicas per role at t=0 (ready at once).
        startup_s: start-up time of a new replica; ``policy.ignores_startup`` (the oracle) makes it 0.
        tick_s, window_s: the policy's period and the metrics window (seconds).
        targets: the SLO per role (seconds), for the absorption rule.
        gpus: GPUs per replica of each role.
        duration: the run's length (seconds); requests still running at the end are finished off.
        max_batched_tokens: a prefill step's token budget (the engine's ``max_num_batched_tokens``;
            default: the calibration's ``engine.max_num_batched_tokens``, else 2048).
        bounds: {role: (min, max)} replicas the pool allows; every policy's decision is held to them, as
            the pool's spec holds any autoscaler (tandem's policy applies them itself).
        kv_tokens: KV capacity of one replica in tokens (default: the calibration's
            ``engine.num_blocks x engine.block_size``; unbounded without them).
        block_tokens: tokens per ``hash_ids`` block (the trace header's ``params.block_tokens``; 512).

    Raises ValueError for a tick that is not > 0 or a negative start-up time.
    """

    def __init__(self, perf: PerfModel, policy, records: list[dict], initial: dict, startup_s: float = 120.0,
                 tick_s: float = 15.0, window_s: float = 30.0, targets: Optional[dict] = None,
                 gpus: Optional[dict] = None, duration: Optional[float] = None,
                 max_batched_tokens: Optional[int] = None, bounds: Optional[dict] = None,
                 kv_tokens: Optional[float] = None, block_tokens: int = 512):
        if not (math.isfinite(tick_s) and tick_s > 0) or not (math.isfinite(startup_s) and startup_s >= 0):
            raise ValueError(f"tick_s must be > 0 and startup_s >= 0 (got {tick_s:g}, {startup_s:g})")
        self.perf, self.policy = perf, policy
        self.initial, self.bounds = dict(initial), bounds
        self.startup_s = 0.0 if getattr(policy, "ignores_startup", False) else float(startup_s)
        self.tick_s, self.window_s = float(tick_s), float(window_s)
        self.targets = targets or {"prefill": math.inf, "decode": math.inf}
        self.gpus = gpus or {"prefill": 1, "decode": 1}
        engine = getattr(getattr(perf, "calibration", None), "engine", None) or {}
        self.max_batched_tokens = int(max_batched_tokens or engine.get("max_num_batched_tokens") or 2048)
        if kv_tokens is None:
            kv_tokens = engine["num_blocks"] * engine["block_size"] if engine.get("num_blocks") and \
                engine.get("block_size") else math.inf
        self.kv_tokens = float(kv_tokens)
        self.block_tokens = int(block_tokens)
        self._ds = tuple(perf._ds)
        self.cache_blocks = int(self.kv_tokens // self.block_tokens) if math.isfinite(self.kv_tokens) else 10 ** 9
        self.requests = [Request(i, float(r["timestamp"]), int(r["prompt_tokens"]), int(r["output_tokens"]),
                                 r.get("hash_ids") or None) for i, r in enumerate(records)]
        self.duration = float(duration if duration is not None else
                              (self.requests[-1].arrival if self.requests else 0.0))
        self.replicas: list[Replica] = []
        self.live: dict = {"prefill": [], "decode": []}   # not yet gone (routing scans only these)
        self._ready: dict = {}                            # role -> ready replicas, until a state changes
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
        self._ready.clear()
        if startup > 0:
            self._push(now + startup, "ready", r.rid)
        return r

    def ready_list(self, role: str, now: float) -> list:
        """The ready replicas of a role (cached: readiness changes only at ready, scale and gone events,
        and a starting replica's ``ready`` event clears the cache at its ``ready_at``)."""
        got = self._ready.get(role)
        if got is None:
            got = self._ready[role] = [r for r in self.live[role] if r.ready(now)]
        return got

    def run(self) -> "Fleet":
        t = self.window_s   # the first tick sees a full metrics window
        while t <= self.duration:
            self._push(t, "tick")
            t += self.tick_s
        arrivals, k, events = self.requests, 0, self.events
        while events or k < len(arrivals):
            # arrivals come from the sorted trace, not the heap: a run of 10^5-10^6 requests would
            # otherwise carry them all in the heap; on a tie the arrival goes first
            if k < len(arrivals) and (not events or arrivals[k].arrival <= events[0][0]):
                self._on_arrive(arrivals[k].arrival, k)
                k += 1
                continue
            now, _, kind, args = heapq.heappop(events)
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
        """The router's ``decide`` (module docs); False when the request waits in the router's queue."""
        req = self.requests[i]
        dec = self.ready_list("decode", now)
        if not dec:
            self.router_queue.append(i)
            return False
        kv = self.kv_tokens
        d = min(dec, key=_DECODE_KEY)
        d.in_flight += 1
        req.decode = d.rid
        h = req.hashes
        if (self.absorb and d.kv_used <= BURST_HEADROOM_KV * kv) or (h and 2 * d.matched(h) >= len(h)):
            self._local_prefill(now, d, req)
            return True
        pre = self.ready_list("prefill", now)
        if not pre:   # no_prefill_worker: the decode worker prefills it
            self._local_prefill(now, d, req)
            return True
        holding = None
        if h:
            bound = min(map(_IN_FLIGHT, pre)) + LOAD_BOUND
            h0 = h[0]
            # only a replica caching the first block can match any (most often none or a few do)
            holding = [r for r in pre if r.in_flight <= bound and h0 in r.cache]
        if holding:
            p = max(holding, key=lambda r: (r.matched(h), -r.in_flight, -r.rid))
        else:   # the least loaded replica is within the load bound, so no need to list those within it
            p = min(pre, key=_PREFILL_KEY)
        p.in_flight += 1
        p.waiting.append(i)
        if not p.batch and p.ready_at <= now:
            self._start_step(now, p)
        return True

    def _cached(self, r: Replica, req: Request) -> int:
        """Prompt tokens of ``req`` in ``r``'s prefix cache (whole leading blocks, at most prompt - 1:
        the last token is always computed, as an engine must for the first output token)."""
        if not req.hashes:
            return 0
        return min(req.prompt - 1, r.matched(req.hashes) * self.block_tokens)

    def _start_step(self, now: float, p: Replica) -> None:
        batch, tokens = [], 0
        reqs = self.requests
        while p.waiting and (not batch or tokens + reqs[p.waiting[0]].prompt <= self.max_batched_tokens):
            i = p.waiting.popleft()
            batch.append(i)
            tokens += reqs[i].prompt
        p.batch = batch
        perf = self.perf
        if len(batch) == 1 and not reqs[batch[0]].hashes:
            took = perf.remote_prefill_seconds(reqs[batch[0]].prompt)
        else:
            a, b, c, dd = perf._pf
            compute, tail = a, 0.0
            for i in batch:
                r = reqs[i]
                r.cached = k = self._cached(p, r)
                n = r.prompt - k
                compute += b * n + c * n * n + dd * n * k
                # the KV streams out while the step computes: its push ends one tail after the compute
                tail = max(tail, perf.kv_transfer_seconds(r.prompt) - perf.cached_prefill_seconds(r.prompt, k))
                if r.hashes:
                    p.remember(r.hashes, self.cache_blocks)
            took = max(1e-4, compute) + max(0.0, tail)
        p.step_end = now + took
        self._push(p.step_end, "prefilled", p.rid)

    def _on_prefilled(self, now: float, prid: int) -> None:
        p = self.replicas[prid]
        batch, p.batch = p.batch, []
        for i in batch:
            req = self.requests[i]
            req.first_token = now
            self.ft_t.append(now)
            self.ft_ttft.append(req.ttft)
            p.in_flight -= 1
            # the decode replica was chosen at arrival; it holds the request in flight, so it is still there
            self._join(now, self.replicas[req.decode], req)
        if p.waiting:
            self._start_step(now, p)
        self._maybe_gone(now, p)

    # ---- decode ------------------------------------------------------------------------------
    def _step(self, d: Replica) -> float:
        n = d.n
        if not n:
            return math.inf
        # PerfModel.decode_step_seconds at a whole batch, inlined: the run calls it twice an event
        c0, g, e, f = self._ds
        return max(1e-4, c0 + (g if n > 1 else 0.0) + e * n + f * (d.ctx_base + n * d.vt))

    def _advance(self, now: float, d: Replica) -> None:
        start = max(d.last, d.pause_until)
        if d.n and now > start:
            tok = (now - start) / self._step(d)
            d.vt += tok
            self.generated += tok * d.n
            self.gen_t.append(now)
            self.gen_v.append(self.generated)
        d.last = max(d.last, now)

    def _reschedule(self, now: float, d: Replica) -> None:
        d.version += 1
        if not d.n:
            return
        rem = d.ends[0][0] - d.vt
        t = max(now, d.pause_until) + max(0.0, rem) * self._step(d)
        self._push(t, "decode", d.rid, d.version)

    def _join(self, now: float, d: Replica, req: Request) -> None:
        """The first token is out; the sequence starts decoding on ``d`` when its KV fits there."""
        self._advance(now, d)
        self.dec_in_t.append(now)
        self.dec_in_out.append(req.output)
        if req.hashes:
            d.remember(req.hashes, self.cache_blocks)   # its KV arrived: the decode worker caches the prefix
        if req.output <= 1:
            req.finish = now
            d.in_flight -= 1
            self._finished(now, req)
        elif d.kv_queue or (d.n and d.kv_used + req.prompt + req.output > self.kv_tokens):
            d.kv_queue.append(req.i)
        else:
            self._admit(d, req)
        self._reschedule(now, d)

    def _admit(self, d: Replica, req: Request) -> None:
        d.n += 1
        d.kv_used += req.prompt + req.output
        d.ctx_base += req.prompt + 1 - d.vt
        heapq.heappush(d.ends, (d.vt + req.output - 1, req.i))

    def _local_prefill(self, now: float, d: Replica, req: Request) -> None:
        self._advance(now, d)
        req.local = True
        req.cached = self._cached(d, req)
        d.pause_until = max(d.pause_until, now) + self.perf.cached_prefill_seconds(req.prompt, req.cached)
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
        ends = d.ends
        while ends and ends[0][0] - d.vt <= 1e-6:
            end, i = heapq.heappop(ends)
            req = self.requests[i]
            d.n -= 1
            d.kv_used -= req.prompt + req.output
            d.ctx_base -= req.prompt + 1 - (end - (req.output - 1))   # what _admit added
            req.finish = now
            d.in_flight -= 1
            self._finished(now, req)
        if not d.n:
            d.ctx_base, d.kv_used = 0.0, 0   # no drift from the float sums
        while d.kv_queue and (not d.n or d.kv_used + self._kv_of(d.kv_queue[0]) <= self.kv_tokens):
            self._admit(d, self.requests[d.kv_queue.popleft()])
        self._reschedule(now, d)
        self._maybe_gone(now, d)

    def _kv_of(self, i: int) -> int:
        r = self.requests[i]
        return r.prompt + r.output

    def _finished(self, now: float, req: Request) -> None:
        if req.output > 1:
            self.fin_t.append(now)
            self.fin_tpot.append(req.tpot)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _on_ready(self, now: float, rid: int) -> None:
        r = self.replicas[rid]
        if r.cancelled:
            return
        self._ready.clear()
        r.step_end = max(r.step_end, now)
        r.last = now
        if r.waiting and not r.batch:
            self._start_step(now, r)
        self._drain_router(now)

    def _drain_router(self, now: float) -> None:
        q, self.router_queue = self.router_queue, []
        for i in q:
            self._route(now, i)   # queues it again when no decode replica is ready

    def _maybe_gone(self, now: float, r: Replica) -> None:
        if not r.draining or r.gone_at != math.inf:
            return
        if r.in_flight == 0 and not r.batch and not r.waiting and r.pending_local == 0:
            r.gone_at = now
            self.live[r.role].remove(r)
            self._ready.clear()

    def _apply(self, now: float, role: str, desired: int) -> None:
        mine = [r for r in self.live[role] if r.alive(now) and not r.draining]
        delta = desired - len(mine)
        for _ in range(delta):
            self._add_replica(role, now, self.startup_s)
        if delta < 0:
            self._ready.clear()
            starting = sorted([r for r in mine if r.ready_at > now], key=lambda r: -r.created)
            ready = sorted([r for r in mine if r.ready_at <= now], key=lambda r: (r.in_flight, r.rid))
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
                waiting = sum(r.pending_local + len(r.kv_queue) for r in mine)
                running = sum(r.n for r in mine)
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
