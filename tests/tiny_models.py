"""Tiny random Llama and Qwen2 checkpoints built offline with transformers, plus a byte-level BPE
tokenizer trained on a few sentences, saved as real Hugging Face directories (config.json,
model.safetensors, tokenizer.json) so the engine loads them through its normal path."""
from __future__ import annotations

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
