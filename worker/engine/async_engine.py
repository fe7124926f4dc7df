"""The engine on a thread of its own, driven from asyncio.

The HTTP server and the KV transfer live on the event loop; the model runs on one engine thread
(torch releases the GIL inside its ops). Everything that touches engine state runs on that thread:
callers submit functions with :meth:`AsyncEngine.call`, and outputs come back to per-request
asyncio queues.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from tandem.worker.engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine thread stopped after an error; the message says which."""


class AsyncEngine:
    """Runs ``engine.step()`` in a loop on a background thread while there is work.

    Args:
        engine: the engine to drive.
        on_step: optional ``fn(engine, outputs)`` called on the engine thread after each step
            (metrics).
        on_dead: optional ``fn(error)`` called on the event loop once the engine thread has died and
            every request it held has been failed (the worker process then exits: serve_cli).
    """

    def __init__(self, engine: LLMEngine, on_step: Callable | None = None, on_dead: Callable | None = None):
        self.engine = engine
        self.on_step = on_step
        self.on_dead = on_dead
        self.injected_fault: str | None = None   # a test hook (inject_fault)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.queues: dict[str, asyncio.Queue] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.stopped = False
        self.error: BaseException | None = None
        self._ids = itertools.count()

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        if self.thread:
            self.thread.join(timeout=10)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self.stopped:
                while True:
                    try:
                        fn, fut = self.commands.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        res = fn()
                    except BaseException as e:  # handed to the caller's future
                        self.loop.call_soon_threadsafe(_set_exc, fut, e)
                    else:
                        self.loop.call_soon_threadsafe(_set_result, fut, res)
                if self.injected_fault is not None:
                    raise RuntimeError(self.injected_fault)
                if engine.scheduler.has_work():
                    outputs = engine.step()
                    if self.on_step:
                        self.on_step(engine, outputs)
                    if outputs:
                        self.loop.call_soon_threadsafe(self._dispatch, outputs)
                else:
                    self.wake.wait(timeout=0.5)
                    self.wake.clear()
        except BaseException as e:
            log.exception("engine thread died")
            self.error = e
        else:
            self.error = EngineDead("engine stopped")
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fail_all, self.error)

    # ---- event loop -------------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self.queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, e: BaseException) -> None:
        """The engine thread is gone: every request's stream and every pending :meth:`call` fails now.

        Runs on the event loop. ``error`` was set before this was scheduled, so a ``call`` made after
        this point raises at once, and one made before has its command in the queue, drained here."""
        dead = _dead(e)
        for q in self.queues.values():
            q.put_nowait(dead)
        while True:
            try:
                _, fut = self.commands.get_nowait()
            except queue.Empty:
                break
            _set_exc(fut, dead)
        if self.on_dead is not None and not self.stopped:
            self.on_dead(e)

    def inject_fault(self, message: str = "injected engine fault") -> None:
        """Test hook: the engine thread raises ``RuntimeError(message)`` at its next turn, as a broken
        model or KV cache would make it (only reachable with TANDEM_FAULT_INJECTION=1)."""
        self.injected_fault = message
        self.wake.set()

    def post(self, request_id: str, item) -> None:
        """Thread-safe: put ``item`` on a request's queue (used by KV sinks on the engine thread)."""
        self.loop.call_soon_threadsafe(self._put, request_id, item)

    def _put(self, request_id: str, item) -> None:
        q = self.queues.get(request_id)
        if q is not None:
            q.put_nowait(item)

    async def call(self, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps; return its result or raise
        its exception. Raises EngineDead when the engine thread is gone (also while waiting).

        Cancelling the caller does not withdraw the command: ``fn`` still runs (commands run in the
        order they were made, so an abort made after an add undoes it)."""
        if self.error is not None:
            raise _dead(self.error)
        fut = self.loop.create_future()
        self.commands.put((lambda: fn(*args, **kwargs), fut))
        self.wake.set()
        return await fut

    @contextlib.asynccontextmanager
    async def request(self, request_id: str) -> AsyncIterator["RequestHandle"]:
        """Own ``request_id`` for the body of an ``async with``: its output queue is open, and however
        the body ends (finished, refused, an error, cancellation, a client gone), the request is
        aborted on the engine thread, freeing its KV blocks, unless it finished or was never added.

        The body adds the request with :meth:`RequestHandle.add` and reads :meth:`RequestHandle.outputs`.
        """
        h = RequestHandle(self, request_id, self.open(request_id))
        try:
            yield h
        finally:
            self.close(request_id)
            if h.live and self.error is None:
                # shielded: the abort is queued even when the caller was cancelled
                await asyncio.shield(self.call(self.engine.abort, request_id))

    def open(self, request_id: str) -> asyncio.Queue:
        """Register (before adding the request) the queue a request's outputs will arrive on."""
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs. Raises InvalidRequestError before the first output.

        Close the generator (``contextlib.aclosing``) when leaving it early: that is what aborts."""
        async with self.request(request_id) as h:
            await h.add(self.engine.add_request, request_id, prompt_token_ids=prompt_token_ids,
                        params=params, **kwargs)
            async for out in h.outputs():
                yield out


class RequestHandle:
    """One request's place on the event loop: its output queue and whether the engine may hold it."""

    def __init__(self, aengine: AsyncEngine, request_id: str, q: asyncio.Queue):
        self.aengine, self.request_id, self.q = aengine, request_id, q
        self.live = False       # the engine may hold the request: leaving must abort it

    async def add(self, fn: Callable, *args, **kwargs):
        """Run an adding call (``add_request``, ``add_remote_request``) on the engine thread.

        If the caller is cancelled while waiting, the add still happens, so the handle counts the
        request as live from before the call; it is not live only when ``fn`` itself raised."""
        self.live = True
        try:
            return await self.aengine.call(fn, *args, **kwargs)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self.live = False
            raise

    async def outputs(self) -> AsyncIterator:
        """What arrives for the request (RequestOutputs, and KV items on a prefill worker) until its
        finished output. Raises EngineDead when the engine stops."""
        while True:
            item = await self.q.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, RequestOutput) and item.finished:
                self.live = False
                yield item
                return
            yield item


def _dead(e: BaseException) -> EngineDead:
    return e if isinstance(e, EngineDead) else EngineDead(f"engine stopped: {e!r}")


def _set_result(fut: asyncio.Future, res) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exc(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
