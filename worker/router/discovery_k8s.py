"""The router's Kubernetes discovery: ready worker addresses of the pool's two headless Services.

It reads EndpointSlices where the server has them (`discovery.k8s.io/v1` from Kubernetes 1.21,
`v1beta1` on 1.17-1.20), and core/v1 Endpoints only as the last fallback (deprecated since 1.33).
The version is chosen once at start by discovery.

The operator gives the router a ServiceAccount whose Role may only get, list and watch endpointslices
and endpoints in the pool's namespace. Config: in-cluster, or KUBECONFIG where set. One watch per
Service runs in a daemon thread (the kubernetes client is synchronous); each relists on error with
backoff, so an apiserver restart only pauses updates. Only ready endpoints are used: a draining worker
turns not-ready and drops out of routing.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Callable, Optional

from tandem.worker.api.names import worker_url

log = logging.getLogger("tandem.router.discovery")

SLICE_GROUP = "discovery.k8s.io"
SLICE_VERSIONS = ("v1", "v1beta1")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _load_api_client():
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
    return client.ApiClient()


def slice_version(api_client) -> Optional[str]:
    """The EndpointSlice version the server serves (v1, else v1beta1), or None (use Endpoints)."""
    from kubernetes import client
    try:
        group = client.DiscoveryApi(api_client).get_api_group(_request_timeout=10)
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return None
        raise
    served = {v.version for v in group.versions or []}
    return next((v for v in SLICE_VERSIONS if v in served), None)


_url = worker_url


def ready_urls(endpoints: dict | None, port: int, not_ready: bool = False) -> list[str]:
    """http://IP:port for every ready address of an Endpoints object (as a plain dict), sorted; with
    ``not_ready``, the not-ready ones too."""
    if not endpoints:
        return []
    urls = set()
    for subset in endpoints.get("subsets") or []:
        ports = [p.get("port") for p in subset.get("ports") or []]
        use = port if (not ports or port in ports) else ports[0]
        for a in (subset.get("addresses") or []) + ((subset.get("notReadyAddresses") or []) if not_ready else []):
            ip = a.get("ip")
            if ip:
                urls.add(_url(ip, use))
    return sorted(urls)


def slice_ready_urls(slices: list[dict], port: int, not_ready: bool = False) -> list[str]:
    """http://IP:port for every ready endpoint of a Service's EndpointSlices (plain dicts), sorted.
    A missing `ready` condition counts as ready, as the API documents; with ``not_ready``, every
    endpoint (a draining or terminating pod's too)."""
    urls = set()
    for s in slices:
        ports = [p.get("port") for p in s.get("ports") or [] if p.get("port")]
        use = port if (not ports or port in ports) else ports[0]
        for ep in s.get("endpoints") or []:
            if not not_ready and (ep.get("conditions") or {}).get("ready") is False:
                continue
            for ip in ep.get("addresses") or []:
                urls.add(_url(ip, use))
    return sorted(urls)


class _Watcher:
    """Lists, then watches, the objects `list_fn(**selector)` returns; `urls_of(objects)` turns them
    into ready URLs. Relists with backoff on any error."""

    def __init__(self, name: str, list_fn: Callable, selector: dict, urls_of: Callable[..., list[str]],
                 to_dict: Callable, on_change):
        self.name, self.list_fn, self.selector, self.urls_of, self.to_dict = name, list_fn, selector, urls_of, to_dict
        self.urls: list[str] = []
        self.objs: dict[str, dict] = {}
        self.on_change = on_change
        self.stopped = threading.Event()
        self.synced = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"discovery-{name}", daemon=True)

    def all_urls(self) -> list[str]:
        """Every endpoint's URL, ready or not (``urls_of(objects, not_ready=True)``)."""
        return self.urls_of(list(self.objs.values()), not_ready=True)

    def _update(self) -> None:
        urls = self.urls_of(list(self.objs.values()))
        if urls != self.urls:
            log.info("endpoints of %s: %s", self.name, urls)
            self.urls = urls
            self.on_change()
        self.synced.set()

    def _run(self) -> None:
        from kubernetes import watch
        backoff = 0.5
        while not self.stopped.is_set():
            try:
                lst = self.to_dict(self.list_fn(**self.selector, _request_timeout=10))
                self.objs = {o["metadata"]["name"]: o for o in lst.get("items") or []}
                self._update()
                w = watch.Watch()
                for ev in w.stream(self.list_fn, **self.selector, resource_version=lst["metadata"]["resourceVersion"],
                                   timeout_seconds=30, _request_timeout=40):
                    if self.stopped.is_set():
                        w.stop()
                        break
                    obj = ev["raw_object"]
                    if ev["type"] == "ERROR":
                        raise RuntimeError(obj.get("message", "watch error"))
                    if ev["type"] == "DELETED":
                        self.objs.pop(obj["metadata"]["name"], None)
                    else:
                        self.objs[obj["metadata"]["name"]] = obj
                    self._update()
                backoff = 0.5
            except Exception as e:  # noqa: BLE001 - apiserver down or watch expired: relist
                if self.stopped.is_set():
                    break
                log.warning("watch of %s: %s; retrying in %.1fs", self.name, e, backoff)
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, 10.0)


