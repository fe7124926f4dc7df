"""The router's Kubernetes discovery: ready worker addresses from core/v1 Endpoints (every Kubernetes
version has them).

The operator gives the router a ServiceAccount whose Role may only get, list and watch endpoints in
the pool's namespace. Config: in-cluster, or KUBECONFIG where set. One watch per Service runs in a
daemon thread (the kubernetes client is synchronous); each relists on error with backoff, so an
apiserver restart only pauses updates. Only `addresses` (ready pods) are used, never
`notReadyAddresses`: a draining worker turns not-ready and drops out of routing.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

log = logging.getLogger("tandem.router.discovery")


def _load_api():
    from kubernetes import client, config
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config(os.environ["KUBECONFIG"])
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    try:
        import urllib3
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    except Exception:  # noqa: BLE001
        pass
    return client.CoreV1Api()


def ready_urls(endpoints: dict | None, port: int) -> list[str]:
    """http://IP:port for every ready address of an Endpoints object (as a plain dict), sorted."""
    if not endpoints:
        return []
    urls = set()
    for subset in endpoints.get("subsets") or []:
        ports = [p.get("port") for p in subset.get("ports") or []]
        use = port if (not ports or port in ports) else ports[0]
        for a in subset.get("addresses") or []:
            ip = a.get("ip")
            if ip:
                urls.add(f"http://{ip}:{use}")
    return sorted(urls)


class _Watcher:
    def __init__(self, api, namespace: str, name: str, port: int, on_change):
        self.api, self.namespace, self.name, self.port = api, namespace, name, port
        self.urls: list[str] = []
        self.on_change = on_change
        self.stopped = threading.Event()
        self.synced = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"endpoints-{name}", daemon=True)

    def _set(self, obj: Optional[dict]) -> None:
        urls = ready_urls(obj, self.port)
        if urls != self.urls:
            log.info("endpoints %s/%s: %s", self.namespace, self.name, urls)
            self.urls = urls
            self.on_change()
        self.synced.set()

    def _run(self) -> None:
        from kubernetes import watch
        backoff = 0.5
        sel = f"metadata.name={self.name}"
        while not self.stopped.is_set():
            try:
                lst = self.api.list_namespaced_endpoints(self.namespace, field_selector=sel, _request_timeout=10)
                items = self.api.api_client.sanitize_for_serialization(lst.items)
                self._set(items[0] if items else None)
                rv = lst.metadata.resource_version
                w = watch.Watch()
                for ev in w.stream(self.api.list_namespaced_endpoints, self.namespace, field_selector=sel,
                                   resource_version=rv, timeout_seconds=30, _request_timeout=40):
                    if self.stopped.is_set():
                        w.stop()
                        break
                    obj = self.api.api_client.sanitize_for_serialization(ev["object"])
                    self._set(None if ev["type"] == "DELETED" else obj)
                backoff = 0.5
            except Exception as e:  # noqa: BLE001 - apiserver down or watch expired: relist
                if self.stopped.is_set():
                    break
                log.warning("endpoints watch %s/%s: %s; retrying in %.1fs", self.namespace, self.name, e, backoff)
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, 10.0)


class KubernetesEndpointsDiscovery:
    """Ready prefill and decode worker URLs from the Endpoints of the pool's two headless Services."""

    def __init__(self, namespace: str, prefill_service: str, decode_service: str, port: int):
        self.namespace = namespace
        self.prefill_service = prefill_service
        self.decode_service = decode_service
        self.port = int(port)
        self._watchers: list[_Watcher] = []
        self.version = 0

    def _changed(self) -> None:
        self.version += 1

    async def start(self, wait_seconds: float = 5.0) -> None:
        """Start watching; wait up to wait_seconds for the first listing of both Services."""
        import asyncio
        api = await asyncio.to_thread(_load_api)
        self._watchers = [_Watcher(api, self.namespace, s, self.port, self._changed)
                          for s in (self.prefill_service, self.decode_service)]
        for w in self._watchers:
            w.thread.start()
        deadline = time.monotonic() + wait_seconds
        for w in self._watchers:
            left = deadline - time.monotonic()
            if left > 0:
                await asyncio.to_thread(w.synced.wait, left)

    async def stop(self) -> None:
        for w in self._watchers:
            w.stopped.set()

    def prefill_urls(self) -> list[str]:
        return list(self._watchers[0].urls) if self._watchers else []

    def decode_urls(self) -> list[str]:
        return list(self._watchers[1].urls) if len(self._watchers) > 1 else []
