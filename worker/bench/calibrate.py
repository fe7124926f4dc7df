"""``tandem bench calibrate``: measure a running worker over HTTP and fit the performance model of
:mod:`tandem.worker.api.calibration`.

- Prefill: the TTFT of 1-token completions whose prompts are fresh random token ids (no cache hits),
  and of prompts that start with a prefix sent just before (so its full blocks are cached).
- Decode step: ``batch`` concurrent ``ignore_eos`` streams with ``context``-token prompts; the median
  gap between tokens in the second half of each stream, once every prompt has been prefilled and the
  batch is steady.
- KV transfer (with ``--pd-url``): through a prefill/decode fleet's router, the decode worker's
  ``tandem:kv_transfer_seconds`` and ``tandem:kv_transfer_bytes_total`` per request. The KV streams
  while the prefill worker computes, so this is the decode worker's whole wait for a remote prefill.
Each point is the fastest of ``repeats`` measurements (as ``timeit`` reports): on a shared machine other
work only ever adds time, so the minimum is the stable estimate of what the worker itself costs. With
``statistic="median"`` (``--statistic median``) it is their median instead: the typical cost of a
minute on that machine, which is what a simulation of a fleet running there should be fed (the
minimum ran 15-30% below the replays on this project's shared VM; docs/autoscaler.md). Point it at a
``both`` worker (or a decode worker, which prefills locally when no prefill peer is named), not at a
router.
"""
from __future__ import annotations

import asyncio
import datetime
import platform
import statistics
import sys

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tandem.worker.api.calibration import Calibration, fit
from tandem.worker.bench.client import RequestRecord, Target, send
from tandem.worker.bench.datasets import BenchRequest

BLOCK = 16


