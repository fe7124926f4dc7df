"""Token counts for streams that carried no ``usage``, from the model's tokenizer.

Some OpenAI-compatible servers (llama-cpp-python's) ignore ``stream_options.include_usage``. As
``vllm bench serve`` does for them (``benchmarks/serve.py``, ``calculate_metrics``: the output text
re-encoded with ``add_special_tokens=False``), the load generator then counts after the run:

- output tokens: the streamed text, encoded without special tokens. Detokenized text can re-encode
  to a slightly different length than the server generated (pieces merge across chunk boundaries);
  ``completion_tokens_mismatch`` in the summary shows how often.
- prompt tokens: a chat request's messages under the model's chat template with the generation
  prompt (what the server prefills); a text prompt encoded as the model adds special tokens (BOS
  where the model asks for it); a token-id prompt is its length.

The tokenizer is the torch-free one of ``tandem.worker.api.tokenizer`` (a ``.gguf`` file, a Hugging
Face directory or ``package:PKG/FILE``): the ``--tokenizer`` given, or else the served model's when
the server is tandem's (its ``/v1/models`` names the source as ``root``, vLLM's field). Without
either, a stream without usage stays an error of kind ``no_usage``: a count from some other model's
tokenizer would be a wrong number that looks right.
"""
from __future__ import annotations

import functools

from tandem.worker.bench.client import RequestRecord


@functools.lru_cache(maxsize=4)
def _tokenizer(source: str):
    from tandem.worker.api.tokenizer import load_tokenizer
    return load_tokenizer(source)


def served_tokenizer(models: dict | None) -> str | None:
    """The tokenizer source a tandem server names in its ``/v1/models`` answer (``root`` of an entry
    ``owned_by: tandem``), else None: another server's ``root`` (vLLM's is a hub name) may not load here."""
    for m in (models or {}).get("data") or []:
        if isinstance(m, dict) and m.get("owned_by") == "tandem" and m.get("root"):
            return str(m["root"])
    return None


def prompt_count(tok, sent) -> int:
    """Tokens of what a request sent: chat ``messages`` (list of dicts), a text prompt, or token ids."""
    from tandem.worker.api.tokenizer import chat_token_ids
    if isinstance(sent, list) and sent and isinstance(sent[0], dict):
        return len(chat_token_ids(tok, sent))
    if isinstance(sent, list):
        return len(sent)
    return len(tok.encode(sent or ""))


def count_without_usage(records: list[RequestRecord], source: str | None) -> int:
    """Fill ``prompt_tokens``/``completion_tokens`` of the successful records that carried no usage,
    counted with ``source``'s tokenizer (``token_source = "tokenizer"``); with no source, or one that
    fails to load, those records become errors of kind ``no_usage``. Returns how many were counted."""
    todo = [r for r in records if r.ok and r.token_source is None]
    if not todo:
        return 0
    why = "the stream carried no usage (stream_options.include_usage); pass --tokenizer to count tokens"
    tok = None
    if source:
        try:
            tok = _tokenizer(source)
        except Exception as e:   # ModelLoadError and the like: say which source failed, keep the runs
            why = f"the stream carried no usage and the tokenizer {source!r} did not load: {e}"
    for r in todo:
        if tok is None:
            r.fail("no_usage", why)
            continue
        r.completion_tokens = len(tok.encode(r.text, add_special_tokens=False))
        r.prompt_tokens = prompt_count(tok, r.prompt_sent)
        r.token_source, r.prompt_sent = "tokenizer", None
    return 0 if tok is None else len(todo)
