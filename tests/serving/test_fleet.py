"""The main job end to end: `tandem up` runs examples/smollm2.yaml (router, 1 prefill, 1 decode worker,
remotePrefillMinTokens 0) as real processes on loopback, serving the real SmolLM2 model."""
import concurrent.futures as cf
import json
import signal

import pytest
import requests

from fleet_utils import MODEL, chat, metric, prefix_cache_hits, read_stream, start_worker, urls, wait_for

pytestmark = pytest.mark.timeout(900)
QUESTION = "What is the capital of France?"




@pytest.fixture(scope="module")
def both_worker():
    proc, url = start_worker("both")
    yield proc, url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:
            proc.kill()


def test_paris_through_remote_prefill(fleet, both_worker):
    (prefill,), (decode,) = urls(fleet, "prefill"), urls(fleet, "decode")
    decode_computed = metric(decode, "tandem:prompt_tokens_computed_total")
    prefill_computed = metric(prefill, "tandem:prompt_tokens_computed_total")
    received = metric(fleet.endpoint, "tandem:router_requests_received_total")
    prompt_tokens = metric(fleet.endpoint, "tandem:router_prompt_tokens_total")
    text, body = chat(fleet.endpoint, QUESTION)
    # the router counts each request and its whole prompt on arrival (the autoscaler's prefill demand)
    assert metric(fleet.endpoint, "tandem:router_requests_received_total") == received + 1
    assert metric(fleet.endpoint, "tandem:router_prompt_tokens_total") == prompt_tokens + body["usage"]["prompt_tokens"]
    assert "Paris" in text
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0
    # the KV was computed on the prefill worker and used, not recomputed, by the decode worker
    assert metric(decode, "tandem:prompt_tokens_computed_total") == decode_computed
    assert metric(prefill, "tandem:prompt_tokens_computed_total") > prefill_computed
    assert metric(prefill, "tandem:kv_transfer_bytes_total", direction="sent") > 0
    assert metric(decode, "tandem:kv_transfer_bytes_total", direction="received") > 0
    assert metric(fleet.endpoint, "tandem:router_routing_decisions_total", decision="remote") >= 1
    # greedy output equals the same request on a single `both` worker
    _, both_url = both_worker
    assert chat(both_url, QUESTION)[0] == text
    # streamed text equals the non-streamed text (chat and completions)
    streamed, chunks = chat(fleet.endpoint, QUESTION, stream=True)
    assert streamed == text
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    full = requests.post(fleet.endpoint + "/v1/completions", json=body, timeout=300).json()
    assert full["object"] == "text_completion" and full["usage"]["completion_tokens"] == 12
    r = requests.post(fleet.endpoint + "/v1/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, stream=True, timeout=300)
    text2, chunks2 = read_stream(r)
    assert text2 == full["choices"][0]["text"]
    assert chunks2[-1]["usage"]["completion_tokens"] == 12
    # the router measured TTFT as the client sees it
    assert metric(fleet.endpoint, "tandem:time_to_first_token_seconds_count", role="router") >= 3


def test_router_skips_remote_prefill_when_decode_caches_the_prefix(fleet):
    (decode,) = urls(fleet, "decode")
    # long enough that the chat template's default system prompt (shared with earlier requests, so
    # cached on the decode worker) is less than half of its blocks
    question = ("Name three rivers of Europe, the countries they flow through, the seas they reach, "
                "their lengths in kilometres, the largest cities on their banks, and one famous bridge "
                "over each of them. Answer as a short list.")
    before = metric(fleet.endpoint, "tandem:router_routing_decisions_total", decision="decode_cached")
    sent = metric(decode, "tandem:kv_transfer_bytes_total", direction="received")
    first = chat(fleet.endpoint, question)[0]
    assert metric(decode, "tandem:kv_transfer_bytes_total", direction="received") > sent
    sent = metric(decode, "tandem:kv_transfer_bytes_total", direction="received")
    again = chat(fleet.endpoint, question)[0]
    assert again == first
    assert metric(fleet.endpoint, "tandem:router_routing_decisions_total", decision="decode_cached") == before + 1
    assert metric(decode, "tandem:kv_transfer_bytes_total", direction="received") == sent
    assert metric(decode, "tandem:prefix_cache_hits_total") > 0


SYSTEM = ("You are a meticulous assistant for a travel company. Answer briefly, in one sentence, and "
          "never invent facts. If you do not know, say so. Prefer metric units and 24-hour times. ")


def test_shared_prefix_concurrent_requests(fleet):
    before = prefix_cache_hits(fleet)
    questions = [f"Question {i}: describe in detail the history, climate, food, people and sights of the "
                 f"city number {i} in a list of the {i * 7 % 50 + 50} largest cities of Europe." for i in range(16)]
    # the first alone: blocks enter the prefix cache once computed, and sixteen sent at once could all
    # land in one prefill step before any block of the shared prompt is. The rest then find it cached on
    # the prefill worker, or on the decode worker when the router skips remote prefill for them.
    results = [chat(fleet.endpoint, questions[0], system=SYSTEM, max_tokens=8)]
    with cf.ThreadPoolExecutor(15) as ex:
        results += ex.map(lambda q: chat(fleet.endpoint, q, system=SYSTEM, max_tokens=8), questions[1:])
    assert len(results) == 16 and all(isinstance(t, str) and b["usage"]["completion_tokens"] > 0
                                      for t, b in results)
    assert prefix_cache_hits(fleet) - before >= 15 * 16   # a full 16-token block of the system prompt each


def test_no_kv_leaks_after_load(fleet):
    for url in urls(fleet, "prefill") + urls(fleet, "decode"):
        assert wait_for(lambda: metric(url, "tandem:kv_cache_usage_perc") == 0.0, 30), url


BAD = [
    ("malformed JSON", b"{not json", 400, None),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("wrong type", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
     400, "max_tokens"),
    ("unknown model", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
     400, "max_tokens"),
    ("temperature out of range", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "temperature": -2}, 400, "temperature"),
    ("prompt over the context length", {"model": MODEL, "messages": [{"role": "user", "content": "fox " * 2100}]},
     400, "messages"),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("message without content", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages.0"),
    ("boolean max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": True},
     400, "max_tokens"),
]


