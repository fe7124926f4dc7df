"""Where the router finds its workers: a static list (the local fleet) or Kubernetes Endpoints."""
from __future__ import annotations


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


def make_discovery(spec: dict | None):
    """Build the discovery a worker config names (``mode: static | kubernetes``).

    Raises ValueError for a missing or unknown mode.
    """
    spec = spec or {}
    mode = spec.get("mode")
    if mode == "static":
        return StaticDiscovery(spec.get("prefill", []), spec.get("decode", []))
    if mode == "kubernetes":
        from tandem.worker.router.discovery_k8s import KubernetesEndpointsDiscovery
        return KubernetesEndpointsDiscovery(spec["namespace"], spec["prefillService"], spec["decodeService"],
                                            int(spec["port"]))
    raise ValueError(f"discovery.mode must be static or kubernetes, got {mode!r}")
