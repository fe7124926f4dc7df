"""Load a Llama-family model and its tokenizer from a Hugging Face directory, a GGUF file, or a file
inside an installed Python package.

Every weight goes straight into the serving dtype and onto its device, one tensor at a time, so host
memory stays near the weights already placed plus one tensor (near one tensor when the device is a
GPU): safetensors through :mod:`tandem.worker.engine.safetensors_io`, GGUF dequantized tensor by
tensor with the ``gguf`` package. GGUF Q/K projections are un-permuted from llama.cpp's interleaved
RoPE layout back to Hugging Face's rotate-half layout (the inverse of llama.cpp's
``convert_hf_to_gguf.py`` permute), and a GGUF's ``rope_freqs`` tensor (Llama 3.1+) becomes the
model's RoPE frequency factors. While reading, the loader computes the model's content digest
(:mod:`tandem.worker.engine.model_identity`). The tokenizer is the router's, from
:mod:`tandem.worker.api.tokenizer`, so both tokenize identically. Nothing is fetched from a hub.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# Re-exported for existing callers; they live in the torch-free api package so the router can use them.
from tandem.worker.api.model_config import ModelConfig
from tandem.worker.api.source import ModelLoadError, resolve_source  # noqa: F401
from tandem.worker.api.tokenizer import Tokenizer, chat_token_ids, load_tokenizer  # noqa: F401
from tandem.worker.engine.model_identity import ContentDigest
from tandem.worker.engine.safetensors_io import iter_tensors, stored_bytes

#: ``progress(phase, done, total)``: startup progress (phase ``reading``: bytes read of all)
Progress = Callable[[str, int, int], None]

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}


@dataclass
class LoadedModel:
    """What :func:`load_model` returns: config, HF-named weights (in the dtype and on the device they
    were loaded for), tokenizer, file, and the content digest (:mod:`.model_identity`; empty for a
    model built by hand, whose digest the engine then computes from the weights)."""
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path
    digest: str = ""

    def weight_bytes(self) -> int:
        """Bytes of the loaded weights."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())


def load_model(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               progress: Progress | None = None) -> LoadedModel:
    """Load config, weights and tokenizer from ``source`` (see :func:`resolve_source`).

    Each weight is read, converted to ``dtype`` and moved to ``device`` before the next is read.
    ``progress("reading", bytes done, bytes total)`` is called after each tensor.

    Raises ModelLoadError, naming the file, for a missing or corrupt file or an unsupported
    architecture.
    """
    path = resolve_source(source)
    progress = progress or (lambda phase, done, total: None)
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _load_gguf(path, dtype, device, progress)
        if path.is_dir():
            return _load_hf_dir(path, dtype, device, progress)
    except ModelLoadError:
        raise
    except Exception as e:  # a library's parse error becomes one clear message with the file name
        raise ModelLoadError(f"{path}: cannot load model: {type(e).__name__}: {e}") from e
    raise ModelLoadError(f"{path}: not a .gguf file or a Hugging Face model directory")