class Probe:
    """Sends calibration requests (token-id prompts on /v1/completions) to one endpoint."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, seed: int = 0,
                 vocab: tuple[int, int] = (256, 10000)):
        self.session, self.rng, self.vocab = session, np.random.default_rng(seed), vocab
        self.target = Target(base_url, model, endpoint="completions", ignore_eos=True)
        self.n = 0

    def ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(*self.vocab, size=n)]

    async def request(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        self.n += 1
        req = BenchRequest(f"cal{self.n}", [], len(prompt), max_tokens, prompt_token_ids=prompt)
        rec = await send(self.session, self.target, req, RequestRecord(req.id, None, 0, False, None))
        if not rec.ok:
            raise RuntimeError(f"calibration request failed: {rec.error_kind}: {rec.error}")
        return rec

    async def prefill(self, n: int, k: int, repeats: int) -> float:
        """Fastest TTFT (s) of an n-token prompt after a cached k-token prefix (k a multiple of the block size)."""
        prefix = self.ids(k)
        if k:
            await self.request(prefix + self.ids(BLOCK), 1)
        return min([(await self.request(prefix + self.ids(n), 1)).ttft for _ in range(repeats)])

    async def decode_step(self, batch: int, context: int, tokens: int, repeats: int) -> float:
        """Decode step (s) with ``batch`` streams of ``context``-token prompts: the median gap of the
        streams' second halves, the fastest of ``repeats`` runs."""
        runs = []
        for _ in range(repeats):
            recs = await asyncio.gather(*(self.request(self.ids(context), tokens) for _ in range(batch)))
            runs.append(statistics.median(g for r in recs for g in r.itls[len(r.itls) // 2:]))
        return min(runs)


STATISTICS = {"fastest": min, "median": statistics.median}


def _check_statistic(statistic: str) -> None:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, not {statistic!r}")


async def in_rounds(points, repeats: int, measure, statistic: str = "fastest") -> dict:
    """{point: the ``statistic`` (a key of :data:`STATISTICS`) of its ``repeats`` measurements (seconds,
    ``await measure(point)``)}. The repeats are rounds over all points, so a burst of other work on the
    machine hits one round of a point, not all of its repeats."""
    got = {p: [] for p in points}
    for _ in range(max(1, repeats)):
        for p in got:
            got[p].append(await measure(p))
    return {p: STATISTICS[statistic](v) for p, v in got.items()}


async def measure_prefill(probe: Probe, points, repeats, statistic: str = "fastest") -> list[list[float]]:
    """[n, k, seconds] per (n, k) point, measured :func:`in_rounds`."""
    got = await in_rounds(list(points), repeats, lambda p: probe.prefill(p[0], p[1], 1), statistic)
    return [[n, k, s] for (n, k), s in got.items()]


async def measure_decode(probe: Probe, points, tokens, repeats, statistic: str = "fastest") -> list[list[float]]:
    """[batch, mean context, seconds] per (batch, prompt tokens) point, measured :func:`in_rounds`."""
    got = await in_rounds(list(points), repeats, lambda p: probe.decode_step(p[0], p[1], tokens, 1), statistic)
    # the mean KV length over the second half of the stream, where the gaps are taken
    return [[b, c + 0.75 * tokens, s] for (b, c), s in got.items()]


def _metric(text: str, name: str, **labels) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def measure_kv(session, pd_url: str, decode_url: str, model: str, sizes, seed: int, repeats: int = 1,
                     statistic: str = "fastest"):
    """[bytes, seconds] per prompt size, one request at a time through a P/D fleet's router: the decode
    worker's ``tandem:kv_transfer_bytes_total{direction="received"}`` and ``tandem:kv_transfer_seconds``
    deltas, the seconds measured :func:`in_rounds`. Raises RuntimeError when a request was not prefilled
    remotely."""
    probe = Probe(session, pd_url, model, seed + 1)
    nbytes: dict = {}

    async def one(n: int) -> float:
        async with session.get(decode_url.rstrip("/") + "/metrics") as r:
            before = await r.text()
        await probe.request(probe.ids(n), 1)
        async with session.get(decode_url.rstrip("/") + "/metrics") as r:
            after = await r.text()
        nbytes[n] = _metric(after, "tandem:kv_transfer_bytes_total", direction="received") - \
            _metric(before, "tandem:kv_transfer_bytes_total", direction="received")
        if nbytes[n] <= 0:
            raise RuntimeError(f"{pd_url}: the request was not prefilled remotely (no KV bytes received)")
        return _metric(after, "tandem:kv_transfer_seconds_sum") - _metric(before, "tandem:kv_transfer_seconds_sum")
    got = await in_rounds(list(sizes), repeats, one, statistic)
    return [[nbytes[n], got[n]] for n in sizes]


async def calibrate(base_url: str, model: str, prefill_sizes=(32, 64, 128, 256, 512, 1024), cached=(0, 256, 512),
                    cached_sizes=(32, 128, 256), batches=(1, 2, 4, 8), contexts=(64, 256), decode_tokens=24,
                    repeats=3, pd_url=None, pd_decode_url=None, seed=0, command: str = "",
                    statistic: str = "fastest") -> Calibration:
    """Measure ``base_url`` and fit the model; each point is the ``statistic`` (``fastest`` or
    ``median``) of its ``repeats``. Raises RuntimeError when a request fails, ValueError for an unknown
    statistic."""
    _check_statistic(statistic)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        probe = Probe(session, base_url, model, seed)
        await probe.request(probe.ids(64), 4)     # warm-up: first-request costs are not the model's
        health = {}
        try:
            async with session.get(base_url.rstrip("/").removesuffix("/v1") + "/health") as r:
                health = await r.json()
        except (aiohttp.ClientError, ValueError):
            pass
        pre = await measure_prefill(probe, [(n, 0) for n in prefill_sizes], repeats, statistic)
        pre += await measure_prefill(probe, [(n, k) for k in cached if k for n in cached_sizes], repeats, statistic)
        dec = await measure_decode(probe, [(b, c) for c in contexts for b in batches], decode_tokens, repeats,
                                   statistic)
        fits = {"prefill": fit("prefill", pre), "decode_step": fit("decode_step", dec)}
        if pd_url and pd_decode_url:
            # the prefill and decode fits stand on their own: a failed KV measurement must not lose them
            try:
                kv = await measure_kv(session, pd_url, pd_decode_url, model, prefill_sizes, seed, repeats,
                                      statistic)
                fits["kv_transfer"] = fit("kv_transfer", kv)
            except (RuntimeError, aiohttp.ClientError, ValueError) as e:
                print(f"warning: KV transfer not measured: {e}", file=sys.stderr)
    measured = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "host": platform.node(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
                "base_url": base_url, "command": command, "repeats": repeats, "statistic": statistic,
                "decode_tokens": decode_tokens}
    engine = {k: health[k] for k in ("role", "block_size", "max_model_len", "num_blocks") if k in health}
    return Calibration(model, fits, measured, engine)


async def verify(cal: Calibration, base_url: str, model: str, prefill_points, decode_points, decode_tokens=24,
                 repeats=3, seed=1, statistic: str = "fastest") -> list[dict]:
    """Measure fresh points, each :func:`in_rounds` as the calibration's own, and compare them with
    its predictions.

    ``prefill_points``: (n, k) pairs; ``decode_points``: (batch, context) pairs. Returns one row per
    point: what, inputs, measured and predicted seconds, relative error. Raises ValueError for an
    unknown statistic."""
    _check_statistic(statistic)
    rows = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        probe = Probe(session, base_url, model, seed)
        await probe.request(probe.ids(64), 4)
        for n, k, m in await measure_prefill(probe, prefill_points, repeats, statistic):
            p = cal.prefill_seconds(n + k, k)
            rows.append({"what": "prefill", "inputs": {"n": n, "k": k}, "measured": m, "predicted": p,
                         "rel_err": (p - m) / m})
        points = list(dict.fromkeys(decode_points))   # one row per distinct point, in measure_decode's order
        measured = await measure_decode(probe, points, decode_tokens, repeats, statistic)
        for (b, c), (_, ctx, m) in zip(points, measured):
            p = cal.decode_step_seconds(b, ctx)
            rows.append({"what": "decode_step", "inputs": {"batch": b, "context": c}, "measured": m,
                         "predicted": p, "rel_err": (p - m) / m})
    return rows


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(",", " ").split()]


def _calibrate(args) -> int:
    from rich.console import Console
    from rich.table import Table
    console = Console()
    try:
        if args.verify:
            cal = Calibration.load(args.verify)
            rows = asyncio.run(verify(cal, args.base_url, args.model,
                                      [(n, 0) for n in _ints(args.prefill_sizes)],
                                      [(b, c) for c in _ints(args.decode_contexts) for b in _ints(args.decode_batches)],
                                      args.decode_tokens, args.repeats, args.seed, args.statistic))
            t = Table(title=f"{args.verify} against {args.base_url}")
            for c in ("what", "inputs", "measured ms", "predicted ms", "error"):
                t.add_column(c)
            for r in rows:
                t.add_row(r["what"], str(r["inputs"]), f"{r['measured'] * 1000:.1f}", f"{r['predicted'] * 1000:.1f}",
                          f"{r['rel_err']:+.1%}")
            console.print(t)
            return 0
        cal = asyncio.run(calibrate(args.base_url, args.model, _ints(args.prefill_sizes), _ints(args.cached),
                                    _ints(args.cached_prompt_sizes), _ints(args.decode_batches),
                                    _ints(args.decode_contexts), args.decode_tokens, args.repeats, args.pd_url,
                                    args.pd_decode_url, args.seed, " ".join(["tandem", "bench", *sys.argv[2:]]),
                                    args.statistic))
    except (OSError, ValueError, RuntimeError, aiohttp.ClientError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cal.save(args.output)
    t = Table(title=f"calibration written to {args.output}")
    for c in ("model", "formula", "coefficients", "points", "R^2", "mean |rel err|", "max |rel err|"):
        t.add_column(c)
    for name, f in cal.fits.items():
        q = f.quality()
        t.add_row(name, f.formula.text, ", ".join(f"{k}={v:.3g}" for k, v in zip(f.formula.coefficients, f.coef)),
                  str(q["points"]), f"{q['r2']:.3f}", f"{q['mean_abs_rel_err']:.1%}", f"{q['max_abs_rel_err']:.1%}")
    console.print(t)
    # the autoscaler's capacity probe is bounded by a factor these fits do not give (docs/bench.md)
    console.print(f"next: PYTHONSAFEPATH=1 .venv/bin/python bench/capacity_by_size.py --role prefill --seed 3,4 "
                  f"--calibration {args.output} --write (the prefill capacity factor, in the simulator)")
    return 0


def add_calibrate_command(sub) -> None:
    c = sub.add_parser("calibrate", help="measure a worker and fit the performance model (YAML)")
    c.add_argument("--base-url", required=True, help="a `both` (or decode) worker, e.g. http://127.0.0.1:8001")
    c.add_argument("--model", required=True)
    c.add_argument("--output", "-o", default="calibration.yaml")
    c.add_argument("--prefill-sizes", default="32,64,128,256,512,1024", help="prompt tokens (no cache)")
    c.add_argument("--cached", default="256,512", help="cached-prefix tokens (multiples of the block size)")
    c.add_argument("--cached-prompt-sizes", default="32,128,256", help="new tokens after a cached prefix")
    c.add_argument("--decode-batches", default="1,2,4,8")
    c.add_argument("--decode-contexts", default="64,256", help="prompt tokens of each decoding stream")
    c.add_argument("--decode-tokens", type=int, default=24, help="tokens each decoding stream generates")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--statistic", choices=tuple(STATISTICS), default="fastest",
                   help="each point from its repeats: the fastest (the worker's own cost) or the median (the "
                        "machine's typical minute, for a simulation of a fleet running there)")
    c.add_argument("--pd-url", default=None, help="a P/D fleet's router, to measure KV transfer")
    c.add_argument("--pd-decode-url", default=None, help="that fleet's decode worker (its /metrics)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--verify", default=None, metavar="CALIBRATION",
                   help="instead: measure fresh points (the size options) and compare with this calibration")
    c.set_defaults(func=_calibrate)
