"""The workers' preStop hook: `python -m tandem.operator.drain --port 8000 --timeout 110`.

POSTs /drain (the worker stops admitting work and turns not-ready, so it drops out of the Endpoints),
then polls GET /drain until nothing is left in flight or the timeout passes. The kubelet then sends
SIGTERM; terminationGracePeriodSeconds is set 10 s above the timeout. Exits 0 in every case, so a
missing /drain route (an older worker) never blocks termination. Where the pod mounts the pool secret
(TANDEM_POOL_SECRET_FILE), the POST carries the pool token: a worker takes a drain only from its pool.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request


def _left(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode() or "{}"
    try:
        d = json.loads(body)
    except ValueError:
        return 0
    if isinstance(d, dict):
        for k in ("in_flight", "inflight", "remaining", "left", "count"):
            if isinstance(d.get(k), int):
                return d[k]
        if d.get("drained") is True:
            return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--timeout", type=float, default=110)
    a = ap.parse_args(argv)
    url = f"http://{a.host}:{a.port}/drain"
    deadline = time.time() + a.timeout
    headers = {"Content-Type": "application/json"}
    try:
        from tandem.worker.api.auth import load_pool_secret, pool_headers
        headers.update(pool_headers(load_pool_secret()))
    except Exception as e:  # noqa: BLE001 - SIGTERM drains too; never block termination
        print(f"drain: no pool token: {e}", file=sys.stderr)
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST", headers=headers),
                               timeout=5).read()
    except Exception as e:  # noqa: BLE001
        print(f"drain: POST {url}: {e}", file=sys.stderr)
        return 0
    while time.time() < deadline:
        try:
            if _left(url) == 0:
                return 0
        except Exception:  # noqa: BLE001
            return 0
        time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
