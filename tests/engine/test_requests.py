"""Bad input, sampling options, stop conditions, incremental detokenization, block hashes, loading errors."""
import logging
import os
import subprocess
import sys

import pytest

from tandem.worker.api.block_hash import ROOT_HASH, block_hashes, fingerprint, hash_block
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.detokenizer import IncrementalDetokenizer
from tandem.worker.engine.llm_engine import LLMEngine
from tandem.worker.engine.loader import ModelLoadError, load_model
from tandem.worker.api.errors import InvalidRequestError


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=128))


@pytest.mark.parametrize("prompt,params,field", [
    ("", {}, "prompt"),
    ("fox " * 200, {}, "prompt"),
    ("fox", {"max_tokens": 0}, "max_tokens"),
    ("fox", {"max_tokens": -3}, "max_tokens"),
    ("fox", {"max_tokens": 127}, "max_tokens"),
    ("fox", {"temperature": -1}, "temperature"),
    ("fox", {"top_p": 1.5}, "top_p"),
    ("fox", {"top_k": -2}, "top_k"),
    ("fox", {"logprobs": 99}, "logprobs"),
    ("fox", {"max_tokens": "many"}, "max_tokens"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine, prompt, params, field):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", prompt=prompt, params=params)
    assert e.value.field == field
    assert "bad" not in engine.seqs
    if "maximum context length" in str(e.value):
        assert "128" in str(e.value)
    out = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 3, "ignore_eos": True})[0]
    assert len(out.new_token_ids) == 3
    engine.block_manager.check_invariant()
    assert engine.block_manager.num_used == 0


def test_unknown_fields_are_ignored_and_logged(engine, caplog):
    with caplog.at_level(logging.INFO):
        out = engine.generate(["The quick"], {"temperature": 0, "max_tokens": 2, "frobnicate": 1})[0]
    assert out.num_output_tokens >= 1
    assert "frobnicate" in caplog.text


def test_abort_frees_blocks(engine):
    engine.add_request("gone", prompt="The quick brown fox jumps", params={"max_tokens": 50})
    engine.step()
    assert engine.block_manager.num_used > 0
    engine.abort("gone")
    assert engine.block_manager.num_used == 0 and "gone" not in engine.seqs
    engine.block_manager.check_invariant()


def test_sampling_options(engine):
    ids = engine.tokenize("Paged attention keeps")
    greedy = engine.generate([ids], {"temperature": 0, "max_tokens": 8, "ignore_eos": True})[0].new_token_ids
    top1 = engine.generate([ids], {"temperature": 1.0, "top_k": 1, "max_tokens": 8, "ignore_eos": True})[0]
    assert top1.new_token_ids == greedy
    tiny_p = engine.generate([ids], {"temperature": 1.0, "top_p": 1e-6, "max_tokens": 8, "ignore_eos": True})[0]
    assert tiny_p.new_token_ids == greedy
    p = {"temperature": 1.5, "max_tokens": 16, "seed": 11, "ignore_eos": True}
    a, b = engine.generate([ids, ids], p)
    assert a.new_token_ids == b.new_token_ids
    c = engine.generate([ids], {**p, "seed": 12})[0]
    assert c.new_token_ids != a.new_token_ids
    lp = engine.generate([ids], {"temperature": 0, "max_tokens": 3, "logprobs": 3, "ignore_eos": True})
    # logprobs come per output; the final output carries the last token's
    assert lp[0].logprobs and len(lp[0].logprobs[0].top_logprobs) == 3
    assert lp[0].logprobs[0].logprob <= 0


def test_stop_strings_and_stop_tokens(engine):
    ids = engine.tokenize("The quick brown")
    full = engine.generate([ids], {"temperature": 0, "max_tokens": 20, "ignore_eos": True})[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = engine.generate([ids], {"temperature": 0, "max_tokens": 20, "ignore_eos": True, "stop": stop})[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    tok = full.new_token_ids[4]
    st = engine.generate([ids], {"temperature": 0, "max_tokens": 20, "ignore_eos": True,
                                 "stop_token_ids": [tok]})[0]
    assert st.finish_reason == "stop"
    assert st.new_token_ids == full.new_token_ids[:full.new_token_ids.index(tok) + 1]


def test_streamed_text_equals_final_text_with_stop_string(engine):
    ids = engine.tokenize("Paris is")
    full = engine.generate([ids], {"temperature": 0, "max_tokens": 16, "ignore_eos": True})[0].text
    stop = full[5:8]
    engine.add_request("s", prompt_token_ids=ids, params={"temperature": 0, "max_tokens": 16,
                                                          "ignore_eos": True, "stop": [stop]})
    streamed, final = "", None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_text
            final = out
    assert streamed == final.text and stop not in streamed


def test_detokenizer_never_emits_half_a_character(tiny_llama):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    text = "héllo wörld, 世界, emoji 😀 and 世界😀😀 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert any(d == "" for d in deltas)   # some tokens were held back mid-character


def test_block_hashes_are_stable_across_processes():
    fp = fingerprint(model="m", dtype="float32")
    ids = list(range(100))
    hashes = block_hashes(ids, 16, fp)
    assert len(hashes) == 6
    assert hashes[1] == hash_block(hashes[0], ids[16:32], fp)
    assert block_hashes(ids, 16, fp, start=3, parent=hashes[2]) == hashes[3:]
    code = ("from tandem.worker.api.block_hash import block_hashes, fingerprint;"
            "print(block_hashes(list(range(100)), 16, fingerprint(model='m', dtype='float32'))[-1].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hashes[-1].hex()
    assert block_hashes(ids, 16, fingerprint(model="other", dtype="float32"))[0] != hashes[0]
    assert hash_block(ROOT_HASH, [1] * 16, fp) != hash_block(ROOT_HASH, [1] * 15 + [2], fp)


def test_loading_errors_name_the_file(tmp_path, tiny_llama):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(bad))
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "missing"))
    d = tmp_path / "gpt2ish"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(d))
    import shutil
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(corrupt))
    with pytest.raises(ModelLoadError, match="no_such_pkg"):
        load_model("package:no_such_pkg/x.gguf")


def test_generate_cli_errors_are_one_line(tmp_path):
    bad_model = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "generate", "--model",
                                str(tmp_path / "missing.gguf"), "--prompt", "hi"], capture_output=True, text=True,
                               env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert bad_model.returncode == 2
    assert bad_model.stderr.strip().splitlines()[-1].startswith("error: ") and "no such file" in bad_model.stderr
    assert "Traceback" not in bad_model.stderr
    bad_value = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "generate", "--model", "x",
                                "--prompt", "hi", "--max-tokens", "-1"], capture_output=True, text=True,
                               env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert bad_value.returncode == 2 and "max_tokens" in bad_value.stderr
