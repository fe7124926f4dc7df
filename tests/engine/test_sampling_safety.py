"""Issue 24: no request can take the engine down. Sampling extremes give finite probabilities, a
request's own failure fails that request alone, and a cut character is flushed at the end.

Fault injection (named as such): ``TANDEM_FAULT_INJECTION=1`` with a request field ``tandem_fault``
makes the engine fail that request's sampling, and a replaced ``runner.execute`` fails a model step:
neither failure can be provoked by valid input any more, which is the point of the fixes."""
import math

import pytest
import torch

from tandem.worker.api.errors import InvalidRequestError
from tandem.worker.api.sampling import FAULT_INJECTION_ENV
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import MAX_FAILED_STEPS, LLMEngine
from tandem.worker.engine.sampler import finite_probs, sample
from tandem.worker.engine.sequence import SamplingParams, Sequence


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=128))


def _clean(engine):
    engine.block_manager.check_invariant()
    assert engine.block_manager.num_used == 0 and not engine.seqs


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6, 9.99e-6])
def test_a_tiny_temperature_is_greedy_and_the_engine_lives(engine, temperature):
    """The defect: ``temperature: 1e-40`` made logits/T overflow to inf, softmax NaN, and
    torch.multinomial raise on the engine thread, killing the engine."""
    greedy = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 6, "ignore_eos": True})[0]
    tiny = engine.generate(["The quick"], {"temperature": temperature, "max_tokens": 6, "ignore_eos": True})[0]
    assert tiny.finish_reason == "length" and tiny.new_token_ids == greedy.new_token_ids
    _clean(engine)


def test_probabilities_are_finite_for_any_logits():
    v = 50
    rows = [torch.full((v,), float("nan")), torch.full((v,), float("-inf")), torch.full((v,), float("inf")),
            torch.tensor([float("inf"), float("nan")] + [0.0] * (v - 2)),
            torch.full((v,), 3.4e38), torch.randn(v) * 1e38, torch.randn(v) / 1e-30]
    for row in rows:
        p = finite_probs(row)
        assert p is None or (torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-4 and (p >= 0).all())
    # and sample() picks a valid token from each, at a sampling temperature, with every filter on
    for row in rows:
        seq = Sequence("r", [1, 2], SamplingParams.parse({"temperature": 0.7, "top_p": 0.9, "top_k": 5}))
        tok = sample(row[None, :].contiguous(), [seq])[0].token_id
        assert 0 <= tok < v


@pytest.mark.parametrize("params,field", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": math.inf}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"3": 101}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),   # outside the tiny model's vocabulary
    ({"seed": -2**64}, "seed"), ({"stop_token_ids": [2**32]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"), ({"top_k": 2**40}, "top_k"),
])
def test_out_of_range_sampling_values_are_refused_by_name(engine, params, field):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", prompt="The quick", params=params)
    assert e.value.field.split(".")[0] == field
    _clean(engine)


def test_logit_bias_and_penalties_steer_the_tokens(engine):
    base = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 4, "ignore_eos": True})[0]
    forced = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 4, "ignore_eos": True,
                                             "logit_bias": {"7": 100}})[0]
    assert forced.new_token_ids == [7, 7, 7, 7]
    banned = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 1, "ignore_eos": True,
                                             "logit_bias": {str(base.new_token_ids[0]): -100}})[0]
    assert banned.new_token_ids[0] != base.new_token_ids[0]
    # a token forced once and then penalized per occurrence stops repeating
    pen = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 4, "ignore_eos": True,
                                          "logit_bias": {"7": 5}, "frequency_penalty": 2.0,
                                          "presence_penalty": 2.0, "repetition_penalty": 1.5})[0]
    assert pen.new_token_ids[0] == 7 and pen.new_token_ids.count(7) < 4
    sampled = engine.generate(["The quick"], {"temperature": 1e-3, "max_tokens": 4, "ignore_eos": True,
                                              "logit_bias": {"7": 100}, "seed": 1})[0]
    assert sampled.new_token_ids == [7, 7, 7, 7]
    _clean(engine)


def test_a_character_cut_by_max_tokens_is_flushed(engine):
    """Issue 24, 3: bytes held for an incomplete character came out nowhere; now the text always
    equals the output tokens decoded (U+FFFD for the cut character)."""
    tok = engine.tokenizer
    lead = list(tok.encode("\U0001F600"))[0]   # a byte-level token of the emoji's first byte(s)
    assert "\ufffd" in tok.decode([lead], skip_special_tokens=True)
    out = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 3, "ignore_eos": True,
                                          "logit_bias": {str(lead): 100}})[0]
    assert out.new_token_ids == [lead] * 3
    expected = tok.decode(out.new_token_ids, skip_special_tokens=True)
    assert expected and "\ufffd" in expected
    assert out.text == expected
    _clean(engine)


def test_a_failing_request_fails_alone(engine, monkeypatch):
    """Per-request isolation: one request's sampling fails (fault injection); it ends with
    finish_reason "error", and the request batched with it finishes normally."""
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    before = engine.stats.request_errors
    engine.add_request("bad", prompt="The quick", params={"max_tokens": 5, "tandem_fault": "sample"})
    engine.add_request("good", prompt="The quick brown", params={"max_tokens": 5, "temperature": 0,
                                                                  "ignore_eos": True})
    final = {}
    while len(final) < 2:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].finish_reason == "error" and "injected" in final["bad"].error
    assert final["good"].finish_reason == "length" and final["good"].num_output_tokens == 5
    assert engine.stats.request_errors == before + 1
    _clean(engine)


def test_a_failing_model_step_fails_its_batch_and_then_the_engine(engine, monkeypatch):
    """A model step that raises (fault injection: ``runner.execute`` replaced) fails that step's
    requests and the engine goes on; MAX_FAILED_STEPS in a row mean a broken model: step() raises."""
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.add_request("a", prompt="The quick", params={"max_tokens": 3})
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["error"] and "boom" in outs[0].error
    _clean(engine)
    for i in range(MAX_FAILED_STEPS - 1):
        engine.add_request(f"b{i}", prompt="The quick", params={"max_tokens": 3})
        if i < MAX_FAILED_STEPS - 2:
            assert engine.step()[0].finish_reason == "error"
        else:
            with pytest.raises(RuntimeError, match="model steps failed in a row"):
                engine.step()
    monkeypatch.setattr(engine.runner, "execute", real)
    for rid in list(engine.seqs):
        engine.abort(rid)
    engine.failed_steps = 0
    assert engine.generate(["The quick"], {"temperature": 0, "max_tokens": 2})[0].num_output_tokens >= 1
    _clean(engine)
