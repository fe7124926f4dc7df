"""A thin, retrying Kubernetes REST client for the operator: raw paths, server-side apply, discovery.

The kubernetes package's typed models don't cover everything we apply (policy/v1beta1 PDBs on client 37,
ServiceMonitor, Gateway API Inference Extension), so the operator talks to the REST API by path with
JSON bodies. 409 conflicts, 429, 5xx and connection errors/timeouts are retried with exponential backoff;
what still fails raises `KubeError` (the Kopf handlers turn it into a TemporaryError).
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.parse
from typing import Any, Optional

from kubernetes import client, config

log = logging.getLogger("tandem.operator.kube")
try:  # the test cluster uses a self-signed serving certificate with insecure-skip-tls-verify
    import urllib3
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
except Exception:  # noqa: BLE001
    pass

FIELD_MANAGER = "tandem-operator"
RETRY_STATUS = {409, 429, 500, 502, 503, 504}
#: The server judged the object itself invalid: sending it again cannot help until the spec changes.
PERMANENT_STATUS = {400, 422}


def is_permanent(e: "KubeError") -> bool:
    """Whether an API error stays until the pool's spec changes (400 Bad Request, 422 Invalid).
    Everything else (403 quota or RBAC, 404, 409, 429, 5xx, no answer) may clear by itself."""
    return e.status in PERMANENT_STATUS


class KubeError(Exception):
    """An API request that failed: `status` is the HTTP status (0 when no answer came), `message` the
    server's message."""

    def __init__(self, status: int, message: str, body: Any = None):
        self.status = status
        self.message = message
        self.body = body
        super().__init__(f"HTTP {status}: {message}")


def load_config() -> client.ApiClient:
    """In-cluster config, else KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api: Optional[client.ApiClient] = None, retries: int = 6, base_delay: float = 0.2,
                 timeout: float = 20.0):
        self.api = api or load_config()
        if os.environ.get("POD_NAME"):   # the audit log's userAgent then names the operator replica
            self.api.user_agent = f"tandem-operator/{os.environ['POD_NAME']}"
        self.retries = retries
        self.base_delay = base_delay
        self.timeout = timeout
        self._disc: dict[str, Optional[set[str]]] = {}
        self._disc_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self.calls = {"GET": 0, "PATCH": 0, "DELETE": 0, "POST": 0, "PUT": 0}

    # ---- raw requests ---------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, query: Optional[dict] = None,
                content_type: Optional[str] = None, retry: bool = True) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        elif body is not None:
            headers["Content-Type"] = "application/json"
        q = list((query or {}).items())
        attempts = self.retries if retry else 1
        last: Exception | None = None

        def retryable(status) -> bool:
            # a create's 409 is AlreadyExists, an answer, not a conflict to retry: the pool Secret's
            # POST on every pass once spent ~6 s of retries on it, and a pool's retries of a
            # refused child came 6 s late (tests/operator/test_failing_pools.py, quota)
            return retry and i + 1 < attempts and not (method == "POST" and status == 409)
        for i in range(attempts):
            try:
                params = self.api.param_serialize(method, path, query_params=q, header_params=dict(headers),
                                                  body=body, auth_settings=["BearerToken"])
                self.calls[method] = self.calls.get(method, 0) + 1
                resp = self.api.call_api(*params, _request_timeout=self.timeout)
                resp.read()
                status = resp.status
                data = resp.data
                text = data.decode() if isinstance(data, bytes) else (data or "")
                if 200 <= status < 300:
                    return json.loads(text) if text else None
                try:
                    err = json.loads(text)
                    msg = err.get("message", text)
                except ValueError:
                    err, msg = text, text
                exc = KubeError(status, msg, err)
                if status in RETRY_STATUS and retryable(status):
                    last = exc
                else:
                    raise exc
            except client.exceptions.ApiException as e:
                exc = KubeError(e.status or 0, e.reason or str(e), e.body)
                if (e.status in RETRY_STATUS or not e.status) and retryable(e.status):
                    last = exc
                else:
                    raise exc from None
            except KubeError:
                raise
            except Exception as e:  # noqa: BLE001 - connection refused/reset, timeouts
                last = e
                if not retry or i + 1 >= attempts:
                    raise KubeError(0, f"{type(e).__name__}: {e}") from None
            delay = min(self.base_delay * (2 ** i), 5.0) * (0.5 + random.random())
            log.debug("retrying %s %s in %.2fs after %s", method, path, delay, last)
            time.sleep(delay)
        raise KubeError(0, str(last))

    def get(self, path: str, query: Optional[dict] = None) -> Optional[dict]:
        """GET, or None on 404."""
        try:
            return self.request("GET", path, query=query)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def apply(self, path: str, body: dict, force: bool = True) -> dict:
        """Server-side apply under the operator's one field manager."""
        q = {"fieldManager": FIELD_MANAGER}
        if force:
            q["force"] = "true"
        return self.request("PATCH", path, body=body, query=q, content_type="application/apply-patch+yaml")

    def merge_patch(self, path: str, body: dict) -> dict:
        return self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    def delete(self, path: str, propagation: str = "Background") -> None:
        try:
            self.request("DELETE", path, body={"propagationPolicy": propagation})
        except KubeError as e:
            if e.status != 404:
                raise

    # ---- discovery ------------------------------------------------------------------------------
    def resources_of(self, group_version: str, ttl: float = 60.0) -> Optional[set[str]]:
        """Plural resource names served by a group/version (None when it is not served); cached."""
        with self._lock:
            if group_version in self._disc and time.time() - self._disc_at[group_version] < ttl:
                return self._disc[group_version]
        path = f"/api/{group_version}" if group_version == "v1" else f"/apis/{group_version}"
        doc = self.get(path)
        val = None if doc is None else {r["name"] for r in doc.get("resources", [])}
        with self._lock:
            self._disc[group_version] = val
            self._disc_at[group_version] = time.time()
        return val

    def has(self, group_version: str, plural: str, ttl: float = 60.0) -> bool:
        res = self.resources_of(group_version, ttl)
        return res is not None and plural in res

    def pdb_api_version(self) -> str:
        """policy/v1 where served (1.21+), else policy/v1beta1."""
        return "policy/v1" if self.has("policy/v1", "poddisruptionbudgets", ttl=3600) else "policy/v1beta1"


def object_path(api_version: str, plural: str, namespace: Optional[str], name: Optional[str] = None,
                subresource: Optional[str] = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    p = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    if name:
        p += "/" + urllib.parse.quote(name)
    if subresource:
        p += "/" + subresource
    return p


#: kind -> plural for what the operator makes.
PLURALS = {"Deployment": "deployments", "Service": "services", "ConfigMap": "configmaps",
           "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
           "PodDisruptionBudget": "poddisruptionbudgets", "ServiceMonitor": "servicemonitors",
           "NetworkPolicy": "networkpolicies", "Secret": "secrets",
           "InferencePool": "inferencepools", "Event": "events"}


def path_of(obj: dict, subresource: Optional[str] = None) -> str:
    md = obj["metadata"]
    return object_path(obj["apiVersion"], PLURALS[obj["kind"]], md.get("namespace"), md["name"], subresource)