class KubernetesEndpointsDiscovery:
    """Ready prefill and decode worker URLs from the EndpointSlices (else Endpoints) of the pool's two
    headless Services. The name is kept from when it read Endpoints only."""

    def __init__(self, namespace: str, prefill_service: str, decode_service: str, port: int):
        self.namespace = namespace
        self.prefill_service = prefill_service
        self.decode_service = decode_service
        self.port = int(port)
        self._watchers: list[_Watcher] = []
        self.version = 0
        self.api_version: Optional[str] = None

    def _changed(self) -> None:
        self.version += 1

    async def start(self, wait_seconds: float = 5.0) -> None:
        """Start watching; wait up to wait_seconds for the first listing of both Services."""
        import asyncio
        self._watchers = await asyncio.to_thread(self._make_watchers)
        for w in self._watchers:
            w.thread.start()
        deadline = time.monotonic() + wait_seconds
        for w in self._watchers:
            left = deadline - time.monotonic()
            if left > 0:
                await asyncio.to_thread(w.synced.wait, left)

    def _make_watchers(self) -> list[_Watcher]:
        from kubernetes import client
        api = _load_api_client()
        self.api_version = slice_version(api)
        out = []
        for svc in (self.prefill_service, self.decode_service):
            if self.api_version:
                list_fn = functools.partial(client.CustomObjectsApi(api).list_namespaced_custom_object,
                                            SLICE_GROUP, self.api_version, self.namespace, "endpointslices")
                out.append(_Watcher(f"{self.namespace}/{svc}", list_fn,
                                    {"label_selector": f"{SERVICE_NAME_LABEL}={svc}"},
                                    functools.partial(slice_ready_urls, port=self.port), lambda d: d, self._changed))
            else:
                core = client.CoreV1Api(api)
                out.append(_Watcher(f"{self.namespace}/{svc}",
                                    functools.partial(core.list_namespaced_endpoints, self.namespace),
                                    {"field_selector": f"metadata.name={svc}"},
                                    lambda objs, not_ready=False: ready_urls(objs[0] if objs else None, self.port,
                                                                             not_ready),
                                    api.sanitize_for_serialization, self._changed))
        log.info("discovery: %s", f"{SLICE_GROUP}/{self.api_version} EndpointSlices" if self.api_version
                 else "core/v1 Endpoints (no EndpointSlice API served)")
        return out

    async def stop(self) -> None:
        for w in self._watchers:
            w.stopped.set()

    def prefill_urls(self) -> list[str]:
        return list(self._watchers[0].urls) if self._watchers else []

    def decode_urls(self) -> list[str]:
        return list(self._watchers[1].urls) if len(self._watchers) > 1 else []

    def resumable_urls(self) -> list[str]:
        """Decode workers a stream may be resumed on: every endpoint of the decode Service, ready or not
        (a draining worker turns not-ready but still holds the streams it serves; the endpoints are the
        pool's own pods, never an address from a client)."""
        return self._watchers[1].all_urls() if len(self._watchers) > 1 else []
