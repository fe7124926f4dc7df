"""A Llama-family tokenizer that imports neither torch nor transformers, so the router can load one.

``tokenizers`` encodes and decodes, ``jinja2`` renders the chat template and ``gguf`` reads a GGUF
file's metadata; this module only assembles them the way transformers 5 does, so the router and the
workers (which use the same class) produce the same token ids as ``AutoTokenizer`` would:

* a Hugging Face directory as ``TokenizersBackend`` loads it (``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja``, legacy ``special_tokens_map.json``);
* a GGUF file as ``transformers/integrations/gguf/gguf_tokenizer_mapping.py`` converts it
  (``tokenizer.ggml.model`` ``gpt2``: byte-level BPE; ``llama``: sentencepiece-style BPE);
* chat templates as ``transformers/utils/chat_template_utils.py`` renders them.

tests/engine/test_tokenizer.py checks the ids against transformers on the same sources.
"""
from __future__ import annotations

import functools
import json
import mmap
import struct
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from tandem.worker.api.errors import InvalidRequestError
from tandem.worker.api.source import ModelLoadError, resolve_source

__all__ = ["Tokenizer", "load_tokenizer", "chat_token_ids", "ModelLoadError", "resolve_source"]

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens, also chat-template variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what transformers keeps beside it: named special tokens,
    whether to add BOS/EOS, and the chat template.

    Build one with :meth:`from_hf_dir`, :meth:`from_gguf` or :func:`load_tokenizer`. The methods
    have transformers' names and defaults, so callers written for ``AutoTokenizer`` work unchanged.

    Args:
        backend: the ``tokenizers.Tokenizer``; it is changed in place (special tokens added, and the
            post-processor replaced when ``add_bos_token``/``add_eos_token`` are given).
        special_tokens: named special tokens (``bos_token``, ``eos_token``, ...) to their text; any
            not yet an added token becomes a special one, as in transformers' ``TokenizersBackend``.
        chat_template: a Jinja template, a ``{name: template}`` dict (``default`` is used), or None.
        add_bos_token, add_eos_token: rebuild the post-processor to add these around ``encode``'s
            ids (transformers' ``update_post_processor``); both None keeps the backend's own (as
            transformers 5 does for a directory with a ``tokenizer.json``, whatever
            ``tokenizer_config.json`` says).
    """

    def __init__(self, backend: Backend, special_tokens: dict[str, str | None],
                 chat_template: str | dict | None = None, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None):
        self.backend = backend
        self.special_tokens_map = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [AddedToken(t, special=True, normalized=False) for t in self.special_tokens_map.values()
                   if t not in present]
        if missing:
            backend.add_special_tokens(missing)
        if add_bos_token is not None or add_eos_token is not None:
            bos = self.bos_token if add_bos_token else None
            eos = self.eos_token if add_eos_token else None
            single = " ".join([f"{bos}:0"] * bool(bos) + ["$A:0"] + [f"{eos}:0"] * bool(eos))
            pair = " ".join([single] + [f"{bos}:1"] * bool(bos) + ["$B:1"] + [f"{eos}:1"] * bool(eos))
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair,
                special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t])

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    def __len__(self) -> int:
        """The vocabulary size with the added tokens (transformers' ``len(tokenizer)``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it are parsed as such, and BOS/EOS are
        added where the tokenizer config says so (unless ``add_special_tokens`` is False)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The text of ``ids`` (a list of ints, or one int).

        ``clean_up_tokenization_spaces`` is accepted for transformers' signature and never applied:
        transformers skips that clean-up for BPE models too, and every tokenizer built here is BPE.
        """
        return self.backend.decode([ids] if isinstance(ids, int) else list(ids),
                                   skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Every vocabulary entry (as spelled, added tokens included) and its id."""
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        """The vocabulary entry (not the text) of one id, or of each id in a list."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False, **template_vars):
        """Render ``messages`` with the chat template, then (``tokenize``) encode the text.

        As transformers' ``apply_chat_template`` (with its default ``sanitize_control_tokens=False``):
        the template sees ``messages`` (keys whose value is None dropped), ``add_generation_prompt``,
        ``tools``/``documents`` (None), the named special tokens and ``template_vars``; the rendered
        text is encoded without adding BOS/EOS, since the template writes its own.

        Returns the text, the ids, or ``{"input_ids", "attention_mask"}`` with ``return_dict``.
        Raises ValueError (no template, no messages) or jinja2.TemplateError (the template refused).
        """
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        template = self.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            raise ValueError("this tokenizer has no chat template")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = _compile_chat_template(template).render(
            messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_vars})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        """Load ``tokenizer.json`` (required) with ``tokenizer_config.json``, ``chat_template.jinja``
        and ``special_tokens_map.json`` where present. BOS/EOS are added as ``tokenizer.json``'s
        post-processor says: transformers 5 drops tokenizer_config's ``add_bos_token`` when there is a
        ``tokenizer.json``. Raises ModelLoadError naming a missing ``tokenizer.json``; a corrupt file
        raises the parser's error (which load_tokenizer turns into a ModelLoadError)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path / 'tokenizer.json'}: missing (only the tokenizers-library "
                                 "format is supported, not a sentencepiece tokenizer.model alone)")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        legacy = _read_json(path / "special_tokens_map.json")  # older repos keep the names here
        special = {name: _token_text(config.get(name) or legacy.get(name)) for name in SPECIAL_TOKEN_NAMES}
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # the saved form of several named templates
            template = {t["name"]: t["template"] for t in template}
        return cls(backend, special, template)

    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes in its ``tokenizer.*`` metadata.

        Mirrors transformers' ``gguf_tokenizer_mapping.py``: ``gpt2`` is byte-level BPE with the
        split regex named by ``tokenizer.ggml.pre``; ``llama`` is sentencepiece-style BPE with byte
        fallback and a metaspace, adding BOS unless the file says otherwise. Control tokens
        (token_type 3) become special tokens, user-defined ones (4) added tokens. Not reproduced:
        transformers' intermediate GPT2Tokenizer/LlamaTokenizer also add their default names
        (``<|endoftext|>``; ``<unk>``, ``<s>``, ``</s>``) when the vocabulary lacks them, giving ids
        past the model's embeddings.

        Raises ModelLoadError naming the file for an unreadable file or another tokenizer type.
        """
        path = Path(path)
        try:
            meta = read_gguf_metadata(path)
        except Exception as e:
            raise ModelLoadError(f"{path}: corrupt or truncated GGUF file: {type(e).__name__}: {e}") from e
        field = meta.get
        kind, arch = field("tokenizer.ggml.model"), field("general.architecture")
        if kind == "llama" and arch in _OTHER_SENTENCEPIECE_ARCHS:
            raise ModelLoadError(f"{path}: the {arch!r} variant of GGUF tokenizer type 'llama' is "
                                 "not supported (supported: gpt2, llama)")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(f"{path}: unsupported GGUF tokenizer type {kind!r} "
                                 "(tokenizer.ggml.model; supported: gpt2, llama)")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type") or []
        merges = field("tokenizer.ggml.merges")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, merges, field("tokenizer.ggml.pre"))
            alphabet = set(pre_tokenizers.ByteLevel.alphabet())
            # A control token spelled outside the byte alphabet is a llama.cpp mislabel (transformers
            # skips it too): adding it would grow the vocabulary past the model's embeddings.
            control = [t for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet]
        else:
            backend = _sentencepiece_bpe(tokens, merges, field("tokenizer.ggml.scores"))
            control = [t for t, ty in zip(tokens, types) if ty == 3]
        if control:
            backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        vocab = backend.get_vocab()
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
        if user:  # llama.cpp always matches these whole, so they must not be cut into pieces
            backend.add_tokens(user)

        def token(key):
            i = field(f"tokenizer.ggml.{key}")
            return None if i is None else tokens[i]

        special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                   "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
        # Sentencepiece files without the flag get BOS, as llama.cpp gives them.
        add_bos = field("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(backend, special, field("tokenizer.chat_template"), bool(add_bos),
                   bool(field("tokenizer.ggml.add_eos_token", False)))


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of ``source`` (a HF directory or a ``.gguf`` file; see :func:`resolve_source`).

    Raises ModelLoadError, naming the file, when it is missing, unreadable or of a kind not supported.
    """
    path = resolve_source(source)
    try:
        if path.is_file() and path.suffix == ".gguf":
            return Tokenizer.from_gguf(path)
        if path.is_dir():
            return Tokenizer.from_hf_dir(path)
    except ModelLoadError:
        raise
    except Exception as e:  # a library's parse error becomes one clear message with the file name
        raise ModelLoadError(f"{path}: cannot load tokenizer: {type(e).__name__}: {e}") from e
    raise ModelLoadError(f"{path}: not a .gguf file or a Hugging Face model directory")


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, with the generation prompt.

    Raises InvalidRequestError (field ``messages``) when the template rejects them."""
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    except Exception as e:
        raise InvalidRequestError("messages", f"cannot apply the chat template: {e}") from None


def read_gguf_metadata(path: Path) -> dict:
    """The key-value metadata of a GGUF file (v2/v3, little-endian), without its tensors.

    ``gguf.GGUFReader`` gives the same values but builds a numpy view for every string of the
    vocabulary and merges: 8-12 s for SmolLM2's 98k strings on a busy 2-core machine, against well
    under a second here (transformers reads GGUF metadata with its own reader for the same reason).
    The layout is the GGUF spec's (github.com/ggml-org/ggml, docs/gguf.md); the type codes and magic
    come from the ``gguf`` package. Raises ValueError (not GGUF) or struct.error (truncated).
    """
    from gguf.constants import GGUF_MAGIC, GGUFValueType as T

    scalar = {T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I", T.INT32: "i",
              T.FLOAT32: "f", T.BOOL: "?", T.UINT64: "Q", T.INT64: "q", T.FLOAT64: "d"}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        if magic != GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic:#x}, version {version})")
        pos = 24

        def take(fmt):
            nonlocal pos
            out = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return out

        def value(vtype):
            nonlocal pos
            if vtype == T.STRING:
                (n,) = take("Q")
                pos += n
                return str(buf[pos - n:pos], "utf-8")
            if vtype == T.ARRAY:
                item, n = take("IQ")
                return list(take(f"{n}{scalar[item]}")) if item in scalar else [value(item) for _ in range(n)]
            return take(scalar[vtype])[0]

        meta = {}
        for _ in range(n_kv):
            key = value(T.STRING)
            meta[key] = value(take("I")[0])
        return meta


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # an AddedToken saved as a dict


def _byte_level_bpe(tokens: list[str], merges: list[str] | None, pre: str | None) -> Backend:
    """transformers' ``byte_level_tokenizer`` + ``set_split_regex``: GPT-2's BPE over the byte
    alphabet, with the vocabulary respelled into it where the file wrote raw text."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {t if set(t) <= alphabet else "".join(p for p, _ in to_bytes.pre_tokenize_str(t)): i
             for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=_merge_pairs(merges, tokens, None), dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores: list[float] | None) -> Backend:
    """transformers' ``sentencepiece_tokenizer`` (its ``LlamaTokenizer`` with ``legacy=False``):
    BPE with byte fallback, ``▁`` for spaces, a prefix space at the start of the text only."""
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=_merge_pairs(merges, tokens, scores),
                                 fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    return backend


