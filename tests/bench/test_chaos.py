"""The chaos soak (worker/bench/chaos.py, issue 29) in its CI size: a local fleet (2 prefill and 2
decode workers, autoscaled, and the router) under an open-loop load for 45 s, with one fault of each
kind (kill -9 of a decode worker, of a prefill worker, of the router; a worker stopped for 10 s; the
KV connections cut). The longer soak's table is in bench/RESULTS.md (tenth session)."""
import json
import sys

import pytest

from fleet_utils import ROOT, example_manifest
from tandem.worker.bench.chaos import FAULT_KINDS, UNAVOIDABLE, ChaosConfig, fault_schedule, run_chaos, table


def test_fault_schedule_is_seeded_and_meets_every_kind():
    a = fault_schedule(7, 100, 10)
    assert a == fault_schedule(7, 100, 10) and a != fault_schedule(8, 100, 10)
    assert [t for t, _ in a] == [10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert fault_schedule(1, 45, 8)[-1][0] == 40          # the CI soak below gets five faults
    assert sorted(k for _, k in a[:5]) == sorted(FAULT_KINDS)     # each round is every kind once


def test_client_sends_again_what_never_reached_a_server():
    """A refused connection (a router restarting) is sent again every 0.5 s within Target.resend_s,
    then reported; without resend_s it is reported at once."""
    import asyncio

    import aiohttp

    from tandem.operator.local import free_port
    from tandem.worker.bench.client import RequestRecord, Target, send
    from tandem.worker.bench.datasets import BenchRequest

    async def one(resend_s):
        req = BenchRequest("r0", [{"role": "user", "content": "hi"}], 1, 4)
        rec = RequestRecord("r0", None, 0, False, None)
        async with aiohttp.ClientSession() as s:
            return await send(s, Target(f"http://127.0.0.1:{free_port()}", "m", resend_s=resend_s, timeout=10), req, rec)
    again, once = asyncio.run(one(1.6)), asyncio.run(one(0))
    assert again.error_kind == once.error_kind == "connect"
    assert again.resends >= 2 and once.resends == 0
    assert 1.0 <= again.e2e < 3.0


@pytest.mark.timeout(600)
def test_chaos_soak_fails_only_begun_streams_and_leaks_nothing(tmp_path):
    cfg = ChaosConfig(str(example_manifest(name="chaos")), str(ROOT / "bench/calibrations/smollm2-cpu.yaml"),
                      duration_s=45, fault_every_s=8, load_fraction=0.15, stop_s=10, cut_s=2,
                      deadline_s=90, seed=1, output_dir=str(tmp_path))
    s = run_chaos(cfg, log=sys.stderr)
    bad = [r for r in s["records"] if r["class"] not in ("ok", *UNAVOIDABLE)]
    assert not bad, json.dumps({"bad": bad, "faults": s["fault_log"]}, indent=1)
    assert s["hung"] == 0 and s["failed_other"] == 0
    assert s["leaked_workers"] == [], s["idle"]
    assert s["faults"] == {k: 1 for k in FAULT_KINDS}, s["fault_log"]
    assert s["by_class"].get("ok", 0) > 0, s["by_class"]
    assert (tmp_path / "requests.jsonl").read_text().count("\n") == s["requests"]
    # SLO recovery: one entry per injected fault, each measured against the same aim
    assert [x["kind"] for x in s["slo_recovery"]] == [f["kind"] for f in s["fault_log"]
                                                      if not f["note"].startswith(("skipped", "failed"))]
    assert s["slo"]["aim_s"] == pytest.approx(s["slo"]["startup_s"] + 2 * cfg.autoscale_window_s, abs=0.11)
    assert "recovery to >= 95%" in table(s)


def test_slo_recovery_is_the_first_window_back_at_95_percent():
    """Per fault: the first time from which the requests that end within a window meet the SLO in >= 95%
    of cases. Rows as requests.jsonl writes them; one request sent a second, each ending TTFT + 0.9 s
    later: TTFT 5 s (a miss) for those sent in the 10 s after a fault at t=20, 0.2 s otherwise; TPOT
    0.1 s throughout; one failed request (no E2E: it counts at its send)."""
    from tandem.worker.bench.chaos import Fault, slo_met, slo_recovery, startup_seconds

    def row(t, ttft, cls="ok"):
        return {"send_unix": 1000.0 + t, "ttft": ttft, "e2e": None if ttft is None else ttft + 0.1 * 9,
                "completion_tokens": 10, "class": cls}
    rows = [row(t, 5.0 if 20 <= t < 30 else 0.2) for t in range(60)]
    rows[45] = row(45, None, "failed")
    assert slo_met(rows[0], 3.0, 0.5) and not slo_met(rows[21], 3.0, 0.5) and not slo_met(rows[45], 3.0, 0.5)
    assert not slo_met(rows[0], 3.0, 0.05)                     # TPOT counts too
    faults = [Fault(0, "kill_decode", 1020.0, 1030.0, "decode-0"), Fault(1, "cut_kv", 1040.0, 1041.0),
              Fault(2, "kill_prefill", 1050.0, 1050.0, note="skipped: 1 ready prefill worker(s)")]
    out = slo_recovery(rows, faults, 3.0, 0.5, window_s=5.0, aim_s=25.0)
    assert [x["id"] for x in out] == [0, 1]                  # a skipped fault is not measured
    # the misses end at 25.9 .. 34.9 s, between hits; the first clean window opens at the next end, 35.1 s
    assert out[0]["recovery_s"] == 15.1 and out[0]["within_aim"] and out[0]["at_s"] == 20.0
    assert out[1]["recovery_s"] == 0.0                        # ends 40.1 .. 44.1: all met (the failure ends at 45)
    wide = slo_recovery(rows, faults[:1], 3.0, 0.5, window_s=10.0, aim_s=5.0)
    assert wide[0]["attainment_after"] == 0.167              # [20, 30): one hit, five misses
    # a 10 s window from 35.1 s holds the failure at 45 s (9 of 10, below 95%): clean from 45.1 s
    assert wide[0]["recovery_s"] == 25.1 and not wide[0]["within_aim"]
    never = slo_recovery([row(t, 5.0) for t in range(60)], faults[:1], 3.0, 0.5, 5.0, 25.0)
    assert never[0]["recovery_s"] is None and not never[0]["within_aim"]
    assert startup_seconds(faults, 30.0) == (10.0, "median of 1 worker restart(s)")
    assert startup_seconds(faults[1:], 30.0) == (30.0, "configured")


def test_kube_target_proxy_skips_a_router_that_refuses():
    """bench/chaos_kube.py's stand-in for kube-proxy (the test cluster has none): each new connection
    goes to a backend that accepts it, so with one of two routers killed (its port refuses) every
    request still reaches the other. Real sockets on loopback: one aiohttp server, one closed port."""
    import threading

    import requests
    from aiohttp import web

    from tandem.operator.local import free_port
    sys.path.insert(0, str(ROOT / "bench"))
    from chaos_kube import ServiceProxy

    alive, dead = free_port(), free_port()
    started = threading.Event()

    def serve():
        import asyncio
        loop = asyncio.new_event_loop()
        app = web.Application()

        async def ready(_):
            return web.Response(text="router")
        app.router.add_get("/ready", ready)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", alive).start())
        started.set()
        loop.run_forever()
    threading.Thread(target=serve, daemon=True).start()
    assert started.wait(10)
    proxy = ServiceProxy(lambda: [("127.0.0.1", dead), ("127.0.0.1", alive)])
    try:
        for _ in range(4):      # round robin starts at either: each connection lands on the live one
            with requests.Session() as s:
                assert s.get(proxy.url + "/ready", timeout=10).text == "router"
    finally:
        proxy.stop()


def test_kube_outage_rows_count_what_the_autoscaler_did_while_the_api_server_was_down():
    """bench/chaos_kube.py's reading of the operator's tick counters through an outage (down from 100 to
    130): decided ticks and scaling actions inside it (from 3 s after the stop), the other ticks by
    outcome, and the first decision after it was back. Scrapes written by the test."""
    sys.path.insert(0, str(ROOT / "bench"))
    from chaos_kube import outage_rows

    from tandem.worker.bench.chaos import Fault
    held = [(t, "op-a", {"decided": 10.0, "api_unavailable": float(t - 101) // 2}, 4.0) for t in range(101, 131)]
    after = [(131.0, "op-a", {"decided": 10.0}, 4.0), (134.0, "op-a", {"decided": 11.0}, 4.0)]
    rows = outage_rows([(99.0, "op-a", {"decided": 9.0}, 4.0), *held, *after],
                       [Fault(0, "apiserver_outage", 100.0, 130.0), Fault(1, "kill_router", 140.0, 150.0)])
    assert rows == [{"fault": 0, "down_s": 30.0, "scrapes": 28, "decided_while_down": 0, "actions_while_down": 0,
                     "ticks_while_down": {"api_unavailable": 13}, "first_decision_after_s": 4.0}]
    # a decision while down is counted (the aim's breach), by pod
    moved = held[:20] + [(t, "op-a", {"decided": 11.0}, 5.0) for t in range(121, 131)]
    (row,) = outage_rows(moved, [Fault(0, "apiserver_outage", 100.0, 130.0)])
    assert row["decided_while_down"] == 1 and row["actions_while_down"] == 1 and row["first_decision_after_s"] is None
