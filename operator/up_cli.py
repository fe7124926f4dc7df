"""``tandem up``'s command line: an InferencePool manifest as local processes (operator/local.py)."""
from __future__ import annotations

from tandem.worker.api.names import WORKER_PORT


def _up(args) -> int:
    from tandem.operator.local import run_up
    return run_up(args)


def add_up_command(sub) -> None:
    """Register ``tandem up`` on the top-level subparsers."""
    u = sub.add_parser("up", help="run an InferencePool manifest as local processes (the embedded default)")
    u.add_argument("manifest", help="an InferencePool YAML, e.g. examples/smollm2.yaml")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=WORKER_PORT, help="the router's port (0: a free one)")
    u.add_argument("--ask", default=None, metavar="QUESTION",
                   help="once the pool is ready, send this chat question, print the answer, and stop")
    u.add_argument("--autoscale-window", type=float, default=30.0, metavar="SECONDS",
                   help="autoscaled pools: the window metrics are read over (default 30)")
    u.add_argument("--autoscale-interval", type=float, default=5.0, metavar="SECONDS",
                   help="autoscaled pools: seconds between autoscaler decisions (default 5)")
    u.add_argument("--calibration", default=None, metavar="FILE",
                   help="autoscaled pools: a performance model from `tandem bench calibrate` "
                        "(e.g. bench/calibrations/smollm2-cpu.yaml)")
    u.set_defaults(func=_up)
