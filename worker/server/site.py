"""The HTTP listener of every tandem process (router and workers): aiohttp's TCPSite with a bound on
open connections, so idle or slow clients cannot use up the process's file descriptors before any
authentication (docs/security.md, "Connections").

Two limits, both on connections rather than requests:

- an idle timeout (aiohttp's ``keepalive_timeout``): a connection that sends no request, or none after
  its last response, is closed after that many seconds (aiohttp's default is 3630);
- a cap on open connections, under the process's ``RLIMIT_NOFILE``. At the cap a new connection
  closes the oldest connections that have no request in progress, so a flood of idle connections
  cannot lock out a probe or a client; only when every connection is busy is the new one refused.
  This is nginx's behaviour for keep-alive connections at ``worker_connections``.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time

from aiohttp import web

log = logging.getLogger(__name__)

DEFAULT_KEEPALIVE_SECONDS = 20.0
DEFAULT_MAX_CONNECTIONS = 4096
#: file descriptors kept for everything but client connections (model files, KV sockets, logs)
RESERVED_FDS = 256


def connection_limit(wanted: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """``wanted``, lowered so that the connections and one outgoing connection each (the router's
    proxying, a worker's KV pull) stay under the soft ``RLIMIT_NOFILE`` with ``RESERVED_FDS`` to spare."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, (soft - RESERVED_FDS) // 2))


class _Refused(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        transport.abort()


class CappedTCPSite(web.TCPSite):
    """A TCPSite that holds at most ``max_connections`` connections (see the module's docstring).
    ``evicted`` and ``refused`` count the connections closed at the cap."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int):
        # a backlog as deep as the cap (aiohttp's is 128): a burst of connections queues rather than
        # having its SYNs dropped, which costs a probe behind it a 1 s retransmission
        super().__init__(runner, host, port, backlog=max(128, min(max_connections, 4096)))
        self.max_connections = max_connections
        self.evicted = self.refused = 0
        self._warned = 0.0

    def _protocol(self):
        server = self._runner.server
        # closed ones stay in the manager's list until their connection_lost runs: not counted
        conns = [h for h in server.connections if h.transport is not None]
        if len(conns) >= self.max_connections:
            # the oldest first (the manager keeps them in arrival order); at least one, at most 1/16
            idle = [h for h in conns if not getattr(h, "_request_in_progress", True)]
            for h in idle[:max(1, self.max_connections // 16)]:
                h.force_close()
                self.evicted += 1
            if not idle:
                self.refused += 1
                now = time.monotonic()
                if now - self._warned > 10:
                    self._warned = now
                    log.warning("%d connections, all busy: refusing new ones (%d so far)", len(conns),
                                self.refused)
                return _Refused()
        return server()

    async def start(self) -> None:
        await web.BaseSite.start(self)   # registers the site with its runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port,
                                                backlog=self._backlog, reuse_address=self._reuse_address,
                                                reuse_port=self._reuse_port)
