"""Drive a dataset against a target: an open loop on a seeded schedule, or a closed loop of a fixed
concurrency.

Open loop: send times are drawn before the first request goes and kept whatever the server does;
each request is its own task, and the HTTP client has no connection limit (aiohttp's default of 100
per client would hold the 101st request back and silently lower the rate). Multi-turn sessions
arrive on the schedule; each later turn follows its think time after the previous answer, so it is
not on the schedule and stays out of the send-lag report.

Closed loop (``concurrency``): that many workers each send their next request (or session) as soon
as the previous one ends; it measures a server at a fixed load, not at a rate, and is reported so.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field

import aiohttp

from tandem.worker.bench.arrivals import schedule
from tandem.worker.bench.client import RequestRecord, Target, send
from tandem.worker.bench.counting import count_without_usage, served_tokenizer
from tandem.worker.bench.datasets import BenchRequest, Dataset


@dataclass
class LoadShape:
    """How requests arrive: ``arrival`` is an :func:`arrivals.schedule` kind, or ``concurrency`` > 0
    for a closed loop (then arrival and rate are unused)."""
    arrival: str = "poisson"
    rate: float = math.inf
    burstiness: float = 1.0
    ramp_end_rate: float | None = None
    concurrency: int = 0
    seed: int = 0

    @property
    def closed(self) -> bool:
        return self.concurrency > 0

    def describe(self) -> str:
        if self.closed:
            return f"closed loop, concurrency {self.concurrency}"
        if self.arrival == "trace":
            return "open loop, trace timestamps"
        extra = f", burstiness {self.burstiness}" if self.arrival == "gamma" else ""
        extra += f" to {self.ramp_end_rate}/s" if self.arrival == "ramp" else ""
        return f"open loop, {self.arrival} {self.rate}/s{extra}"


@dataclass
class RunResult:
    records: list[RequestRecord]
    load: LoadShape
    start_mono: float
    end_mono: float
    start_unix: float
    dataset_kind: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return max(self.end_mono - self.start_mono, 1e-9)


def _units(dataset: Dataset) -> list[list[BenchRequest]]:
    """Sessions (turns in order), or single requests, in dataset order."""
    if not dataset.multiturn:
        return [[r] for r in dataset.requests]
    by: dict = {}
    for r in dataset.requests:
        by.setdefault(r.session, []).append(r)
    return [sorted(turns, key=lambda r: r.turn) for turns in by.values()]


class _Progress:
    def __init__(self, total: int, enabled: bool, label: str):
        self.p = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
            self.p = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), transient=True)
            self.task = self.p.add_task(label, total=total)

    def __enter__(self):
        if self.p:
            self.p.start()
        return self

    def __exit__(self, *exc):
        if self.p:
            self.p.stop()

    def advance(self) -> None:
        if self.p:
            self.p.advance(self.task)


async def _warm_up(session: aiohttp.ClientSession, target: Target) -> dict | None:
    """One cheap GET before the clock starts (vLLM's benchmark sends a test prompt for the same
    reason): the client's first connection and first pass through aiohttp's code are slower than
    the rest, and on an open loop that shows up as send lag of the first requests. A GET of the
    models list leaves the server's engine and any test double's request record untouched. Returns
    the models list (it names a tandem server's tokenizer source), or None."""
    base = target.url.split("/v1/")[0]
    with contextlib.suppress(Exception):
        async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.json(content_type=None) if r.status == 200 else None
    return None


async def run(target: Target, dataset: Dataset, load: LoadShape, progress: bool = False,
              warm_up: bool = True) -> RunResult:
    """Send every request of ``dataset`` to ``target`` under ``load``; returns one record per request.
    ``warm_up`` opens the client's first connection before the clock starts (see :func:`_warm_up`).
    Streams without usage are counted with ``target.tokenizer`` (or a tandem server's own) after the
    run (:func:`counting.count_without_usage`); the source used is ``result.extra["tokenizer"]``.

    Raises ValueError for a multi-turn dataset on the completions endpoint (turns resend chat
    messages), or a trace schedule for a dataset without timestamps."""
    if dataset.multiturn and target.endpoint != "chat":
        raise ValueError("multi-turn sessions need the chat endpoint")
    units = _units(dataset)
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    with _Progress(len(dataset.requests), progress, load.describe()) as bar:
        async with aiohttp.ClientSession(connector=connector) as session:
            models = await _warm_up(session, target) if warm_up else None

            async def one_unit(turns: list[BenchRequest], intended: float | None) -> None:
                history: list[dict] = []
                for k, req in enumerate(turns):
                    rec = RequestRecord(req.id, req.session, req.turn, scheduled=intended is not None and k == 0,
                                        intended_mono=intended if k == 0 else None)
                    records.append(rec)
                    if k and req.think_time:
                        await asyncio.sleep(req.think_time)
                    await send(session, target, req, rec, history)
                    bar.advance()
                    if not rec.ok:
                        for later in turns[k + 1:]:   # the conversation cannot go on without this answer
                            skipped = RequestRecord(later.id, later.session, later.turn, False, None,
                                                    send_mono=rec.end_mono, end_mono=rec.end_mono,
                                                    prompt_tokens_asked=later.prompt_tokens,
                                                    output_tokens_asked=later.output_tokens)
                            records.append(skipped.fail("session_aborted", f"turn {rec.turn} failed"))
                            bar.advance()
                        return
                    history = history + req.messages + [{"role": "assistant", "content": rec.text}]

            start_unix, start = time.time(), time.monotonic()
            if load.closed:
                queue = list(units)

                async def worker() -> None:
                    while queue:
                        await one_unit(queue.pop(0), None)

                await asyncio.gather(*(worker() for _ in range(min(load.concurrency, len(units)))))
            else:
                stamps = [u[0].timestamp for u in units] if load.arrival == "trace" else None
                if load.arrival == "trace" and any(s is None for s in stamps):
                    raise ValueError("a trace schedule needs a dataset with timestamps (--dataset trace)")
                offsets = schedule(load.arrival, len(units), load.rate, load.seed, load.burstiness,
                                   load.ramp_end_rate, stamps)
                # a short lead, so the first request's intended time is not already past when it is due
                start_unix, start = time.time() + 0.02, time.monotonic() + 0.02
                tasks = []
                for unit, off in zip(units, offsets):
                    due = start + float(off)
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one_unit(unit, due)))
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for t in tasks:
                        t.cancel()
                    with contextlib.suppress(Exception):
                        await asyncio.gather(*tasks, return_exceptions=True)
            end = max([r.end_mono for r in records if r.end_mono] + [start])
    order = {r.id: i for i, r in enumerate(dataset.requests)}
    records.sort(key=lambda r: order.get(r.id, 0))
    source = target.tokenizer or served_tokenizer(models)
    extra = {"tokenizer": source} if count_without_usage(records, source) else {}
    return RunResult(records, load, start, end, start_unix, dataset.kind, extra)
