"""Tiny random Llama and Qwen2 checkpoints built offline with transformers, plus a byte-level BPE
tokenizer trained on a few sentences, saved as real Hugging Face directories (config.json,
model.safetensors, tokenizer.json) so the engine loads them through its normal path."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Prefill computes the prompt, decode generates one token at a time.",
    "héllo wörld, 世界, emoji 😀 and other multi-byte characters.",
] * 20


def build_tokenizer(path: Path, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(str(path))
    return fast


def build_model(path: Path, arch: str = "llama", seed: int = 0, rope_scaling: dict | None = None,
                num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                tie: bool = False) -> Path:
    """Save a random ``arch`` (``llama`` | ``qwen2``) model with its tokenizer under ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # larger weights than the default init make logits (and near-ties) realistic
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def build_sentencepiece_gguf(path: Path, tokenizer_model: str = "llama") -> Path:
    """Save a metadata-only GGUF whose tokenizer is llama.cpp's ``llama`` kind (sentencepiece-style
    BPE: ``▁`` for spaces, ``<0xNN>`` byte fallback, merges implied by the scores), trained on
    CORPUS, with control tokens, a user-defined token and a chat template that writes its own BOS.
    ``tokenizer_model`` names another kind, to test that one is refused."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300))
    vocab = tok.get_vocab()
    chars = sorted((t for t in vocab if len(t) == 1), key=vocab.get)
    pieces = sorted((t for t in vocab if len(t) > 1), key=vocab.get)   # in the order they were merged
    special = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)]
    tokens = ([t for t, _ in special] + [f"<0x{b:02X}>" for b in range(256)] + chars + pieces)
    types = [k for _, k in special] + [6] * 256 + [1] * (len(chars) + len(pieces))
    scores = [0.0] * (len(special) + 256) + [-1e4 - i for i in range(len(chars))] + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    w.add_unk_token_id(0)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_freqs(rope_scaling: dict, head_dim: int, theta: float):
    """The ``rope_freqs`` tensor llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel
    .generate_extra_tensors``) writes for a ``llama3`` rope_scaling: one divisor per frequency."""
    import math

    import numpy as np
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = rope_scaling.get("factor", 8.0)
    low, high = rope_scaling.get("low_freq_factor", 1.0), rope_scaling.get("high_freq_factor", 4.0)
    old = rope_scaling.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_to_gguf(hf_dir: Path, out: Path, rope_freqs: bool = True) -> Path:
    """Convert a tiny Llama HF directory (from :func:`build_model`) to an F32 GGUF the way llama.cpp's
    converter does: Q/K rows permuted to llama.cpp's interleaved RoPE layout, the byte-level BPE
    tokenizer as ``gpt2`` metadata, and, for a ``llama3`` rope_scaling, the ``rope_freqs`` tensor
    (left out with ``rope_freqs=False``: a converter that drops it, i.e. the wrong RoPE)."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tj.get("added_tokens", [])}
    tokens = [added.get(i, t) for t, i in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])

    def permute(x, n):   # convert_hf_to_gguf.py LlamaModel.permute
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}   # transformers 5: rope_parameters
    if rope_freqs and scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(scaling, head_dim, theta))
    for name, t in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        t = t.astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                t = permute(t, heads)
            elif module == "self_attn.k_proj":
                t = permute(t, kv_heads)
        w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_random_llama(path: Path, layers: int = 8, hidden: int = 2048, inter: int = 5632, heads: int = 16,
                       kv_heads: int = 4, vocab: int = 32000, dtype=torch.bfloat16, seed: int = 0,
                       tie: bool = False) -> int:
    """A Llama-style HF directory with random ``dtype`` weights (one safetensors file) and the tiny
    tokenizer; returns the weights' bytes. The defaults,
    8 x 2048 with a 32000 vocabulary, are ~0.49B parameters, ~1 GB in bf16; Llama-3.2-1B's shape is
    ``layers=16, inter=8192, heads=32, kv_heads=8, vocab=128256, tie=True``."""
    from safetensors.torch import save_file
    from tiny_models import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    hd = hidden // heads
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tie:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
    tensors = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.float32)
        if len(shape) == 1:
            t.normal_(1.0, 0.05, generator=g)
        else:
            t.normal_(0.0, 1.0 / hidden ** 0.5, generator=g)
        tensors[name] = t.to(dtype)
        del t
    save_file(tensors, str(path / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    del tensors
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": tie,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch.")}))
    return nbytes
