"""``tandem bench chaos``: a soak of a local fleet (``tandem up``) under load and injected faults.

An open-loop Poisson load at ``--load-fraction`` of the fleet's capacity (from a calibration,
:func:`capacity_rps`) runs for ``--duration`` seconds against a fleet whose roles autoscale (at least
two replicas each, so that a fault leaves a peer to retry on). Every ``--fault-every`` seconds one fault
from a seeded schedule (:func:`fault_schedule`: rounds, each a shuffle of the kinds) is injected:

- ``kill_decode`` / ``kill_prefill``: ``kill -9`` of a ready worker of that role (the fleet's
  supervisor restarts it on its port, :meth:`tandem.operator.local.LocalFleet.supervise`);
- ``kill_router``: ``kill -9`` of the router, restarted the same way (the client sends again what
  failed before any answer, as OpenAI's SDK retries connection errors, and resumes a begun stream with
  its last event id, ``Last-Event-ID``: docs/serving.md "Stream resumption");
- ``stop_worker``: ``SIGSTOP`` of a ready worker for ``--stop-seconds``, then ``SIGCONT`` (a hung peer);
- ``cut_kv``: every KV-transfer TCP connection of the prefill workers cut (``ss -K``, the kernel's
  socket destroy) for ``--cut-seconds``.

Each request goes through the load generator (:mod:`tandem.worker.bench.runner`); the router names the
workers that served it to a caller with the pool token. Every request is written as a JSON line with
its workers, the faults active while it ran, and its class (:func:`classify`): ``ok``;
``decode_killed_mid_stream`` (its stream had begun on a decode worker that was killed: unavoidable);
``router_killed_mid_stream`` (its stream had begun through the router when it was killed and could not
be resumed: avoidable since streams resume, so it counts with ``failed``); ``hung`` (its deadline passed without an answer or an error); ``failed`` (anything
else: each one is a bug). At the end every worker must be idle: no running or waiting sequence and no
KV block held (:func:`leaks`).

SLO recovery (:func:`slo_recovery`): a request meets the SLO when it is answered in full with a TTFT and
a TPOT within the autoscaler's targets (``--ttft``, ``--tpot``); after each fault, the seconds until the
requests that ended within one metric window (the autoscaler's, ``autoscale_window_s``) meet it in
95% of cases again, against the aim of one start-up time (the median restart of a killed worker in this run)
plus two metric windows.

The Kubernetes target (the test cluster, with the operator pod deleted, the API server stopped and a
worker pod deleted besides these faults) is bench/chaos_kube.py: it reuses :func:`plan` and :func:`soak`.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

FAULT_KINDS = ("kill_decode", "kill_prefill", "kill_router", "stop_worker", "cut_kv")
#: classes of a request that count as failed but cannot be avoided by the fleet
UNAVOIDABLE = ("decode_killed_mid_stream",)


def fault_schedule(seed: int, duration_s: float, every_s: float, kinds=FAULT_KINDS) -> list[tuple[float, str]]:
    """``(seconds from the start, kind)`` at every_s, 2 every_s, ... before ``duration_s``. The kinds come
    in rounds, each a seeded shuffle of ``kinds``, so that a short run still meets every kind once."""
    rng, out, pool = random.Random(seed), [], []
    t = every_s
    while t < duration_s:
        if not pool:
            pool = list(kinds)
            rng.shuffle(pool)
        out.append((round(t, 3), pool.pop()))
        t += every_s
    return out


def chaos_manifest(base: str | Path, min_replicas: int = 2, max_replicas: int = 3, ttft_s: float = 3.0,
                   tpot_s: float = 0.5, name: str = "chaos") -> Path:
    """``base`` (an InferencePool manifest) with both roles autoscaled from ``min_replicas`` to
    ``max_replicas`` (TTFT target for prefill, TPOT for decode; seconds, p90), in a temporary file."""
    doc = yaml.safe_load(Path(base).read_text())
    doc["metadata"]["name"] = name
    for role, metric, seconds in (("prefill", "ttft", ttft_s), ("decode", "tpot", tpot_s)):
        spec = doc["spec"][role]
        spec.pop("replicas", None)
        spec["autoscaling"] = {"enabled": True, "minReplicas": min_replicas, "maxReplicas": max_replicas,
                               "target": {"metric": metric, "percentile": 90, "seconds": seconds}}
    path = Path(tempfile.mkdtemp(prefix="tandem-chaos-")) / "pool.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def capacity_rps(calibration, prefill_replicas: int, decode_replicas: int, prompt_tokens: int,
                 output_tokens: int, tpot_s: float) -> float:
    """Requests per second the fleet serves at most (the lower of its two roles), from a calibration
    (:class:`tandem.worker.api.calibration.Calibration`): prefill, one prompt at a time per replica;
    decode, each replica running the batch whose step meets ``tpot_s`` (the autoscaler's model,
    :class:`tandem.operator.autoscaler.capacity.PerfModel`)."""
    from tandem.operator.autoscaler.capacity import PerfModel
    model = PerfModel.of(calibration)
    prefill = prefill_replicas / model.remote_prefill_seconds(prompt_tokens)
    context = prompt_tokens + output_tokens / 2
    slots, step = model.decode_slots(tpot_s, context)
    batch = max(1, int(slots))
    decode = decode_replicas * batch / (model.decode_step_seconds(batch, context) * output_tokens)
    return min(prefill, decode)


@dataclass
class Fault:
    """One injected fault. Times are Unix seconds; ``until`` is when its effect ended (the role's ready
    count back, the worker continued, the cutting stopped)."""
    id: int
    kind: str
    at: float
    until: float | None = None
    target: str | None = None        # the process's name
    url: str | None = None
    note: str = ""

    def active(self, start: float, end: float) -> bool:
        return self.at <= end and (self.until or time.time()) >= start


class Injector:
    """Injects faults into a :class:`tandem.operator.local.LocalFleet` (see the module docstring)."""

    def __init__(self, fleet, seed: int = 0, stop_s: float = 20.0, cut_s: float = 3.0, out=None):
        self.fleet, self.rng = fleet, random.Random(seed + 1)
        self.stop_s, self.cut_s = stop_s, cut_s
        self.out = out
        self.faults: list[Fault] = []
        self.names: dict[str, str] = {}      # url -> process name, for every process ever seen
        self._lock = threading.Lock()

    def note_names(self) -> None:
        for p in list(self.fleet.procs):
            self.names[p.url] = p.name

    def _log(self, msg: str) -> None:
        if self.out is not None:
            self.out.write(f"[chaos] {msg}\n")
            self.out.flush()

    def _ready(self, role: str) -> list:
        return [p for p in self.fleet.workers(role) if p.state == "ready" and p.popen.poll() is None]

    def inject(self, kind: str) -> Fault:
        """Inject one fault now (blocking: a router kill waits for its restart, a cut for its window;
        a stop returns at once and continues the worker later). Returns its record."""
        self.note_names()
        f = Fault(len(self.faults), kind, time.time())
        with self._lock:
            self.faults.append(f)
        if kind in ("kill_decode", "kill_prefill"):
            role = kind.split("_")[1]
            ready = self._ready(role)
            if len(ready) < 2:   # leave the role one worker to retry on
                f.note, f.until = f"skipped: {len(ready)} ready {role} worker(s)", f.at
            else:
                p = self.rng.choice(ready)
                f.target, f.url = p.name, p.url
                os.kill(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
                threading.Thread(target=self._until_ready, args=(f, role, len(ready)), daemon=True).start()
        elif kind == "kill_router":
            router = next(p for p in self.fleet.procs if p.role == "router")
            f.target, f.url = router.name, router.url
            killed = router.popen
            os.kill(killed.pid, signal.SIGKILL)
            killed.wait()
            # the fleet's supervisor (LocalFleet.supervise) starts it again on its port, as a kubelet
            # restarts a container
            t_end = time.monotonic() + 300
            while not (router.popen is not killed and router.state == "ready") and time.monotonic() < t_end:
                time.sleep(0.2)
            f.until = time.time()
        elif kind == "stop_worker":
            # a decode worker only while another is ready: a stream has nowhere else to go, and a pool
            # without a ready decode worker answers 503 (issue 24), which is not this fault's question
            decode = self._ready("decode")
            ready = self._ready("prefill") + (decode if len(decode) >= 2 else [])
            p = self.rng.choice(ready)
            f.target, f.url = p.name, p.url
            os.kill(p.popen.pid, signal.SIGSTOP)

            def cont():
                os.kill(p.popen.pid, signal.SIGCONT)
                f.until = time.time()
            threading.Timer(self.stop_s, cont).start()
        elif kind == "cut_kv":
            ports = [kv_port(p.url) for p in self._ready("prefill")]
            ports = [x for x in ports if x]
            f.target = "kv:" + ",".join(map(str, ports))
            f.note = f"{cut_connections(ports, self.cut_s)} socket(s) destroyed"
            f.until = time.time()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self._log(f"{kind} {f.target or ''} {f.note}")
        return f

    def _until_ready(self, f: Fault, role: str, before: int, timeout: float = 300.0) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end and len(self._ready(role)) < before:
            time.sleep(0.5)
        f.until = time.time()
        self.note_names()

    def settled(self) -> bool:
        return all(f.until is not None for f in self.faults)


def kv_port(url: str) -> int | None:
    """A prefill worker's KV transfer port (its ``/health``), or None when it does not answer."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return int(json.loads(r.read())["kv_port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cut_connections(ports: list[int], seconds: float) -> int:
    """Destroy every established TCP connection to or from ``ports`` (loopback KV transfers) for
    ``seconds``, with ``ss -K`` (the kernel's SOCK_DESTROY; root, CONFIG_INET_DIAG_DESTROY). Returns the
    number of sockets ``ss`` reports destroyed (one end of a loopback connection is enough to reset it)."""
    if not ports:
        return 0
    expr = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
    n, t_end = 0, time.monotonic() + seconds
    while time.monotonic() < t_end:
        r = subprocess.run(["ss", "-K", "-t", "-n", "-H", "state", "established", f"( {expr} )"],
                           capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            raise RuntimeError(f"ss -K failed (needs root and CONFIG_INET_DIAG_DESTROY): {r.stderr.strip()}")
        n += sum(1 for line in r.stdout.splitlines() if line.strip())
        time.sleep(0.02)
    return n


def classify(rec, faults: list[Fault]) -> str:
    """The class of one request (see the module docstring) from its record and the faults."""
    if rec.ok:
        return "ok"
    if rec.error_kind == "timeout":
        return "hung"
    begun = rec.first_token_mono is not None
    start = rec.send_unix
    end = rec.send_unix + (rec.e2e or 0.0)
    first = start + (rec.ttft or 0.0)
    decode = rec.served_by.get("X-Tandem-Decode-Worker")
    for f in faults:
        if not f.active(first, end + 1.0):
            continue
        if begun and f.kind == "kill_decode" and f.url == decode and rec.error_kind == "stream_error":
            return "decode_killed_mid_stream"
        if begun and f.kind == "kill_router" and rec.error_kind in ("incomplete", "client_error"):
            return "router_killed_mid_stream"
    return "failed"


def slo_met(row: dict, ttft_s: float, tpot_s: float) -> bool:
    """Whether one request (a ``requests.jsonl`` row) met the SLO: answered in full, TTFT <= ``ttft_s``
    and TPOT ((E2E - TTFT) / (tokens - 1)) <= ``tpot_s`` (seconds). A failed request misses it."""
    if row["class"] != "ok" or row.get("ttft") is None or row.get("e2e") is None:
        return False
    n = row.get("completion_tokens") or 0
    tpot = (row["e2e"] - row["ttft"]) / (n - 1) if n > 1 else 0.0
    return row["ttft"] <= ttft_s and tpot <= tpot_s


def slo_recovery(records: list[dict], faults: list[Fault], ttft_s: float, tpot_s: float, window_s: float,
                 aim_s: float, goal: float = 0.95, min_requests: int = 3) -> list[dict]:
    """Per fault, the seconds from its injection until SLO attainment is back to ``goal``: the first
    time ``t`` >= the fault (the fault's instant, then each later request's end) from which the requests
    that ended (answered in full or failed: sent + E2E) within the next ``window_s`` seconds, at least
    ``min_requests`` of them, meet the SLO (:func:`slo_met`) in at least ``goal`` of cases, as a
    monitor counting finished requests over a sliding window sees it: a stream the fault broke counts
    when it broke, after the fault. None when no such window closes before the last request ended.
    ``aim_s``: the aim to compare with (one start-up time plus two metric windows, issue 29).

    Returns ``[{"id", "kind", "target", "at_s" (from the first request's send), "recovery_s", "aim_s",
    "within_aim", "attainment_after" (the window starting at the fault)}]``; skipped faults are left
    out."""
    import bisect
    if not records:
        return []
    t0 = min(r["send_unix"] for r in records)
    rows = sorted(records, key=lambda r: r["send_unix"] + (r.get("e2e") or 0.0))
    sends = [r["send_unix"] + (r.get("e2e") or 0.0) for r in rows]   # when each request ended
    met = [0]
    for r in rows:
        met.append(met[-1] + slo_met(r, ttft_s, tpot_s))
    last = sends[-1]

    def attainment(t: float):
        i, j = bisect.bisect_left(sends, t), bisect.bisect_left(sends, t + window_s)
        return (met[j] - met[i]) / (j - i) if j - i >= min_requests else None

    out = []
    for f in faults:
        if f.note.startswith(("skipped", "failed")):
            continue
        first = attainment(f.at)
        recovery = None
        for t in [f.at] + sends[bisect.bisect_right(sends, f.at):]:
            if t + window_s > last:
                break
            a = attainment(t)
            if a is not None and a >= goal:
                recovery = t - f.at
                break
        out.append({"id": f.id, "kind": f.kind, "target": f.target, "at_s": round(f.at - t0, 1),
                    "recovery_s": None if recovery is None else round(recovery, 1), "aim_s": round(aim_s, 1),
                    "within_aim": recovery is not None and recovery <= aim_s,
                    "attainment_after": None if first is None else round(first, 3)})
    return out


def startup_seconds(faults: list[Fault], default: float) -> tuple[float, str]:
    """One worker's start-up time for the SLO-recovery aim: the median time a killed worker took to be
    back (``kill_decode`` / ``kill_prefill``: its role's ready count restored; of an even count, the
    upper middle one), or ``default`` when no such fault ended. Returns (seconds, where it came from)."""
    times = sorted(f.until - f.at for f in faults if f.kind in ("kill_decode", "kill_prefill")
                   and f.until is not None and f.target is not None)
    if not times:
        return default, "configured"
    return times[len(times) // 2], f"median of {len(times)} worker restart(s)"


def idle_row(name: str, url: str) -> dict:
    """One worker's idle state from its ``/health``: ``{"name", "num_requests", "in_flight",
    "kv_cache_usage", "leak"}`` (``leak``: a sequence, a request or a KV block still held; None when the
    worker does not answer)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            h = json.loads(r.read())
    except (OSError, ValueError):
        return {"name": name, "leak": None}
    row = {"name": name, "num_requests": h.get("num_requests"), "in_flight": h.get("in_flight"),
           "kv_cache_usage": h.get("kv_cache_usage")}
    row["leak"] = bool(row["num_requests"] or row["in_flight"] or row["kv_cache_usage"])
    return row


def leaks(fleet) -> list[dict]:
    """:func:`idle_row` of each live worker of a local fleet."""
    return [idle_row(p.name, p.url) for p in fleet.workers() if p.popen.poll() is None]


def wait_idle(rows, timeout: float = 90.0) -> list[dict]:
    """``rows()`` (:func:`idle_row` per worker) once no worker holds anything, or after ``timeout``
    seconds (what is left then)."""
    t_end = time.monotonic() + timeout
    while True:
        out = rows()
        if all(r["leak"] is False for r in out) or time.monotonic() > t_end:
            return out
        time.sleep(1.0)


@dataclass
class ChaosConfig:
    manifest: str
    calibration: str
    duration_s: float = 300.0
    fault_every_s: float = 30.0
    load_fraction: float = 0.3
    stop_s: float = 20.0
    cut_s: float = 3.0
    input_len: int = 128
    output_len: int = 32
    deadline_s: float = 120.0
    seed: int = 0
    kinds: tuple = FAULT_KINDS
    min_replicas: int = 2
    max_replicas: int = 3
    tpot_s: float = 0.5
    ttft_s: float = 3.0
    autoscale_window_s: float = 20.0
    autoscale_interval_s: float = 2.0
    output_dir: str | None = None
    #: the start-up time the autoscaler forecasts over, and the SLO-recovery aim's when no restart was timed
    startup_s: float = 30.0


def summarize(records: list[dict], faults: list[Fault], idle: list[dict], cfg: ChaosConfig, rate: float,
              capacity: float, elapsed: float) -> dict:
    by_class: dict[str, int] = {}
    for r in records:
        by_class[r["class"]] = by_class.get(r["class"], 0) + 1
    kinds: dict[str, int] = {}
    for f in faults:
        if not f.note.startswith(("skipped", "failed")):
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
    startup, startup_from = startup_seconds(faults, cfg.startup_s)
    aim = startup + 2 * cfg.autoscale_window_s
    recovery = slo_recovery(records, faults, cfg.ttft_s, cfg.tpot_s, cfg.autoscale_window_s, aim)
    first_fault = min((f.at for f in faults), default=None)
    before = [r for r in records if first_fault is None or r["send_unix"] < first_fault]
    attain = (lambda rows: round(sum(slo_met(r, cfg.ttft_s, cfg.tpot_s) for r in rows) / len(rows), 3)
              if rows else None)
    return {
        "duration_s": cfg.duration_s, "elapsed_s": round(elapsed, 1), "seed": cfg.seed,
        "capacity_rps": round(capacity, 3), "rate_rps": round(rate, 3), "load_fraction": cfg.load_fraction,
        "requests": len(records), "by_class": by_class,
        "failed_unavoidable": sum(by_class.get(c, 0) for c in UNAVOIDABLE),
        "failed_other": sum(n for c, n in by_class.items() if c not in ("ok", "hung", *UNAVOIDABLE)),
        "hung": by_class.get("hung", 0),
        "resent_by_client": sum(1 for r in records if r["resends"]),
        "resumed_by_client": sum(1 for r in records if r.get("resumes")),
        "resumed_ok": sum(1 for r in records if r.get("resumes") and r["class"] == "ok"),
        "faults": kinds, "faults_skipped": sum(1 for f in faults if f.note.startswith(("skipped", "failed"))),
        "leaked_workers": [r["name"] for r in idle if r["leak"] is not False],
        "idle": idle,
        "slo": {"ttft_s": cfg.ttft_s, "tpot_s": cfg.tpot_s, "window_s": cfg.autoscale_window_s, "goal": 0.95,
                "attainment": attain(records), "attainment_before_faults": attain(before),
                "startup_s": round(startup, 1), "startup_from": startup_from, "aim_s": round(aim, 1),
                "recovered_within_aim": sum(1 for x in recovery if x["within_aim"]),
                "recovered_late": sum(1 for x in recovery if x["recovery_s"] is not None and not x["within_aim"]),
                "not_recovered": sum(1 for x in recovery if x["recovery_s"] is None)},
        "slo_recovery": recovery,
    }


async def _faults(injector: Injector, schedule, t0: float, done: asyncio.Event) -> None:
    for at, kind in schedule:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            try:
                await asyncio.wait_for(done.wait(), delay)
                return   # the load ended first
            except asyncio.TimeoutError:
                pass
        try:
            await asyncio.to_thread(injector.inject, kind)
        except (OSError, RuntimeError, StopIteration) as e:   # the soak goes on; the fault says why
            injector.faults[-1].note = f"failed: {e!r}"
            injector.faults[-1].until = injector.faults[-1].until or time.time()


def plan(cfg: ChaosConfig, replicas: int | None = None):
    """The load and the faults of a soak: ``(calibration, capacity req/s, rate req/s, dataset, schedule)``.
    The capacity is the calibration's for ``replicas`` (default ``min_replicas``) of each role."""
    from tandem.worker.api.calibration import Calibration
    from tandem.worker.bench.datasets import random_dataset
    from tandem.worker.bench.tokens import DEFAULT_TOKENIZER, PromptMaker, load_tokenizer

    cal = Calibration.load(cfg.calibration)
    n_rep = replicas or cfg.min_replicas
    capacity = capacity_rps(cal, n_rep, n_rep, cfg.input_len, cfg.output_len, cfg.tpot_s)
    rate = cfg.load_fraction * capacity
    n = max(1, round(rate * cfg.duration_s))
    dataset = random_dataset(PromptMaker(load_tokenizer(DEFAULT_TOKENIZER)), n, cfg.input_len, cfg.output_len,
                             "fixed", 0.0, cfg.seed)
    return cal, capacity, rate, dataset, fault_schedule(cfg.seed, cfg.duration_s, cfg.fault_every_s, cfg.kinds)


def soak(cfg: ChaosConfig, target, injector, dataset, schedule, rate: float, capacity: float, idle, log) -> dict:
    """Run the load against ``target`` (:class:`tandem.worker.bench.client.Target`) while ``injector``
    (``inject(kind)``, ``settled()``, ``note_names()``, ``names``, ``faults``) injects ``schedule``; wait
    for the faults' effects to end, then for ``idle()`` (:func:`leaks`' rows once the workers are idle,
    or what is left); write ``requests.jsonl`` and ``summary.json`` under ``cfg.output_dir``. Returns
    the summary with ``records``. Both targets (the local fleet, bench/chaos_kube.py's cluster) use it."""
    from tandem.worker.bench.runner import LoadShape, run

    log.write(f"[chaos] capacity {capacity:.2f} req/s, load {rate:.2f} req/s, {len(dataset.requests)} requests, "
              f"{len(schedule)} faults\n")

    async def main():
        done = asyncio.Event()
        t0 = time.monotonic()
        task = asyncio.create_task(_faults(injector, schedule, t0, done))
        try:
            result = await run(target, dataset, LoadShape("poisson", rate, seed=cfg.seed))
        finally:
            done.set()
        await task
        return result
    t_start = time.monotonic()
    result = asyncio.run(main())
    # faults whose effect outlasts the load (a stop, a replacement starting) end before the check
    t_end = time.monotonic() + cfg.stop_s + 120
    while not injector.settled() and time.monotonic() < t_end:
        time.sleep(0.5)
    rows = idle()
    elapsed = time.monotonic() - t_start
    injector.note_names()
    records = []
    for rec in result.records:
        row = {"id": rec.id, "send_unix": round(rec.send_unix, 3), "ttft": rec.ttft, "e2e": rec.e2e,
               "completion_tokens": rec.completion_tokens, "status": rec.status, "error_kind": rec.error_kind,
               "error": rec.error, "resends": rec.resends, "resumes": rec.resumes,
               "decode": injector.names.get(rec.served_by.get("X-Tandem-Decode-Worker", ""),
                                            rec.served_by.get("X-Tandem-Decode-Worker")),
               "prefill": injector.names.get(rec.served_by.get("X-Tandem-Prefill-Worker", ""),
                                             rec.served_by.get("X-Tandem-Prefill-Worker")),
               "faults": [f"{f.id}:{f.kind}" for f in injector.faults
                          if f.active(rec.send_unix, rec.send_unix + (rec.e2e or 0.0))],
               "class": classify(rec, injector.faults)}
        records.append(row)
    summary = summarize(records, injector.faults, rows, cfg, rate, capacity, elapsed)
    summary["fault_log"] = [asdict(f) for f in injector.faults]
    if cfg.output_dir:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "requests.jsonl", "w") as fh:
            for row in records:
                fh.write(json.dumps(row) + "\n")
        from tandem.worker.bench.report import write_summary
        write_summary(summary, out / "summary.json")
    summary["records"] = records
    return summary


def run_chaos(cfg: ChaosConfig, log=None) -> dict:
    """Start the fleet, run the load and the faults, check for leaks, stop the fleet. Returns the
    summary (``records``: one dict per request, as written to ``requests.jsonl``)."""
    from tandem.operator.autoscaler.fleet_loop import FleetAutoscaler
    from tandem.operator.local import LocalFleet
    from tandem.worker.bench.client import Target

    log = log or sys.stderr
    cal, capacity, rate, dataset, schedule = plan(cfg)
    manifest = chaos_manifest(cfg.manifest, cfg.min_replicas, cfg.max_replicas, cfg.ttft_s, cfg.tpot_s)
    fleet = LocalFleet(str(manifest), router_port=0, log_stream=log)
    loop = None
    try:
        fleet.start(timeout=300)
        loop = FleetAutoscaler(fleet, window_s=cfg.autoscale_window_s, interval_s=cfg.autoscale_interval_s,
                               startup_s=cfg.startup_s, calibration=cal)
        loop.start()
        injector = Injector(fleet, cfg.seed, cfg.stop_s, cfg.cut_s, out=log)
        target = Target(fleet.endpoint, fleet.pool.spec.model.name, "completions", timeout=cfg.deadline_s,
                        headers=lambda: fleet.worker_headers, resend_s=cfg.deadline_s,
                        api_key=fleet.api_keys[0] if fleet.api_keys else None)
        return soak(cfg, target, injector, dataset, schedule, rate, capacity,
                    lambda: wait_idle(lambda: leaks(fleet)), log)
    finally:
        if loop is not None:
            loop.stop()
        fleet.stop(grace=10)


def table(summary: dict) -> str:
    """The summary as a Markdown table (bench/RESULTS.md)."""
    rows = [("duration (s)", summary["duration_s"]), ("load", f"{summary['rate_rps']} req/s "
             f"({summary['load_fraction']:.0%} of {summary['capacity_rps']} req/s)"),
            ("requests", summary["requests"]),
            ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(summary["faults"].items()))),
            ("faults skipped", summary["faults_skipped"])]
    rows += [(f"requests: {k}", v) for k, v in sorted(summary["by_class"].items())]
    rows += [("failed, avoidable (aim 0)", summary["failed_other"]), ("hung (aim 0)", summary["hung"]),
             ("sent again by the client", summary["resent_by_client"]),
             ("streams resumed after a broken connection (Last-Event-ID): completed / all",
              f"{summary.get('resumed_ok', 0)} / {summary.get('resumed_by_client', 0)}"),
             ("workers holding sequences or blocks at the end (aim none)", ", ".join(summary["leaked_workers"])
              or "none")]
    slo = summary.get("slo")
    if slo:
        pct = (lambda x: "n/a" if x is None else f"{x:.0%}")
        rows += [("SLO (p90 targets, per request)", f"TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s']} s"),
                 ("SLO attainment: whole run / before the first fault",
                  f"{pct(slo['attainment'])} / {pct(slo['attainment_before_faults'])}"),
                 ("SLO recovery aim (start-up + 2 metric windows)",
                  f"{slo['aim_s']} s ({slo['startup_s']} s, {slo['startup_from']}; windows of {slo['window_s']} s)"),
                 (f"faults after which attainment was back to >= {slo['goal']:.0%}: within the aim / later / "
                  "not before the load ended",
                  f"{slo['recovered_within_aim']} / {slo['recovered_late']} / {slo['not_recovered']}")]
    out = "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    per = summary.get("slo_recovery")
    if per:
        out += "\n\n" + "\n".join(
            ["| fault | kind | target | at (s) | attainment, first window after | recovery to >= 95% (s) | aim (s) |",
             "|---|---|---|---|---|---|---|"] +
            [f"| {x['id']} | {x['kind']} | {x['target'] or ''} | {x['at_s']} | "
             f"{'n/a' if x['attainment_after'] is None else format(x['attainment_after'], '.0%')} | "
             f"{'not recovered' if x['recovery_s'] is None else x['recovery_s']} | {x['aim_s']} |" for x in per])
    return out


