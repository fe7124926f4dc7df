"""``tandem bench serve | compare | calibrate | trace | chaos``."""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

from tandem.worker.bench.arrivals import KINDS


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.replace(",", " ").split()]


#: requests a drawn dataset (random, sharegpt) has unless ``--num-prompts`` says otherwise; a trace is
#: replayed whole (until the ninth session it, too, was cut at 100 requests without a word)
DEFAULT_NUM_PROMPTS = 100


def build_dataset(args):
    """The dataset the arguments describe: loaded from ``--load-dataset``, or drawn from the seed."""
    from tandem.worker.bench import datasets as ds
    if args.load_dataset:
        return ds.Dataset.load(args.load_dataset)
    from tandem.worker.bench.tokens import DEFAULT_TOKENIZER, PromptMaker, load_tokenizer
    maker = PromptMaker(load_tokenizer(args.tokenizer or DEFAULT_TOKENIZER))
    kind = args.dataset
    if kind == "random":
        return ds.random_dataset(maker, args.num_prompts or DEFAULT_NUM_PROMPTS, args.input_len, args.output_len, args.length_dist,
                                 args.length_spread, args.seed)
    if kind == "sharegpt":
        return ds.sharegpt_dataset(maker, args.dataset_path, args.num_prompts or DEFAULT_NUM_PROMPTS, args.seed,
                                   args.output_len if args.sharegpt_fixed_output else None)
    if kind == "prefix":
        return ds.prefix_dataset(maker, args.num_prefixes, args.prefix_len, args.questions_per_prefix,
                                 args.input_len, args.output_len, args.seed)
    if kind == "multiturn":
        return ds.multiturn_dataset(maker, args.sessions, args.turns, args.input_len, args.output_len,
                                    args.think_time, args.system_len, args.seed)
    return ds.trace_dataset(maker, args.dataset_path, args.num_prompts or None, args.prefix_len, args.seed)


