"""The operator's REST client retries 409/5xx and connection errors with backoff (against a MOCK
HTTP server that fails on purpose; the real apiserver restart is in test_cluster_e2e.py)."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from tandem.operator.kube import Kube, KubeError

pytestmark = pytest.mark.timeout(60)


class MockApiServer:
    """MOCK: answers each path with a scripted list of status codes, then 200."""

    def __init__(self, script: dict[str, list[int]]):
        self.script = {k: list(v) for k, v in script.items()}
        self.hits: dict[str, int] = {}
        outer = self

        class H(BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                path = self.path.split("?")[0]
                outer.hits[path] = outer.hits.get(path, 0) + 1
                codes = outer.script.get(path, [])
                code = codes.pop(0) if codes else 200
                if code == -1:  # drop the connection without an answer
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                body = json.dumps({"kind": "Status", "code": code, "message": f"scripted {code}"} if code >= 300
                                  else {"kind": "ConfigMap", "metadata": {"name": "x"}}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            do_GET = do_PATCH = do_POST = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def kube(self, retries: int = 6) -> Kube:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{self.srv.server_address[1]}"
        cfg.retries = False
        return Kube(client.ApiClient(cfg), retries=retries, base_delay=0.01)

    def close(self):
        self.srv.shutdown()


def test_retries_conflicts_5xx_and_dropped_connections():
    m = MockApiServer({"/api/v1/namespaces/a/configmaps/x": [409, 500, 503, -1, 504]})
    try:
        out = m.kube().apply("/api/v1/namespaces/a/configmaps/x", {"apiVersion": "v1", "kind": "ConfigMap"})
        assert out["metadata"]["name"] == "x"
        assert m.hits["/api/v1/namespaces/a/configmaps/x"] == 6
    finally:
        m.close()


def test_gives_up_after_retries_and_does_not_retry_4xx():
    m = MockApiServer({"/api/v1/namespaces/a/configmaps/x": [503] * 10, "/api/v1/namespaces/a/configmaps/y": [422],
                       "/api/v1/namespaces/a/configmaps/missing": [404, 404]})
    try:
        with pytest.raises(KubeError) as ei:
            m.kube(retries=3).get("/api/v1/namespaces/a/configmaps/x")
        assert ei.value.status == 503 and m.hits["/api/v1/namespaces/a/configmaps/x"] == 3
        with pytest.raises(KubeError) as ei:
            m.kube().apply("/api/v1/namespaces/a/configmaps/y", {})
        assert ei.value.status == 422 and m.hits["/api/v1/namespaces/a/configmaps/y"] == 1
        # a GET of a missing object is None, at once: 404 is an answer, not an error to retry
        assert m.kube().get("/api/v1/namespaces/a/configmaps/missing") is None
        assert m.hits["/api/v1/namespaces/a/configmaps/missing"] == 1
    finally:
        m.close()


def test_a_creates_409_is_already_exists_and_not_retried():
    """A POST answered 409 is AlreadyExists: raised at once (the pool Secret is POSTed on every pass,
    and retrying its 409 cost every reconcile about 6 s); a 409 to an apply is a conflict, retried."""
    m = MockApiServer({"/api/v1/namespaces/a/secrets": [409, 409, 409]})
    try:
        with pytest.raises(KubeError) as ei:
            m.kube().request("POST", "/api/v1/namespaces/a/secrets", body={"kind": "Secret"})
        assert ei.value.status == 409 and m.hits["/api/v1/namespaces/a/secrets"] == 1
    finally:
        m.close()
