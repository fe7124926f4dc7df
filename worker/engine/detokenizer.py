"""Incremental detokenization that never emits half a UTF-8 character.

The offsets method of Hugging Face's text-generation-inference and vLLM: decode a short window of
recent tokens twice, with and without the newest, and emit the difference only when it does not end
in U+FFFD (an incomplete byte sequence).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        prompt_ids: the prompt's ids; a few of its last tokens seed the window, so a leading space
            or a merged character decodes as it would in context.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """The text of tokens held back because they end inside a character: at the end of an answer,
        with U+FFFD for the incomplete bytes (as ``decode`` of the whole output gives them)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