def config_from_args(args, kinds_allowed=FAULT_KINDS, **extra) -> ChaosConfig | None:
    """The :class:`ChaosConfig` of parsed arguments (:func:`add_chaos_args`); None, with the error
    printed, when ``--faults`` names a kind outside ``kinds_allowed``."""
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    bad = [k for k in kinds if k not in kinds_allowed]
    if bad or not kinds:
        print(f"error: --faults: unknown kind(s) {bad}; choose from {', '.join(kinds_allowed)}", file=sys.stderr)
        return None
    return ChaosConfig(args.manifest, args.calibration, args.duration, args.fault_every, args.load_fraction,
                       args.stop_seconds, args.cut_seconds, args.input_len, args.output_len, args.deadline, args.seed,
                       kinds, args.min_replicas, args.max_replicas, tpot_s=args.tpot, ttft_s=args.ttft,
                       output_dir=args.output_dir, **extra)


def report(s: dict, as_json: bool) -> int:
    """Print the summary's tables (and its JSON); the exit code: 1 on an avoidable failure, a hung
    request or a leak."""
    s = {k: v for k, v in s.items() if k != "records"}
    print(table(s))
    if as_json:
        print(json.dumps(s, indent=1))
    return 0 if s["failed_other"] == 0 and s["hung"] == 0 and not s["leaked_workers"] else 1


