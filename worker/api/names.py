"""Names more than one process must agree on: roles, pod labels, ports and environment variables.

The operator writes them into pods, `tandem up` into its processes' environment, and the workers, the
router and the autoscaler read them back; a name changed on one side only would fail silently, so each
is defined here once. Metric names are in :mod:`tandem.worker.api.metrics`."""
from __future__ import annotations

#: The two worker roles, each a pool sized on its own SLO (prefill on TTFT, decode on TPOT).
WORKER_ROLES = ("prefill", "decode")
#: Every role of an InferencePool: the worker pools and the router.
POOL_ROLES = (*WORKER_ROLES, "router")
#: ``tandem serve --role``: a pool's roles, and ``both`` (one worker that prefills and decodes).
SERVE_ROLES = ("both", *POOL_ROLES)

#: Pod labels the operator sets and the router's Kubernetes discovery and the autoscaler select on.
LABEL_POOL = "serving.tandem.dev/pool"
LABEL_ROLE = "serving.tandem.dev/role"


def selector(pool: str, role: str) -> dict[str, str]:
    """The labels that select one role's pods of a pool."""
    return {LABEL_POOL: pool, LABEL_ROLE: role}


#: The port every role serves on inside its pod (HTTP: OpenAI API, /health, /ready, /metrics, /drain),
#: and ``tandem serve``'s default.
WORKER_PORT = 8000
#: The prefill worker's KV-transfer port (TCP), next to its HTTP port.
KV_PORT = WORKER_PORT + 1

#: The worker's CPU share in whole cores, set by whoever starts it: the local fleet from the role's
#: ``resources.requests.cpu``, Kubernetes through the Downward API (``requests.cpu``, divisor 1).
CPU_THREADS_ENV = "TANDEM_CPU_THREADS"

#: Set by a parent that owns a ``tandem serve`` process (``tandem up``): its pid. The process gets
#: SIGTERM (drain, then exit) when that parent dies, however it dies.
PARENT_PID_ENV = "TANDEM_PARENT_PID"


def worker_url(ip: str, port: int) -> str:
    """A worker's HTTP URL from its IP (v4 or v6) and port: how the router names it (Endpoints) and how
    a prefill worker vouches for itself (tandem.worker.api.peer_claim)."""
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"