@pytest.mark.parametrize("case,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_then_service_continues(fleet, both_worker, case, body, status, param):
    for url in (fleet.endpoint, both_worker[1]):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = requests.post(url + "/v1/chat/completions", data=data, timeout=60,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == status, (url, r.text)
        err = r.json()["error"]
        assert err["message"]
        if param:
            assert err["param"] == param, err
        if case == "prompt over the context length":
            assert "2048" in err["message"]
        assert "Paris" in chat(url, QUESTION)[0]


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": 123}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
])
def test_bad_completions_and_unknown_paths(fleet, body, param):
    r = requests.post(fleet.endpoint + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for method, path, status in (("GET", "/v2/nothing", 404), ("GET", "/v1/completions", 405)):
        r = requests.request(method, fleet.endpoint + path, timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == status


def test_client_disconnect_mid_stream_frees_blocks(fleet):
    (decode,) = urls(fleet, "decode")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    r = requests.post(fleet.endpoint + "/v1/chat/completions", json=body, stream=True, timeout=300)
    lines = r.iter_lines()
    for _ in range(6):
        next(lines)
    assert metric(decode, "tandem:kv_cache_usage_perc") > 0
    r.close()
    assert wait_for(lambda: metric(decode, "tandem:kv_cache_usage_perc") == 0.0, 30)
    assert metric(decode, "tandem:num_requests_running") == 0
    assert "Paris" in chat(fleet.endpoint, QUESTION)[0]


def test_router_counts_a_prefill_worker_only_until_the_first_token(fleet):
    """The router's load table (its /health) counts a streamed request against its prefill worker until
    the first token, and against its decode worker until the end: a prefill worker that served a long
    answer's prompt is free while the answer streams (it counted until the stream's end before)."""
    (prefill,), (decode,) = urls(fleet, "prefill"), urls(fleet, "decode")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a cat."}],
            "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}

    def table():
        workers = requests.get(fleet.endpoint + "/health", timeout=5).json()["workers"]
        return {u: w["in_flight"] for u, w in workers.items()}
    r = requests.post(fleet.endpoint + "/v1/chat/completions", json=body, stream=True, timeout=300)
    try:
        lines = (x for x in r.iter_lines() if x.startswith(b"data: "))
        for _ in range(4):   # the role chunk, then tokens: prefill is over
            next(lines)
        assert metric(prefill, "tandem:kv_transfer_bytes_total", direction="sent") > 0
        assert table() == {prefill: 0, decode: 1}
    finally:
        r.close()
    assert wait_for(lambda: table() == {prefill: 0, decode: 0}, 30)


def test_models_health_and_metrics_routes(fleet):
    from tandem.worker.bench.counting import served_tokenizer
    models = requests.get(fleet.endpoint + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL
    (decode,) = urls(fleet, "decode")
    # both name the model source (vLLM's `root`): `tandem bench serve` counts usage-less streams with it
    worker_models = requests.get(decode + "/v1/models", timeout=10).json()
    assert served_tokenizer(models) == served_tokenizer(worker_models) == "package:" + fleet.pool.spec.model.source.package
    h = requests.get(decode + "/health", timeout=10).json()
    assert h["role"] == "decode" and h["num_blocks"] > 0
    text = requests.get(decode + "/metrics", timeout=10).text
    for name in ("tandem:time_to_first_token_seconds", "tandem:kv_cache_usage_perc", "tandem:num_requests_running",
                 "tandem:prefix_cache_queries_total", "tandem:generation_tokens_total", "tandem:preemptions_total"):
        assert name in text
    assert 'pool="e2e"' in text and 'role="decode"' in text


def test_drain_finishes_in_flight_requests(both_worker):
    proc, url = both_worker
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
            "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(requests.post, url + "/v1/chat/completions", json=body, timeout=300) for _ in range(4)]
        # drain once all four have arrived: one arriving after the drain is rightly refused with 503
        assert wait_for(lambda: requests.get(url + "/drain", timeout=5).json()["in_flight"] == 4, 60)
        status = requests.post(url + "/drain", timeout=10).json()
        assert status["draining"] and status["in_flight"] > 0 and not status["drained"]
        assert requests.get(url + "/ready", timeout=5).status_code == 503
        late = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert late.status_code == 503
        results = [f.result() for f in futs]
    assert all(r.status_code == 200 for r in results)
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in results)
    assert wait_for(lambda: requests.get(url + "/drain", timeout=5).json()["drained"], 30)
    assert proc.poll() is None   # drained workers wait for the backend to remove them


def test_sigterm_drains_then_exits():
    proc, url = start_worker("both", "sigterm-worker")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
            "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(requests.post, url + "/v1/chat/completions", json=body, timeout=300) for _ in range(2)]
        assert wait_for(lambda: requests.get(url + "/drain", timeout=5).json()["in_flight"] == 2, 60)  # both arrived
        proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futs]
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32 for r in results)
    assert proc.wait(60) == 0
