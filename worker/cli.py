"""The ``tandem`` command: ``generate`` (one completion), ``serve`` (one worker or router), ``up``
(a whole InferencePool as local processes), ``bench`` (load generator, calibration, traces),
``simulate`` (the autoscaling policy and its baselines on a simulated fleet).

This module only dispatches: each subcommand lives in its own module, imported when that subcommand
runs, so ``tandem serve --role router`` loads no operator code and ``tandem up`` no engine."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

#: subcommand -> (its module, the function there that registers its parser, its one-line help)
COMMANDS = {
    "generate": ("tandem.worker.generate_cli", "add_generate_command",
                 "one completion, streamed to the terminal"),
    "serve": ("tandem.worker.serve_cli", "add_serve_command", "run one process of a pool: a worker or the router"),
    "up": ("tandem.operator.up_cli", "add_up_command",
           "run an InferencePool manifest as local processes (the embedded default)"),
    "bench": ("tandem.worker.bench.cli", "add_bench_commands", "load generator, calibration and trace generators"),
    "simulate": ("tandem.operator.simulate.cli", "add_simulate_command",
                 "replay a trace against the autoscaling policy and its baselines on a simulated fleet"),
}


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The ``tandem`` parser with the full parsers of ``commands`` (default: all, importing each one's
    module) and a one-line placeholder for the others, enough for ``tandem --help``."""
    p = argparse.ArgumentParser(prog="tandem", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (module, register, help_) in COMMANDS.items():
        if commands is None or name in commands:
            getattr(importlib.import_module(module), register)(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # first find the subcommand with placeholders only (``tandem --help`` stops here), then build its parser
    chosen, _ = build_parser(commands=()).parse_known_args(argv)
    args = build_parser(commands=(chosen.command,)).parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
