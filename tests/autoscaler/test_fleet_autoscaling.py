"""The autoscaler in charge of a real local fleet (``tandem up``'s processes, SmolLM2 on CPU), load from
``tandem bench serve``.

On 2 cores more replicas do not lower latency: these tests check the control loop (scale up under a
TPOT breach, drain then stop on the way down, wake from zero), not a speed-up."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from fleet_utils import MODEL, ROOT, TPOT_TARGET_FACTOR, chat, metric, single_tpot, start_fleet, wait_for
from prometheus_utils import Prometheus
from tandem.operator.autoscaler.actuate import load_of
from tandem.operator.autoscaler.capacity import PerfModel
from tandem.operator.autoscaler.fleet_loop import FleetAutoscaler
from tandem.operator.autoscaler.policy import Autoscaler
from tandem.operator.autoscaler.prometheus_source import PrometheusSource
from tandem.operator.local import LocalFleet
from tandem.worker.api.calibration import Calibration

CPU = {"requests": {"cpu": "1", "memory": "1Gi"}}
#: SmolLM2 on this kind of CPU, measured by `tandem bench calibrate` (the spec's calibrationRef)
CALIBRATION = ROOT / "bench" / "calibrations" / "smollm2-cpu.yaml"
#: the autoscaler's metric window in these tests (seconds; `tandem up` and FleetAutoscaler default to 30):
#: short, so that the heavy run's load, and the capacity factor it taught (which fades with a half-life
#: of one window), leave the policy within a few windows of the trickle, and the trickle's streams (which
#: must outlast the drain) can be short
WINDOW_S = 10.0
#: decode's decision inputs printed for each decision before the drain (Autoscaler's ``inputs``)
DRAIN_INPUTS = ("capacity_factor", "need", "demand", "level", "forecast", "rise", "hold_s_per_token",
                "context_tokens", "slots_per_replica", "fixed_population")


def _fleet(overrides: dict, name: str) -> LocalFleet:
    # the pool secret on, as `tandem up` has it: the autoscaler's drains must carry the pool token
    return start_fleet(overrides, name, pool_secret=True)


def _bench(url: str, out: Path, *args: str) -> subprocess.Popen:
    tandem = Path(sys.executable).with_name("tandem")
    return subprocess.Popen([str(tandem), "bench", "serve", "--base-url", url, "--model", MODEL,
                             "--dataset", "random", "--input-len", "16", "--no-progress", "--no-plots",
                             "--timeout", "600", "--output-dir", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _summary(proc: subprocess.Popen, out: Path) -> dict:
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log[-3000:]
    return json.loads((out / "summary.json").read_text())


class Shadow:
    """The same policy fed by a real Prometheus scraping the fleet (file service discovery rewritten
    from the fleet's processes every second): what it would decide, tick by tick, beside the pods
    source that acts."""

    def __init__(self, fleet, loop: FleetAutoscaler, prom: Prometheus, window_s: float):
        self.fleet, self.loop, self.prom = fleet, loop, prom
        self.source = PrometheusSource(prom.url, fleet.pool.metadata.name, window_s, {"decode": 90, "prefill": 90})
        self.policy = Autoscaler(fleet.pool.spec, Calibration.load(CALIBRATION), startup_s=20)
        self.decisions: list = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(1.0):
            self.prom.targets([p.url for p in list(self.fleet.procs)])
            snap = self.source.observe(self.loop.targets())
            self.decisions.append((snap, self.policy.decide(snap)))

    def stop(self):
        self._stop.set()
        self._t.join(10)


@pytest.mark.timeout(600)
def test_decode_scales_up_under_load_then_drains_a_busy_worker(tmp_path):
    """The control loop on real processes: decode scales up under a TPOT breach, then, under a trickle,
    drains a worker that still streams, lets its stream end at full length and stops it: zero failed
    requests. Timing: the autoscaler's windows are test-sized (``WINDOW_S``, the pool's 10 s
    scale-down window); the TPOT target and the trickle's length come from the single-request TPOT
    measured in the run, the streams two to three times as long as the drain takes to come.

    float32, the calibration's dtype (the story's pool pins it too), not ``auto``: ``auto`` is bfloat16
    on a CPU with AVX-512-BF16, whose TPOT and its rise with the batch are not the calibration's;
    pinned, the run is the same on every CPU kind (bench/RESULTS.md, issue 27, helper h27c)."""
    fleet = _fleet({"spec.model.dtype": "float32", "spec.prefill": {"replicas": 1, "resources": CPU},
                    "spec.decode": {"resources": CPU, "autoscaling": {
                        "enabled": True, "minReplicas": 1, "maxReplicas": 2,
                        "target": {"metric": "tpot", "percentile": 90, "seconds": 1.0},   # set below, in-run
                        "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 1, "periodSeconds": 5},
                                     "scaleDown": {"stabilizationWindowSeconds": 10, "maxStep": 1,
                                                   "periodSeconds": 10}}}}}, "asfleet")
    loop = shadow = None
    prom = Prometheus(tmp_path / "prometheus")
    try:
        single_tpot(fleet.endpoint, 8)                        # warm-up
        # the single request's TPOT, the median of three: this machine is shared, and a target set on a
        # lucky measurement would read a trickle as a breach, one set on a measurement slowed by a
        # neighbour's burst would hide the heavy run's breach (beside a chaos soak the three ranged
        # from 83 to 201 ms in one run); three that disagree by over 1.3x are measured again (a
        # clean-clone run got [107, 205, 206]: a target of 2.5x 205 ms hid the breach). Three that agree
        # but read over twice the calibration's batch-1 step are a neighbour's too (run 48: [156, 168,
        # 188] ms, 49-52 ms alone; the heavy run's p90 stays near 0.38 s either way, short of 1.1x a
        # 420 ms target). Either is measured again after a pause, up to six rounds in all
        cal = Calibration.load(CALIBRATION)
        quiet = 2 * PerfModel.of(cal).decode_step_seconds(1, 16)
        for _ in range(6):
            singles = sorted(single_tpot(fleet.endpoint) for _ in range(3))
            if singles[-1] <= 1.3 * singles[0] and singles[1] <= quiet:
                break
            time.sleep(5)
        single = singles[1]
        target = TPOT_TARGET_FACTOR * single
        fleet.pool.spec.decode.autoscaling.target.seconds = target
        print(f"single-request TPOT {single * 1e3:.1f} ms (of {[round(x * 1e3, 1) for x in singles]}); "
              f"target {target * 1e3:.1f} ms", flush=True)
        loop = FleetAutoscaler(fleet, window_s=WINDOW_S, interval_s=2, startup_s=20,
                               calibration=cal)
        loop.start()
        shadow = Shadow(fleet, loop, prom, window_s=WINDOW_S)

        # a load that pushes TPOT over the target: the decode pool grows to 2
        heavy = _bench(fleet.endpoint, tmp_path / "heavy", "--num-prompts", "4000", "--concurrency", "32",
                       "--output-len", "48", "--fail-on-error")
        def ups() -> list:
            return [d for d in list(loop.decisions) if d["decode"]["desired"] > d["decode"]["current"] and d["acted"]]
        assert wait_for(lambda: ups() and len(fleet.workers("decode")) == 2, timeout=200, interval=0.5), \
            list(loop.decisions)[-5:]
        # held from the scale-up on (advisory mode, as a user holds a pool with `mode: advisory`; the
        # replica it started still comes up): once the second worker cuts TPOT, the heavy run's demand
        # alone may size decode at 1, and the pool would drain before the trickle (17.8 s before it with
        # the hold set after the heavy run's end; during the TPOT checks, and as the second worker came
        # up, with the hold set later: three clean-clone runs). Advisory decisions are still made and
        # recorded, which is all the checks below read
        fleet.pool.spec.autoscaling.mode = "advisory"
        grew = wait_for(lambda: len([p for p in fleet.workers("decode") if p.state == "ready"]) == 2, timeout=200,
                        interval=1)
        assert grew, f"decode never reached 2 ready workers; decisions: {list(loop.decisions)[-5:]}"
        assert not loop.drains, loop.drains
        # the load pushed TPOT over the target (the calibrated policy may act on the demand first), in the
        # acting loop's windows and in Prometheus's. Waited for while the heavy run goes on: a heavy
        # request takes 48 steps of a batch of up to 32, so when the demand alone has already added the
        # replica (a tick after the load began), few of them have ended in a window; the reading at
        # that moment was 0.6-0.84x the target beside other work, 1.5-3.4x on a quieter machine
        def peaks() -> tuple[float, float]:
            return (max(d["decode"]["observed"] or 0 for d in list(loop.decisions)),
                    max(sn.decode.latency or 0 for sn, _ in list(shadow.decisions)))
        wait_for(lambda: min(peaks()) > target * 1.1, timeout=90, interval=1)
        peak = max(d["decode"]["observed"] or 0 for d in loop.decisions)
        print(f"heavy load: p90 TPOT up to {peak * 1e3:.1f} ms ({peak / target:.2f}x the target)", flush=True)
        assert peak > target * 1.1, list(loop.decisions)
        # the same scale-up, seen through Prometheus
        # (its wish, not a step: the acting loop may have started the replica before Prometheus's first
        # scrape showed the load, and then the shadow's current count already includes it)
        seen = [(sn, d) for sn, d in shadow.decisions if d.decode.recommended > 1 and sn.decode.signal == "ok"]
        assert seen, [(sn.decode, d.decode.reason) for sn, d in shadow.decisions[-5:]]
        assert seen[0][0].decode.signal == "ok"
        assert max(sn.decode.latency or 0 for sn, _ in shadow.decisions) > target * 1.1
        # prefill's demand through Prometheus: the router's arrivals and their whole prompts, counted on
        # arrival: the heavy run's 16 tokens a prompt, in the chat template's wrapping (46 tokens in all
        # in a trial run). A missing series would read 0 tokens
        fed = [sn.prefill for sn, _ in shadow.decisions if sn.prefill.signal == "ok" and sn.prefill.arrivals_per_s > 0]
        assert fed, [sn.prefill for sn, _ in shadow.decisions[-3:]]
        assert 16 <= fed[-1].prompt_tokens_per_s / fed[-1].arrivals_per_s <= 80, fed[-1]

        # the load drops to a trickle of long requests (two streams of about 35 s alone, from the single-request
        # TPOT), after the heavy run (still sending: 4000 prompts is more than it reaches) stops. Two
        # streams fit one replica at the target (the calibration's batch-2 step is well under the
        # target's multiple of its batch-1 step), so the pool drains a worker that still streams one of
        # them, lets it finish at full length and stops it: zero failed requests.
        assert not loop.drains, loop.drains
        heavy.terminate()   # the rest of the heavy run is not needed (a terminated client is not a failure)
        heavy.wait(60)
        # the pool holds (advisory mode, as a user holds a pool with `mode: advisory`, set above) until the
        # trickle streams on both decode workers: a pool that looks idle for a window
        # drains a replica with nothing in flight, and unheld it did so before the trickle began in 3 of
        # 7 clean-clone runs (bench/RESULTS.md, fifteenth session). The workers' own /health counts are
        # waited on, down to 0 (a departed heavy stream may be kept up to its 30 s resume grace) and then
        # up to a trickle stream each (1 or more: a resumable stream counts as its request, its producer
        # and its buffer, 3 at drain time in a trial; the router's /health table is not a placement
        # count: it read [0, 0] with streams running)
        decode_urls = [p.url for p in fleet.workers("decode")]
        assert len(decode_urls) == 2, decode_urls

        def in_flight() -> list[float]:
            return [load_of(u) for u in decode_urls]
        assert wait_for(lambda: in_flight() == [0, 0], timeout=90, interval=0.5), in_flight()
        # about 35 s each alone (longer two at a time): the capacity factor the heavy run taught (on 2
        # cores a second replica adds little) fades back over a few 10 s windows, and the 10 s
        # scale-down window passes, before the policy sees one replica suffice. The drain came 17 s
        # into the trickle (35 s with 20 s windows, when the streams were 120 s alone and, beside other
        # work, outlasted the 240 s wait below: bench/RESULTS.md, issue 27, helper h27c)
        tokens = int(min(1500, max(250, 35.0 / single)))
        t_trickle = time.time()
        trickle = _bench(fleet.endpoint, tmp_path / "trickle", "--num-prompts", "2", "--concurrency", "2",
                         "--output-len", str(tokens), "--fail-on-error")
        assert wait_for(lambda: min(in_flight()) >= 1, timeout=60, interval=0.2), in_flight()
        fleet.pool.spec.autoscaling.mode = "active"
        shrank = wait_for(lambda: loop.drains and loop.drains[0].get("stopped_at"), timeout=240, interval=1)
        assert shrank, f"no drain; decisions: {list(loop.decisions)[-5:]}"
        s = _summary(trickle, tmp_path / "trickle")
        assert s["failed"] == 0 and s["completed"] == 2, s      # zero failed requests, the drained one's too
        recs = [json.loads(ln) for ln in (tmp_path / "trickle" / "requests.jsonl").read_text().splitlines()]
        assert all(r["completion_tokens"] == tokens for r in recs), [r["completion_tokens"] for r in recs]
        d = loop.drains[0]
        assert d["role"] == "decode" and d["at_drain"]["draining"] is True
        print(f"drained {d['name']} with {d['at_drain']['in_flight']} in flight at drain time, "
              f"{d['at'] - t_trickle:.0f} s into the trickle", flush=True)
        # the decisions that led to the drain, printed whole (pytest cuts an assertion's message short):
        # a drain after the trickle ended (run 68: 90 s in, the recommendation 2 until then) is read here
        for x in list(loop.decisions)[-30:]:
            print(f"{x['time']} decode {x['decode']['current']} -> {x['decode']['desired']}: "
                  f"{x['decode']['reason']} {dict((k, x['decode']['inputs'].get(k)) for k in DRAIN_INPUTS)}",
                  flush=True)
        assert d["at_drain"]["in_flight"] >= 1, (d["at"] - t_trickle, d)   # its GET /drain then
        assert d["drained"] is True                  # what it had in flight finished before it was stopped
        assert [p.name for p in fleet.workers("decode")] != [] and \
            d["name"] not in [p.name for p in fleet.workers("decode")]
    finally:
        if shadow is not None:
            shadow.stop()
        if loop is not None:
            loop.stop()
        prom.stop()
        fleet.stop(grace=10)


@pytest.mark.timeout(300)
def test_scale_to_zero_pool_wakes_on_the_first_request():
    zero = {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 20, "periodSeconds": 10}}}
    fleet = _fleet({"spec.autoscaling": {"scaleToZero": True},
                    "spec.prefill": {"resources": CPU, "autoscaling": {
                        **zero, "target": {"metric": "ttft", "seconds": 2.0}}},
                    "spec.decode": {"resources": CPU, "autoscaling": {
                        **zero, "target": {"metric": "tpot", "seconds": 0.5}}}}, "aszero")
    loop = FleetAutoscaler(fleet, window_s=10, interval_s=1, startup_s=20)
    try:
        assert fleet.workers() == []                                  # only the router runs ...
        assert requests.get(fleet.endpoint + "/ready", timeout=5).status_code == 200   # ... and it is ready
        loop.start()
        answer: dict = {}
        t = threading.Thread(target=lambda: answer.setdefault("r", chat(fleet.endpoint, "Say hi.", max_tokens=8)))
        t.start()
        assert wait_for(lambda: metric(fleet.endpoint, "tandem:router_queued_requests") == 1, timeout=30)
        t.join(timeout=240)
        text, body = answer["r"]
        assert body["usage"]["completion_tokens"] > 0
        wake = [d for d in loop.decisions if d["routerQueued"] > 0 and d["decode"]["desired"] > 0]
        assert wake and wake[0]["prefill"]["desired"] >= 1, list(loop.decisions)[:5]   # both roles together
        assert {p.role for p in fleet.workers()} == {"prefill", "decode"}
    finally:
        loop.stop()
        fleet.stop(grace=10)


def _one_to_two_decode(name: str):
    """A fleet of 1 prefill and 1-2 decode replicas (quick to scale up, slow to scale down) and its
    autoscaler (not started), for the dead-replica tests."""
    fleet = _fleet({"spec.prefill": {"replicas": 1, "resources": CPU},
                    "spec.decode": {"resources": CPU, "autoscaling": {
                        "enabled": True, "minReplicas": 1, "maxReplicas": 2,
                        "target": {"metric": "tpot", "percentile": 90, "seconds": 1.0},
                        "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 1, "periodSeconds": 1},
                                     "scaleDown": {"stabilizationWindowSeconds": 600}}}}}, name)
    return fleet, FleetAutoscaler(fleet, window_s=4, interval_s=1, startup_s=10)


@pytest.mark.timeout(300)
def test_a_hung_decode_worker_is_not_capacity_and_is_replaced(tmp_path):
    """A SIGSTOPped decode worker has not exited, so the fleet still calls it ready; the autoscaler must
    not count it as capacity (its scrapes fail): it sizes the role without it and starts a replacement.
    Once it answers again it counts again (the pool is then one over, held by the scale-down window).
    A kill -9'd worker is replaced too (the fleet restarts it) and is not counted while it is down.
    The Prometheus source, beside it on a real Prometheus, counts the hung worker out too (its target's
    ``up`` is 0) and back in once it answers.
    Real processes; no load (the idle signal sizes to minReplicas, so the counts alone decide)."""
    fleet, loop = _one_to_two_decode("ashung")
    hung = fleet.workers("decode")[0]
    prom = Prometheus(tmp_path / "prom")
    shadow = None
    try:
        loop.start()
        shadow = Shadow(fleet, loop, prom, 4)

        def prom_decode(after: int) -> list:
            return [snap.decode for snap, _ in shadow.decisions[after:]]
        assert wait_for(lambda: any(d["decode"]["signal"] == "idle" for d in loop.decisions), timeout=60), \
            list(loop.decisions)
        assert [p.name for p in fleet.workers("decode")] == [hung.name]
        assert wait_for(lambda: any(d.ready == 1 for d in prom_decode(0)), timeout=60), prom_decode(0)[-3:]
        os.kill(hung.popen.pid, signal.SIGSTOP)
        stopped_at = len(shadow.decisions)
        new = wait_for(lambda: [p for p in fleet.workers("decode") if p is not hung], timeout=60, interval=0.5)
        assert new, list(loop.decisions)[-5:]            # failed before the fix: the hung one counted as ready
        seen = [d["decode"] for d in loop.decisions if d["decode"].get("unresponsive")]
        assert seen and seen[0]["ready"] == 0 and seen[0]["current"] == 0 and seen[0]["desired"] == 1, seen
        replacement = new[0]
        assert wait_for(lambda: replacement.state == "ready", timeout=150, interval=0.5)
        assert chat(fleet.endpoint, "Say hi.", max_tokens=4)[1]["usage"]["completion_tokens"] > 0
        # it answers again: capacity again, and nothing more is started
        assert any(d.unresponsive == 1 for d in prom_decode(stopped_at)), prom_decode(stopped_at)[-3:]
        os.kill(hung.popen.pid, signal.SIGCONT)
        n, m = len(loop.decisions), len(shadow.decisions)
        assert wait_for(lambda: any(d["decode"]["ready"] == 2 and not d["decode"]["unresponsive"]
                                    for d in list(loop.decisions)[n:]), timeout=30), list(loop.decisions)[-3:]
        assert wait_for(lambda: any(d.ready == 2 and d.unresponsive == 0 for d in prom_decode(m)), timeout=30), \
            prom_decode(m)[-3:]
        assert len(fleet.workers("decode")) == 2
        # dead: kill -9 the replacement; the fleet restarts it, and no decision counts it until it is back
        os.kill(replacement.popen.pid, signal.SIGKILL)
        n = len(loop.decisions)
        assert wait_for(lambda: replacement.state == "restarting", timeout=10, interval=0.1)
        assert wait_for(lambda: replacement.state == "ready", timeout=150, interval=0.5)
        down = [d["decode"] for d in list(loop.decisions)[n:]]
        assert any(d["ready"] == 1 for d in down), down          # the other one alone, while it was down
        assert len(fleet.workers("decode")) == 2                 # replaced in place, nothing extra started
    finally:
        with contextlib.suppress(ProcessLookupError):   # gone already: nothing to resume
            os.kill(hung.popen.pid, signal.SIGCONT)
        if shadow is not None:
            shadow.stop()
        prom.stop()
        loop.stop()
        fleet.stop(grace=10)


@pytest.mark.timeout(300)
def test_a_crashed_worker_does_not_freeze_the_autoscaler():
    """kill -9 of the only decode worker: while the fleet restarts it (after its backoff, then its
    start-up: a crash loop backs off up to 30 s) the autoscaler keeps deciding. The dead worker is not
    capacity (``unresponsive``), so the role is short of its minimum and a replacement is started at
    once, as for a hung worker. Failed before the fix: every worker not ready, a crashed one included,
    made the snapshot ``rolling_out``, and the policy held every decision of both roles (``limitedBy:
    rollout``) until the crashed worker was back; then nothing was started."""
    fleet, loop = _one_to_two_decode("ascrash")
    victim = fleet.workers("decode")[0]
    try:
        loop.start()
        assert wait_for(lambda: any(d["decode"]["signal"] == "idle" for d in loop.decisions), timeout=60), \
            list(loop.decisions)
        os.kill(victim.popen.pid, signal.SIGKILL)
        n = len(loop.decisions)
        new = wait_for(lambda: [p for p in fleet.workers("decode") if p is not victim], timeout=60, interval=0.5)
        after = [d["decode"] for d in list(loop.decisions)[n:]]
        assert new, after[-5:]
        assert victim.crashed or victim.state == "ready"
        assert not any(d["limitedBy"] == "rollout" for d in after), after
        up = next(d for d in after if d["desired"] > d["current"])
        assert up["ready"] == 0 and up["current"] == 0, up   # the dead one is no capacity
        # both back: the restarted one counts again, and it no longer marks a failure
        assert wait_for(lambda: victim.state == "ready" and new[0].state == "ready", timeout=150, interval=0.5)
        assert not victim.crashed
        assert wait_for(lambda: any(d["decode"]["ready"] == 2 for d in list(loop.decisions)[n:]), timeout=30)
    finally:
        loop.stop()
        fleet.stop(grace=10)


class _Recorded:
    """The policy, keeping each snapshot it was given beside its decision (the decision records in
    ``FleetAutoscaler.decisions`` keep no queues)."""

    def __init__(self, policy: Autoscaler):
        self.policy, self.seen = policy, []

    def decide(self, snap):
        d = self.policy.decide(snap)
        self.seen.append((snap, d))
        return d


@pytest.mark.timeout(420)
def test_a_deep_prefill_backlog_is_prefilled_on_the_decode_worker():
    """The deep-backlog rule (``Autoscaler(absorb_deep_backlog=)``) on real processes, read by the real
    pods source: a flood of 400-token prompts queues on the one prefill worker, far past twice the TTFT
    target, while decode's p90 TPOT is over its target (an unreachable one: past decode's slack). A
    trickle of short prompts, prefilled on the decode worker (under ``remotePrefillMinTokens``), keeps a
    TPOT in every window: with none (a loaded machine, in a clean-clone run) the policy absorbs on its
    plain rule, decode's latency unknown, and the deep rule is not what fired. The policy asks for
    absorption with decode over its band, and the router then prefills new prompts on the decode worker
    (``absorb_burst`` decisions).

    Failed before the sources read decode's queue without the sequences awaiting their KV from the
    prefill worker: those are prefill's backlog, and counted as local prefills queued on the decode
    worker they made a prompt's start there look as late as the queue's, so the rule refused."""
    fleet = _fleet({"spec.model.dtype": "float32", "spec.engine.kvCache": {"bytes": "1Gi"},
                    "spec.router": {"replicas": 1, "routing": "prefix-affinity", "remotePrefillMinTokens": 64},
                    "spec.prefill": {"resources": CPU, "autoscaling": {
                        "enabled": True, "minReplicas": 1, "maxReplicas": 1,
                        "target": {"metric": "ttft", "percentile": 90, "seconds": 0.5}}},
                    "spec.decode": {"resources": CPU, "autoscaling": {
                        "enabled": True, "minReplicas": 1, "maxReplicas": 1,
                        "target": {"metric": "tpot", "percentile": 90, "seconds": 0.002}}}}, "asdeep")
    cal = Calibration.load(CALIBRATION)
    policy = _Recorded(Autoscaler(fleet.pool.spec, cal, startup_s=20))
    loop = FleetAutoscaler(fleet, window_s=WINDOW_S, interval_s=2, policy=policy)
    band = fleet.pool.spec.decode.autoscaling.target.seconds * 0.9
    words = ("river", "mountain", "harbour", "lantern", "meadow", "copper", "violet", "engine", "orchard",
             "signal", "valley", "thunder")

    def send(i: int, n: int = 300, max_tokens: int = 4) -> None:
        text = f"Case {i}: " + " ".join(words[(i * 7 + k * 5) % len(words)] for k in range(n))
        r = requests.post(fleet.endpoint + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text

    def deep() -> list:
        """(snapshot, decision) of the ticks that absorbed with decode's p90 TPOT over its band."""
        return [(sn, d) for sn, d in list(policy.seen)
                if d.absorb_bursts and sn.decode.latency is not None and sn.decode.latency > band]

    stop = threading.Event()

    def trickle() -> None:
        i = 1000
        while not stop.is_set():
            send(i, 12, 8)
            i += 1
            stop.wait(0.5)

    def watch() -> None:   # the decode worker's prompts being prefilled there: the trickle's, the absorbed
        while not stop.is_set():
            prefilling.append(metric(decode, "tandem:num_requests_prefilling"))
            stop.wait(0.05)

    (decode,) = [p.url for p in fleet.workers("decode")]
    try:
        loop.start()
        assert wait_for(lambda: any(sn.decode.signal != "no_data" for sn, _ in list(policy.seen)), timeout=60,
                        interval=0.2), policy.seen[-2:]
        absorbed = lambda: metric(fleet.endpoint, "tandem:router_routing_decisions_total",  # noqa: E731
                                  decision="absorb_burst")
        before = absorbed()
        prefilling: list[float] = []
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(cf.ThreadPoolExecutor(24))
            stack.callback(stop.set)   # before the pool waits for its threads, whatever fails
            trickling, watching = pool.submit(trickle), pool.submit(watch)
            time.sleep(3)
            flood = [pool.submit(send, 100 + i) for i in range(16)]
            on = wait_for(lambda: deep() and fleet.absorb_bursts, timeout=120, interval=0.2)
            assert on, [(s.prefill, s.decode, d.absorb_bursts) for s, d in policy.seen[-4:]]
            # while absorbing, prompts go to the decode worker (the sources count the ones it is
            # prefilling as decode's queue, as the simulator does); sent again while the flood lasts,
            # should a tick have ended the absorption before they were routed
            k = 200
            while True:
                for f in [pool.submit(send, k + i) for i in range(4)]:
                    f.result()
                k += 4
                if absorbed() > before or all(f.done() for f in flood):
                    break
            stop.set()
            for f in flood + [trickling, watching]:
                f.result()
        s, _ = deep()[0]
        # behind prefill's queue; decode's own queue does not hold the flood awaiting prefill
        assert s.prefill.waiting >= 2 and s.decode.waiting < s.prefill.waiting, (s.prefill, s.decode)
        assert absorbed() > before
        assert max(prefilling) >= 1, prefilling
    finally:
        stop.set()
        loop.stop()
        fleet.stop(grace=10)
