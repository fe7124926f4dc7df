"""A worker's startup, made visible: the phase it is in and its progress, at ``/health`` and in the log.

A real model takes tens of seconds to minutes to start. The HTTP server comes up first and answers
``/health`` with 503 and ``{"status": "starting", "phase": ..., "progress": ...}`` while the engine
starts on a thread; once it is up, the full worker server answers every route. Phases, in order:

* ``reading``: weights read, converted to the serving dtype and placed (progress: bytes);
* ``converting``: the serving layout built (fused projections, FP8), layer by layer;
* ``profiling``: the activation peak of one full ``maxNumBatchedTokens`` step measured;
* ``capturing``: CUDA graphs captured (CUDA only);
* ``ready``.

The operator's startup probe (``operator/desired.py``, ``startup_probe``) gives this sequence time in
proportion to the model's size.
"""
from __future__ import annotations

import logging
import threading
import time

from aiohttp import web

from tandem.worker.api import auth
from tandem.worker.api.http import json_error, openai_app
from tandem.worker.api.sampling import faults_enabled

log = logging.getLogger(__name__)

PHASES = ("reading", "converting", "profiling", "capturing", "ready")


def worker_routes(app: web.Application, h) -> web.Application:
    """Add the routes a worker serves beside :func:`openai_app`'s, handled by ``h`` (the
    :class:`tandem.worker.server.app.WorkerServer`, or the front that stands in for it while it starts)."""
    app.router.add_post("/drain", h.drain)
    app.router.add_get("/drain", h.drain_status)
    # stream resumption, the pool only (tandem.worker.server.resumable)
    app.router.add_post("/v1/streams/resume", h.resume_stream)
    app.router.add_post("/v1/streams/cancel", h.cancel_stream)
    if faults_enabled():   # tests only: TANDEM_FAULT_INJECTION=1 (WorkerServer.fault_engine)
        app.router.add_post("/fault/engine", h.fault_engine)
    return app


class StartupStatus:
    """Where startup is; updated from the engine's thread, read from the event loop.

    :meth:`update` is the engine's ``progress(phase, done, total)`` callback. It logs a phase's start
    and every tenth of its progress (so a long ``reading`` shows in the log as it goes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.phase = "starting"
        self.done, self.total = 0, 0
        self.durations: dict[str, float] = {}
        self._phase_t0 = self.started
        self._logged_tenth = -1

    def update(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        with self._lock:
            if phase != self.phase:
                if self.phase != "starting":
                    self.durations[self.phase] = round(now - self._phase_t0, 3)
                self.phase, self._phase_t0, self._logged_tenth = phase, now, -1
                log.info("startup: %s", phase)
            self.done, self.total = done, total
            tenth = int(10 * done / total) if total else 0
            if phase != "ready" and tenth > self._logged_tenth and total:
                self._logged_tenth = tenth
                log.info("startup: %s %d%% (%d of %d)", phase, 10 * tenth, done, total)

    def ready(self) -> None:
        self.update("ready", 1, 1)

    def as_dict(self) -> dict:
        with self._lock:
            return {"phase": self.phase, "done": self.done, "total": self.total,
                    "progress": round(self.done / self.total, 4) if self.total else 0.0,
                    "elapsed_seconds": round(time.monotonic() - self.started, 3),
                    "phase_seconds": dict(self.durations)}


class StartingWorker:
    """The worker's HTTP face while the engine starts, then a pass-through to the real
    :class:`tandem.worker.server.app.WorkerServer` (:meth:`attach`): the port answers from the first
    second, and probes and the router see the phase."""

    def __init__(self, role: str, status: StartupStatus):
        self.role, self.status = role, status
        self.server = None
        self.error: str | None = None

    async def attach(self, server) -> None:
        """Hand every route to ``server`` (its startup hook runs here, on the loop)."""
        await server._startup(None)
        self.server = server

    def app(self, max_request_bytes: int, api_keys=None, pool_secret: bytes | None = None) -> web.Application:
        """The worker's app: the same routes and the same auth check (:func:`tandem.worker.api.auth.install`)
        as :meth:`WorkerServer.app`, refusals counted by the attached server's metrics."""
        return worker_routes(auth.install(openai_app(self, max_request_bytes), api_keys, pool_secret,
                                          self._refused), self)

    def _refused(self, what: str) -> None:
        if self.server is not None:
            self.server.metrics.auth_refused(what)

    async def _startup(self, app) -> None:
        pass

    async def _cleanup(self, app) -> None:
        if self.server is not None:
            await self.server._cleanup(app)

    async def health(self, request):
        if self.server is not None:
            return await self.server.health(request)
        body = {"status": "failed" if self.error else "starting", "role": self.role,
                "startup": self.status.as_dict(), **self.status.as_dict()}
        if self.error:
            body["error"] = self.error
        return web.json_response(body, status=503)

    def _delegate(name):  # noqa: N805 - a factory of handlers, run at class creation
        async def handler(self, request):
            if self.server is not None:
                return await getattr(self.server, name)(request)
            if name == "ready":
                return web.json_response({"ready": False, "starting": True, **self.status.as_dict()},
                                         status=503)
            return json_error(f"worker is starting ({self.status.phase})", 503)
        handler.__name__ = name
        return handler

    ready = _delegate("ready")
    models = _delegate("models")
    metrics_route = _delegate("metrics_route")
    completions = _delegate("completions")
    chat_completions = _delegate("chat_completions")
    drain = _delegate("drain")
    drain_status = _delegate("drain_status")
    resume_stream = _delegate("resume_stream")
    cancel_stream = _delegate("cancel_stream")
    fault_engine = _delegate("fault_engine")
    del _delegate
