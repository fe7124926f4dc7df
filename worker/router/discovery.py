"""Where the router finds its workers: a list in the config or in a file the local fleet rewrites as
it scales, or Kubernetes Endpoints."""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)


class StaticDiscovery:
    """Fixed worker URLs, as ``tandem up`` passes them."""

    def __init__(self, prefill: list[str], decode: list[str]):
        self._prefill, self._decode = list(prefill), list(decode)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def prefill_urls(self) -> list[str]:
        return self._prefill

    def decode_urls(self) -> list[str]:
        return self._decode

    def resumable_urls(self) -> list[str]:
        """Decode workers that may hold a stream to resume: the routable ones and those draining."""
        return self.decode_urls()

    def absorb_bursts(self) -> bool:
        """Whether the autoscaler asks for local prefill on decode workers with headroom."""
        return False


class FileDiscovery(StaticDiscovery):
    """Worker URLs from a JSON file ``{"prefill": [...], "decode": [...], "absorbBursts": bool}`` that the local fleet
    replaces (write, then rename) as it starts and drains workers. The file is read again whenever
    its modification time or size changes, checked on every call (a ``stat``): the router learns of
    workers without a restart. A file that is missing or half-written keeps the last good lists."""

    def __init__(self, path: str):
        super().__init__([], [])
        self._resumable: list[str] = []
        self.path = path
        self._seen: tuple | None = None
        self._absorb = False
        self._refresh()

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._seen:
            return
        try:
            with open(self.path) as f:
                d = json.load(f)
            prefill, decode = list(d.get("prefill", [])), list(d.get("decode", []))
        except (OSError, ValueError, AttributeError) as e:
            log.warning("discovery file %s unreadable (%s); keeping the last lists", self.path, e)
            return
        self._seen, self._prefill, self._decode = key, prefill, decode
        self._absorb = bool(d.get("absorbBursts", False))
        self._resumable = list(d.get("resumable", decode))

    def prefill_urls(self) -> list[str]:
        self._refresh()
        return self._prefill

    def decode_urls(self) -> list[str]:
        self._refresh()
        return self._decode

    def absorb_bursts(self) -> bool:
        self._refresh()
        return self._absorb

    def resumable_urls(self) -> list[str]:
        """The ready decode workers and those draining (the file's ``resumable``): a draining worker
        is out of routing but still serves the streams it holds."""
        self._refresh()
        return self._resumable


def make_discovery(spec: dict | None):
    """Build the discovery a worker config names (``mode: static | kubernetes``).

    Raises ValueError for a missing or unknown mode.
    """
    spec = spec or {}
    mode = spec.get("mode")
    if mode == "static":
        if spec.get("file"):
            return FileDiscovery(spec["file"])
        return StaticDiscovery(spec.get("prefill", []), spec.get("decode", []))
    if mode == "kubernetes":
        from tandem.worker.router.discovery_k8s import KubernetesEndpointsDiscovery
        return KubernetesEndpointsDiscovery(spec["namespace"], spec["prefillService"], spec["decodeService"],
                                            int(spec["port"]))
    raise ValueError(f"discovery.mode must be static or kubernetes, got {mode!r}")
