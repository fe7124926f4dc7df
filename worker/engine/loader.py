"""Load a Llama-family model and its tokenizer from a Hugging Face directory, a GGUF file, or a file
inside an installed Python package.

GGUF files are read with the ``gguf`` package and dequantized on load; their Q/K projections are
un-permuted from llama.cpp's interleaved RoPE layout back to Hugging Face's rotate-half layout (the
inverse of llama.cpp's ``convert_hf_to_gguf.py`` permute). The tokenizer is the router's, from
:mod:`tandem.worker.api.tokenizer`, so both tokenize identically. Nothing is fetched from a hub.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# Re-exported for existing callers; they live in the torch-free api package so the router can use them.
from tandem.worker.api.source import ModelLoadError, resolve_source  # noqa: F401
from tandem.worker.api.tokenizer import Tokenizer, chat_token_ids, load_tokenizer  # noqa: F401

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2)."""
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None


@dataclass
class LoadedModel:
    """What :func:`load_model` returns: config, HF-named weights (float32, CPU), tokenizer, file."""
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path


def load_model(source: str) -> LoadedModel:
    """Load config, weights and tokenizer from ``source`` (see :func:`resolve_source`).

    Raises ModelLoadError, naming the file, for a missing or corrupt file or an unsupported
    architecture.
    """
    path = resolve_source(source)
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _load_gguf(path)
        if path.is_dir():
            return _load_hf_dir(path)
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


def _load_hf_dir(path: Path) -> LoadedModel:
    from safetensors import safe_open

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
    weights = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    weights[k] = fh.get_tensor(k).float()
        except Exception as e:
            raise ModelLoadError(f"{f}: corrupt safetensors file: {e}") from e
    tokenizer = load_tokenizer(str(path))
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
    return LoadedModel(config, weights, tokenizer, path)


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


def _load_gguf(path: Path) -> LoadedModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
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
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = _gguf_name(t.name)
        if hf is None:
            log.warning("%s: ignoring tensor %s", path, t.name)
            continue
        arr = dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(
            tuple(int(x) for x in reversed(t.shape)))
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        weights[hf] = w
    tokenizer = load_tokenizer(str(path))
    config = ModelConfig(
        arch=arch, vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=hidden,
        intermediate_size=int(field(f"{a}.feed_forward_length")),
        num_layers=int(field(f"{a}.block_count")), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(field(f"{a}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field(f"{a}.context_length", 4096)),
        tie_word_embeddings="lm_head.weight" not in weights, qkv_bias=arch == "qwen2",
        eos_token_ids=_eos_ids(tokenizer, field("tokenizer.ggml.eos_token_id")),
        bos_token_id=field("tokenizer.ggml.bos_token_id"))
    return LoadedModel(config, weights, tokenizer, path)
