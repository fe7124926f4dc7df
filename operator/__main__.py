"""Run the operator: `python -m tandem.operator [--namespace NS ...] [--peering NAME] [--webhook ...]`.

Flags map to the TANDEM_* environment variables read by handlers.py and the modules it starts; Kopf
does the rest.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.operator", description=__doc__)
    ap.add_argument("--namespace", "-n", action="append", default=[],
                    help="watch only these namespaces (repeatable); default: all")
    ap.add_argument("--peering", default=os.environ.get("TANDEM_PEERING", ""),
                    help="Kopf peering name for leader election (needs the KopfPeering CRDs); empty = standalone")
    ap.add_argument("--priority", type=int, default=int(os.environ.get("TANDEM_PRIORITY", "0") or 0))
    ap.add_argument("--webhook", choices=["off", "service", "url"], default=os.environ.get("TANDEM_WEBHOOK", "off"))
    ap.add_argument("--webhook-listen", default=os.environ.get("TANDEM_WEBHOOK_LISTEN", "0.0.0.0:9443"))
    ap.add_argument("--webhook-service", default=os.environ.get("TANDEM_WEBHOOK_SERVICE", ""),
                    help="namespace/name:port of the webhook's Service (mode service)")
    ap.add_argument("--webhook-host", default=os.environ.get("TANDEM_WEBHOOK_HOST", ""), help="mode url")
    ap.add_argument("--webhook-secret", default=os.environ.get("TANDEM_WEBHOOK_SECRET", ""),
                    help="namespace/name of a Secret to keep the webhook CA and certificate in")
    ap.add_argument("--resync-seconds", default=os.environ.get("TANDEM_RESYNC_SECONDS", "10"))
    ap.add_argument("--metrics-port", default=os.environ.get("TANDEM_METRICS_PORT", "0"))
    ap.add_argument("--liveness", default=os.environ.get("TANDEM_LIVENESS", ""),
                    help="e.g. http://0.0.0.0:8080/healthz")
    ap.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "INFO"))
    a = ap.parse_args(argv)
    os.environ.update({
        "TANDEM_WEBHOOK": a.webhook, "TANDEM_WEBHOOK_LISTEN": a.webhook_listen,
        "TANDEM_WEBHOOK_SERVICE": a.webhook_service, "TANDEM_WEBHOOK_HOST": a.webhook_host,
        "TANDEM_WEBHOOK_SECRET": a.webhook_secret, "TANDEM_RESYNC_SECONDS": str(a.resync_seconds),
        "TANDEM_METRICS_PORT": str(a.metrics_port), "TANDEM_NAMESPACES": ",".join(a.namespace)})
    logging.basicConfig(level=getattr(logging, a.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers
    asyncio.run(kopf.operator(
        clusterwide=not a.namespace, namespaces=a.namespace,
        standalone=not a.peering, peering_name=a.peering or None, priority=a.priority,
        liveness_endpoint=a.liveness or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