def _serve(args) -> int:
    from rich.console import Console

    from tandem.worker.bench import plots, report
    from tandem.worker.bench.client import Target
    from tandem.worker.bench.metrics import parse_slo, summarize
    from tandem.worker.bench.runner import LoadShape, run
    from tandem.worker.bench.sweep import sweep

    console = Console(stderr=True)
    try:
        slo = parse_slo(args.slo)
        percentiles = tuple(_floats(args.percentiles))
        if args.dataset in ("sharegpt", "trace") and not (args.dataset_path or args.load_dataset):
            raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
        for opt, path in (("--dataset-path", args.dataset_path), ("--load-dataset", args.load_dataset)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{opt} {path}: no such file")
        dataset = build_dataset(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.save_dataset:
        dataset.save(args.save_dataset)
    arrival = "trace" if dataset.kind == "trace" and args.arrival == "poisson" and args.request_rate == math.inf \
        else args.arrival
    load = LoadShape(arrival, args.request_rate, args.burstiness, args.ramp_end_rate, args.concurrency, args.seed)
    target = Target(args.base_url, args.model, args.endpoint, not args.no_ignore_eos, args.min_tokens,
                    args.temperature, args.timeout, api_key=os.environ.get("OPENAI_API_KEY") or None,
                    tokenizer=args.tokenizer)
    out = Path(args.output_dir) if args.output_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def save(summary, result, folder: Path | None) -> None:
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        report.write_summary(summary, folder / "summary.json")
        report.write_requests(result, folder / "requests.jsonl")
        if not args.no_plots:
            plots.latency_cdfs(result, folder / "latency_cdf.png")

    async def run_one(shape):
        return await run(target, dataset, shape, progress=not args.no_progress and sys.stderr.isatty())

    try:
        if args.sweep:
            def point(s, result):
                report.print_summary(s, console)
                save(s, result, out / f"rate-{s['load']['request_rate']:g}" if out else None)
            res = asyncio.run(sweep(run_one, _floats(args.sweep), load, slo, args.slo_attainment, percentiles,
                                    point))
            console.print(f"sweep stopped: {res['stopped'] or 'all rates run'}; highest rate meeting the SLOs "
                          f"({slo or 'none given'}, attainment >= {args.slo_attainment:.0%}): "
                          f"{res['max_rate_meeting_slo']}")
            if out:
                report.write_summary(res, out / "sweep.json")
                if not args.no_plots:
                    plots.sweep_plot(res["points"], out / "sweep.png", f"{dataset.kind} sweep")
            failed = sum(p["failed"] for p in res["points"])
        else:
            result = asyncio.run(run_one(load))
            s = summarize(result, slo, percentiles)
            report.print_summary(s, console)
            save(s, result, out)
            if args.json:
                print(json.dumps(s, indent=2, default=float))
            failed = s["failed"]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if failed and args.fail_on_error else 0


def _compare(args) -> int:
    """Two summaries: the ratio table B/A (every metric). More runs, or --table/--markdown/--cdf/--slo:
    the side-by-side table of the headline metrics, one row per run (report.side_by_side)."""
    from tandem.worker.bench import report
    from tandem.worker.bench.metrics import parse_slo
    try:
        slo = parse_slo(args.slo)
        runs = [report.load_run(p) for p in args.runs]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.names and len(args.names) != len(runs):
        print(f"error: --names gives {len(args.names)} names for {len(runs)} runs", file=sys.stderr)
        return 2
    names = args.names or [Path(p).parent.name if Path(p).is_file() else Path(p).name for p in args.runs]
    if len(runs) == 2 and not (args.table or args.markdown or args.cdf or slo):
        report.print_compare(runs[0]["summary"], runs[1]["summary"], tuple(names))
        return 0
    rows = report.side_by_side(list(zip(names, runs)), slo)
    title = f"tandem bench compare (goodput at {slo})" if slo else "tandem bench compare"
    if args.markdown:
        print(report.side_by_side_markdown(rows))
    else:
        report.print_side_by_side(rows, title)
    if args.cdf:
        from tandem.worker.bench.plots import compare_cdfs
        missing = [n for n, r in zip(names, runs) if r["requests"] is None]
        if missing:
            print(f"error: --cdf needs requests.jsonl beside each summary; missing for {', '.join(missing)}",
                  file=sys.stderr)
            return 2
        compare_cdfs([(n, r["requests"]) for n, r in zip(names, runs)], args.cdf, args.cdf_title or "")
    return 0


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="load-test an OpenAI-compatible endpoint (as vllm bench serve)")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)")
    s.add_argument("--model", required=True, help="the OpenAI model name to send")
    s.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    g = s.add_argument_group("dataset")
    g.add_argument("--dataset", choices=["random", "sharegpt", "prefix", "multiturn", "trace"], default="random")
    g.add_argument("--dataset-path", help="sharegpt: the JSON file; trace: the JSON Lines trace")
    g.add_argument("--load-dataset", help="a dataset saved with --save-dataset (overrides --dataset)")
    g.add_argument("--save-dataset", help="write the drawn dataset here (JSON Lines)")
    g.add_argument("--tokenizer", default=None, help="model source (PATH of a .gguf or HF directory, or "
                   "package:PKG/FILE) whose tokenizer sizes the prompts (default: the SmolLM2 package) and counts "
                   "the tokens of streams without usage (default: a tandem server's own model; otherwise such "
                   "streams are no_usage errors)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests to draw (default {DEFAULT_NUM_PROMPTS}); trace: the first N (default: all)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (prefix: question; multiturn: each user turn)")
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--length-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    g.add_argument("--length-spread", type=float, default=0.0, help="uniform: range ratio; lognormal: sigma")
    g.add_argument("--sharegpt-fixed-output", action="store_true", help="sharegpt: --output-len for every request")
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=256, help="prefix: system prompt tokens; trace: shared "
                   "tokens of a prefix_group")
    g.add_argument("--questions-per-prefix", type=int, default=8)
    g.add_argument("--sessions", type=int, default=8)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--think-time", type=float, default=1.0, help="mean seconds between an answer and the next turn")
    g.add_argument("--system-len", type=int, default=0, help="multiturn: system prompt tokens of each session")
    g.add_argument("--seed", type=int, default=0)
    a = s.add_argument_group("load")
    a.add_argument("--request-rate", type=float, default=math.inf, help="requests (or sessions) per second")
    a.add_argument("--arrival", choices=KINDS, default="poisson")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    a.add_argument("--ramp-end-rate", type=float, default=None, help="ramp: the rate at the last request")
    a.add_argument("--concurrency", type=int, default=0, help="a closed loop of this many in flight")
    a.add_argument("--sweep", default=None, help="rates to sweep, e.g. 1,2,4,8 (stops at saturation)")
    r = s.add_argument_group("requests and results")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    r.add_argument("--min-tokens", action="store_true", help="also send min_tokens = max_tokens (vLLM)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--slo", nargs="*", default=None, help="e.g. ttft=0.5 tpot=0.05 e2e=10 (seconds)")
    r.add_argument("--slo-attainment", type=float, default=0.9, help="sweep: the attainment a rate must reach")
    r.add_argument("--percentiles", default="50,90,99")
    r.add_argument("--output-dir", default=None, help="summary.json, requests.jsonl, PNG plots")
    r.add_argument("--json", action="store_true", help="also print the JSON summary on stdout")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--fail-on-error", action="store_true", help="exit 1 when any request failed")
    s.set_defaults(func=_serve)


def add_bench_commands(sub) -> None:
    """Register ``tandem bench ...`` on the top-level subparsers."""
    b = sub.add_parser("bench", help="load generator, calibration and trace generators")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    _add_serve(bsub)
    c = bsub.add_parser("compare", help="runs side by side (servers or loads on the same dataset); "
                        "two runs alone: every metric with ratios B/A")
    c.add_argument("runs", nargs="+", help="summary.json files, or the run folders holding them")
    c.add_argument("--names", nargs="*", default=None, help="a name per run (default: the folder names)")
    c.add_argument("--slo", nargs="*", default=None,
                   help="goodput at this SLO, recomputed from each run's requests.jsonl (e.g. ttft=1 tpot=0.2)")
    c.add_argument("--table", action="store_true", help="the side-by-side table even for two runs")
    c.add_argument("--markdown", action="store_true", help="print the side-by-side table as Markdown")
    c.add_argument("--cdf", default=None, metavar="PNG", help="TTFT and TPOT CDFs, one line per run")
    c.add_argument("--cdf-title", default=None)
    c.set_defaults(func=_compare)
    try:
        from tandem.worker.bench.calibrate import add_calibrate_command
        add_calibrate_command(bsub)
    except ImportError:
        pass
    try:
        from tandem.worker.bench.trace import add_trace_command
        add_trace_command(bsub)
    except ImportError:
        pass
    from tandem.worker.bench.chaos import add_chaos_command
    add_chaos_command(bsub)