def _eos_ids(tokenizer, extra) -> list[int]:
    ids = set(i for i in (extra if isinstance(extra, list) else [extra]) if i is not None)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _rope_scaling(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    return float(theta), (scaling if kind not in (None, "default") else None)


#: the files of a Hugging Face directory that define its tokenizer (part of the content digest)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model")


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str, progress: Progress) -> LoadedModel:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{cfg_file}: missing (a Hugging Face model directory needs config.json)")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise ModelLoadError(f"{cfg_file}: unsupported architecture {archs} "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    digest = ContentDigest()
    weights = {}
    total, done = stored_bytes(files), 0
    # a tensor that will be converted or moved is read into a reused staging buffer; one kept as it
    # is stored (same dtype, on the CPU) gets a buffer of its own
    staged = (lambda stored: stored.is_floating_point and stored != dtype) if str(device) == "cpu" \
        else (lambda stored: True)
    for k, t in iter_tensors(files, on_bytes=lambda n, dt, shape, raw: digest.add_tensor(n, dt, shape, raw),
                             staged=staged):
        done += t.numel() * t.element_size()
        weights[k] = _place(t, dtype, device)
        del t
        progress("reading", done, total)
    tokenizer = load_tokenizer(str(path))
    for name in TOKENIZER_FILES:
        if (path / name).exists():
            digest.add_part(f"tokenizer/{name}", (path / name).read_bytes())
    theta, scaling = _rope_scaling(cfg)
    heads = cfg["num_attention_heads"]
    config = ModelConfig(
        arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in weights,
        qkv_bias=arch == "qwen2" or cfg.get("attention_bias", False),
        eos_token_ids=_eos_ids(tokenizer, cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"))
    digest.add_part("config", config)
    return LoadedModel(config, weights, tokenizer, path, digest.hexdigest())


def _place(t: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``t`` in the serving ``dtype`` on ``device``; floating-point tensors only are converted. On a
    GPU the copy goes first and the conversion runs there (the host never holds a converted copy)."""
    if not t.is_floating_point():
        return t.to(device)
    if str(device) == "cpu":
        return t.to(dtype)
    return t.to(device).to(dtype)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permute: ``[n_head, 2, d/2]`` rows back to ``[n_head, d/2, 2]`` order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_reader(path: Path):
    """gguf's ``GGUFReader`` of ``path``, slicing a plain ndarray view of its memory map.

    The reader slices its ``np.memmap`` once per metadata value and its tensors' data are memmap
    slices too; numpy runs the memmap subclass's Python ``__array_finalize__`` on every slice (and on
    every row group that ``gguf.quants.dequantize`` cuts). For SmolLM2's ~100k tokenizer strings and
    Q4_1 tensors that was half the load time (cProfile: 21 of 38 s in the reader, 10 in memmap's hooks,
    on a loaded 2-core machine). The view shares the map's memory, so nothing is copied. Raises what
    ``GGUFReader`` raises for a corrupt file."""
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if not hasattr(self, "_plain"):
                self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + int(np.dtype(dtype).itemsize) * count
            arr = self._plain[offset:end].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainViewReader(str(path))


def _load_gguf(path: Path, dtype: torch.dtype, device: str, progress: Progress) -> LoadedModel:
    from gguf.quants import dequantize

    try:
        reader = _gguf_reader(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file: {e}") from e

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    gguf_arch = field("general.architecture")
    arch = GGUF_ARCHS.get(gguf_arch)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {gguf_arch!r} "
                             f"(supported: {', '.join(GGUF_ARCHS)})")
    a = gguf_arch
    heads = int(field(f"{a}.attention.head_count"))
    kv_heads = int(field(f"{a}.attention.head_count_kv", heads))
    hidden = int(field(f"{a}.embedding_length"))
    digest = ContentDigest()
    weights: dict[str, torch.Tensor] = {}
    rope_freqs = None
    total, done = sum(int(t.n_bytes) for t in reader.tensors), 0
    for t in reader.tensors:
        done += int(t.n_bytes)
        shape = tuple(int(x) for x in reversed(t.shape))
        digest.add_tensor(t.name, t.tensor_type.name, shape, np.ascontiguousarray(t.data).reshape(-1).view(np.uint8).data)
        if t.name == "rope_freqs.weight":   # Llama 3.1+: per-frequency divisors of the RoPE angles
            rope_freqs = [float(x) for x in np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)]
            continue
        hf = _gguf_name(t.name)
        if hf is None:
            log.warning("%s: ignoring tensor %s", path, t.name)
            continue
        # one tensor at a time: dequantized to float32 on the host, then converted and placed
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not arr.flags.writeable:   # an unquantized tensor comes back as the file's read-only map
            arr = arr.copy()
        w = torch.from_numpy(arr).reshape(shape)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        weights[hf] = _place(w.contiguous() if w.dtype == dtype else w, dtype, device)
        del w
        progress("reading", done, total)
    tokenizer = load_tokenizer(str(path))
    # the tokenizer's metadata as stored (raw key/value parts: decoding 100k strings costs seconds)
    digest.add_part("tokenizer", b"".join(np.asarray(part).tobytes() for k in sorted(reader.fields)
                                          if k.startswith("tokenizer.") for part in reader.fields[k].parts))
    rope_scaling = _gguf_rope_scaling(field, a, rope_freqs, path)
    config = ModelConfig(
        arch=arch, vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=hidden,
        intermediate_size=int(field(f"{a}.feed_forward_length")),
        num_layers=int(field(f"{a}.block_count")), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(field(f"{a}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(f"{a}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(field(f"{a}.context_length", 4096)),
        tie_word_embeddings="lm_head.weight" not in weights, qkv_bias=arch == "qwen2",
        eos_token_ids=_eos_ids(tokenizer, field("tokenizer.ggml.eos_token_id")),
        bos_token_id=field("tokenizer.ggml.bos_token_id"))
    digest.add_part("config", config)
    return LoadedModel(config, weights, tokenizer, path, digest.hexdigest())


def _gguf_rope_scaling(field, arch: str, rope_freqs: list[float] | None, path: Path) -> dict | None:
    """The RoPE scaling of a GGUF, as a ``rope_scaling`` dict for
    :func:`tandem.kernels.rope.build_cos_sin_cache`.

    llama.cpp's converter writes a Llama 3.1+ model's ``llama3`` scaling as the ``rope_freqs`` tensor:
    one divisor per frequency, which llama.cpp applies to the angles as they are (``freq_factors``).
    Older scalings are metadata: ``{arch}.rope.scaling.type`` ``linear`` with ``.factor``. Raises
    ModelLoadError for a scaling type this engine does not implement (rather than run with a wrong one).
    """
    kind = field(f"{arch}.rope.scaling.type")
    if rope_freqs is not None:
        return {"rope_type": "freq_factors", "factors": rope_freqs}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor", 1.0))}
    raise ModelLoadError(f"{path}: unsupported GGUF rope scaling {kind!r} (supported: rope_freqs, linear)")