def _chaos(args) -> int:
    cfg = config_from_args(args)
    return 2 if cfg is None else report(run_chaos(cfg), args.json)


def add_chaos_command(sub) -> None:
    """Register ``tandem bench chaos``."""
    c = sub.add_parser("chaos", help="a soak of a local fleet under load and injected faults (kill -9, "
                       "SIGSTOP, KV connections cut); exit 1 on an avoidable failure, a hung request or a leak")
    add_chaos_args(c)
    c.set_defaults(func=_chaos)


def add_chaos_args(c, kinds=FAULT_KINDS) -> None:
    """The soak's arguments (``tandem bench chaos``, bench/chaos_kube.py)."""
    c.add_argument("manifest", help="an InferencePool manifest (both roles are autoscaled from --min-replicas)")
    c.add_argument("--calibration", default="bench/calibrations/smollm2-cpu.yaml",
                   help="sizes the load: --load-fraction of the capacity it predicts")
    c.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    c.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    c.add_argument("--faults", default=",".join(kinds), help="the kinds to draw from")
    c.add_argument("--load-fraction", type=float, default=0.3)
    c.add_argument("--stop-seconds", type=float, default=20.0, help="how long stop_worker keeps a worker stopped")
    c.add_argument("--cut-seconds", type=float, default=3.0, help="how long cut_kv cuts KV connections")
    c.add_argument("--input-len", type=int, default=128)
    c.add_argument("--output-len", type=int, default=32)
    c.add_argument("--deadline", type=float, default=120.0, help="seconds a request may take (then: hung)")
    c.add_argument("--min-replicas", type=int, default=2)
    c.add_argument("--max-replicas", type=int, default=3)
    c.add_argument("--ttft", type=float, default=3.0,
                   help="prefill's p90 TTFT target (s): the autoscaler's, and the SLO recovery is measured against")
    c.add_argument("--tpot", type=float, default=0.5, help="decode's p90 TPOT target (s), likewise")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--output-dir", default=None, help="requests.jsonl and summary.json")
    c.add_argument("--json", action="store_true", help="also print the JSON summary")
