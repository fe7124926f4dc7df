"""The shape of a model, the contract between the loader, which reads it from a Hugging Face
``config.json`` or GGUF metadata (worker/engine/loader.py), and the model code that builds the layers
from it (worker/models/). Here, below both, so that neither imports the other for it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2).

    Sizes are counts (tokens, features, heads, layers); ``rope_theta`` is RoPE's base, ``rope_scaling``
    the ``config.json`` section of that name (Llama 3's ``llama3`` type), ``qkv_bias`` Qwen2's biases on
    the Q, K and V projections."""
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