def _merge_pairs(merges: list[str] | None, tokens: list[str], scores: list[float] | None) -> list[tuple]:
    """The file's merges, or (sentencepiece files have none) the ones its scores imply: every split
    of a token into two tokens, best-scored token first. transformers' ``get_merges`` and
    ``generate_merges``; ``tokenizers`` has no public equivalent."""
    if merges is not None:
        return [tuple(m.split(" ")) for m in merges]
    if scores is None:
        raise ValueError("the file has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        pairs.extend(sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]])))
    pairs.sort(key=lambda s: (s[2], len(s[0]), len(s[1])), reverse=True)
    return [(left, right) for left, right, _ in pairs]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body: transformers uses the tag to
    find assistant tokens for training masks; a template using it must still parse here."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which would change the prompt the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache
def _compile_chat_template(template: str) -> jinja2.Template:
    """The environment of transformers' ``_cached_compile_jinja_template``: sandboxed (templates
    come with model files), trim/lstrip blocks, loop controls, and its globals and filter."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# Sentencepiece vocabularies transformers builds differently by architecture (Gemma respells
# spaces and orders merges by position, Phi-3 prepends with a normalizer); none is served here.
_OTHER_SENTENCEPIECE_ARCHS = {"gemma", "gemma2", "gemma3", "phi3"}

# The split regexes of transformers' GGUF_PRE_TOKENIZER_SPLITS, by ``tokenizer.ggml.pre``; any other
# value keeps GPT-2's (ByteLevel's own).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
