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
