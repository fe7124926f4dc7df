"""Issue 24: a dead engine never takes the pool with it, and a request that fails on the prefill worker
because of itself is not prefilled again on the decode worker.

Fault injection (named as such): the fleet runs with ``TANDEM_FAULT_INJECTION=1``, which turns on a
request field ``tandem_fault: sample`` (the engine fails that request's sampling) and a worker route
``POST /fault/engine`` (the engine thread dies, as a broken model or KV cache would make it). No valid
request can do either any more: that is what the fixes are for."""
import time

import pytest
import requests

from fleet_utils import MODEL, metric, start_fleet, urls, wait_for
from tandem.worker.api.sampling import FAULT_INJECTION_ENV

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def fault_fleet():
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULT_INJECTION_ENV, "1")
    fleet = start_fleet(name="e2e-faults", overrides={"spec.router.unavailableTimeoutSeconds": 2})
    yield fleet
    fleet.stop(grace=10)
    mp.undo()


def _body(**extra):
    return {"model": MODEL, "prompt": "Say hi", "max_tokens": 4, **extra}


def test_a_request_failing_on_the_prefill_worker_is_not_prefilled_again(fault_fleet):
    """No poison fallback: the prefill worker fails the request (its sampling fails); the decode worker
    fails it too, with an OpenAI error, instead of running the same request through a local prefill
    (which, when the failure kills, killed the decode worker as well)."""
    decode, prefill = urls(fault_fleet, "decode")[0], urls(fault_fleet, "prefill")[0]
    fallbacks = metric(decode, "tandem:local_prefill_fallbacks_total")
    r = requests.post(fault_fleet.endpoint + "/v1/completions", json=_body(tandem_fault="sample"), timeout=300)
    assert r.status_code == 500 and "injected sampling fault" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "server_error"
    s = requests.post(fault_fleet.endpoint + "/v1/completions", json=_body(tandem_fault="sample", stream=True),
                      stream=True, timeout=300)
    events = [line for line in s.iter_lines() if line]
    assert any(b'"error"' in e and b"injected sampling fault" in e for e in events), events
    assert metric(decode, "tandem:local_prefill_fallbacks_total") == fallbacks
    assert metric(prefill, "tandem:request_errors_total") >= 2
    assert metric(decode, "tandem:request_success_total", finished_reason="error") >= 2
    for url in (decode, prefill):
        h = requests.get(url + "/health", timeout=10).json()
        assert h["status"] == "ok" and h["num_requests"] == 0
    assert wait_for(lambda: metric(decode, "tandem:kv_cache_usage_perc") == 0.0, 30)
    ok = requests.post(fault_fleet.endpoint + "/v1/completions", json=_body(), timeout=300)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_a_dead_engine_ends_its_process_and_the_fleet_restarts_it(fault_fleet):
    """The engine thread dies: the worker exits with code 3 (not a live process answering 500 forever);
    meanwhile the router fails fast (503 with Retry-After, not a 300 s wait); `tandem up` restarts the
    worker and the pool serves again within its start-up time."""
    proc = next(p for p in fault_fleet.procs if p.role == "decode")
    old = proc.popen
    mark = len(fault_fleet.out.parts)
    r = requests.post(proc.url + "/fault/engine", timeout=10)
    assert r.status_code == 200
    assert wait_for(lambda: old.poll() is not None, 30), "the worker with a dead engine did not exit"
    assert old.returncode == 3
    t0 = time.monotonic()
    r = requests.post(fault_fleet.endpoint + "/v1/completions", json=_body(), timeout=300)
    waited = time.monotonic() - t0
    if r.status_code == 503:   # no decode worker ready yet: the fast failure, not the scale-from-zero wait
        assert r.headers.get("Retry-After") and r.json()["error"]["code"] == 503
        assert waited < 60, waited
    else:                      # the restart was already done (a fast machine): it answered normally
        assert r.status_code == 200, r.text
    assert wait_for(lambda: proc.popen is not old and proc.state == "ready", 300, 0.5), \
        "the fleet did not restart the worker"
    log = fault_fleet.out.text(mark)
    assert "exited with code 3" in log and "engine died" in log
    served = wait_for(lambda: requests.post(fault_fleet.endpoint + "/v1/completions", json=_body(),
                                            timeout=300).status_code == 200, 60, 1.0)
    assert served
