"""The engine: requests in, tokens out, one ``step()`` at a time.

It ties the scheduler (what to compute), the model runner (computing it), the sampler and the
detokenizer together, and keeps the counters the server exports. It is single-threaded by design;
:mod:`tandem.worker.engine.async_engine` runs it on a thread of its own for the HTTP server.

Disaggregated serving adds three calls: a decode worker reserves blocks for a prompt whose KV will
arrive from a prefill worker (:meth:`LLMEngine.add_remote_request`), writes it
(:meth:`LLMEngine.write_kv`), and then either completes the prefill with the first token the prefill
worker sampled (:meth:`LLMEngine.complete_remote`) or falls back to computing it locally
(:meth:`LLMEngine.fallback_local`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem.worker.api.block_hash import fingerprint
from tandem.worker.api.sampling import FAULT_FIELD, faults_enabled
from tandem.worker.engine.block_manager import BlockManager
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.detokenizer import IncrementalDetokenizer
from tandem.worker.api.tokenizer import chat_token_ids
from tandem.worker.engine.loader import LoadedModel, load_model
from tandem.worker.engine.model_identity import digest_of_weights
from tandem.worker.engine.model_runner import ModelRunner, device_memory
from tandem.worker.engine.sampler import SampleResult, sample
from tandem.worker.engine.scheduler import Scheduler
from tandem.worker.engine.sequence import InvalidRequestError, SamplingParams, Sequence, SeqStatus

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request.

    ``new_token_ids``/``new_text`` are the delta since the last output; ``text`` is everything so far.
    ``logprobs`` holds one :class:`SampleResult` per new token when logprobs were asked for.
    """
    request_id: str
    new_token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[SampleResult] = field(default_factory=list)
    queue_time: float | None = None     # seconds from arrival to first scheduling
    prefill_time: float | None = None   # seconds from first scheduling to the first token
    error: str | None = None            # why the request failed (``finish_reason`` "error")


@dataclass
class EngineStats:
    """Counters since start (monotonic) and gauges (current)."""
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    num_steps: int = 0
    num_prefill_steps: int = 0
    local_prefill_fallbacks: int = 0
    #: aborted requests by the state they were in: queued, awaiting_kv, receiving_kv, running
    aborts: dict[str, int] = field(default_factory=dict)
    #: requests failed by an error in their own scheduling, model step, sampling or detokenizing
    request_errors: int = 0


#: model steps in a row that may fail (failing their batch) before the engine itself is declared broken
MAX_FAILED_STEPS = 3


class LLMEngine:
    """A paged-KV inference engine for one model.

    Args:
        config: engine settings.
        loaded: an already loaded model (else ``config.model`` is loaded, in the serving dtype,
            straight onto the device).
        progress: ``progress(phase, done, total)`` through startup: reading (bytes), converting
            (layers), profiling, capturing (see :mod:`tandem.worker.server.startup`).

    Raises:
        ModelLoadError: the model cannot be loaded.
        ValueError: a bad setting (dtype, backend); MemoryPlanError (a ValueError) when the model,
            its activations and the KV cache do not fit.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, progress=None):
        torch.manual_seed(config.seed)
        # the serving dtype is decided once, before anything is loaded or fingerprinted
        config = dataclasses.replace(config, dtype=config.resolved_dtype())
        self.config = config
        progress = progress or (lambda phase, done, total: None)
        device = config.resolved_device()
        memory_before = device_memory(device) if loaded is None else None
        owns = loaded is None
        if loaded is None:
            t0 = time.monotonic()
            loaded = load_model(config.model, config.torch_dtype(), device, progress)
            log.info("loaded %s: %.2f GiB of weights as %s on %s in %.1f s", loaded.path,
                     loaded.weight_bytes() / 2**30, config.dtype, device, time.monotonic() - t0)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.model_name or loaded.path.name
        limit = loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        # the model's identity is its content (model_identity), never its path
        self.content_digest = loaded.digest or digest_of_weights(loaded.config, loaded.weights)
        self.fingerprint = fingerprint(content=self.content_digest, dtype=config.dtype,
                                       quantization=config.quantization)
        log.info("model fingerprint %s (content %s, %s, quantization %s)", self.fingerprint.hex(),
                 self.content_digest, config.dtype, config.quantization)
        self.runner = ModelRunner(config, loaded, self.max_model_len, memory_before=memory_before,
                                  owns_weights=owns, progress=progress)
        capacity = self.runner.num_blocks * config.block_size
        if capacity < self.max_model_len:
            # A longer sequence could never hold all its blocks at once: cap the context by the cache,
            # so the limit a client is told, and a missing max_tokens, do not depend on load.
            log.warning("maxModelLen %d capped to %d tokens: the KV cache holds %d blocks of %d tokens",
                        self.max_model_len, capacity, self.runner.num_blocks, config.block_size)
            self.max_model_len = capacity
        log.info("max_model_len %d tokens (KV cache capacity %d tokens)", self.max_model_len, capacity)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.fingerprint)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.eos_ids = set(loaded.config.eos_token_ids)
        self.failed_steps = 0   # model steps failed in a row (see MAX_FAILED_STEPS)

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        """Apply the model's chat template (with the generation prompt) and tokenize."""
        return chat_token_ids(self.tokenizer, messages)

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`InvalidRequestError` for a prompt the engine cannot serve."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        if n + params.max_tokens > self.max_model_len:
            if n >= self.max_model_len:
                raise InvalidRequestError("prompt", f"this model's maximum context length is "
                                          f"{self.max_model_len} tokens; the prompt has {n} tokens")
            raise InvalidRequestError("max_tokens", f"this model's maximum context length is "
                                      f"{self.max_model_len} tokens; you requested {n + params.max_tokens}"
                                      f" ({n} in the prompt, {params.max_tokens} for the completion)")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequestError("logit_bias", f"token id {bad[0]} is not in this model's vocabulary "
                                      f"[0, {vocab})")

    def _new_seq(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 params) -> Sequence:
        if request_id in self.seqs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        params = SamplingParams.parse(params)
        if prompt_token_ids is None:
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        self.seqs[request_id] = seq
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        self.stats.prompt_tokens += len(prompt_token_ids)
        return seq

    def add_request(self, request_id: str, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | dict | None = None, *, keep_logits: bool = False,
                    kv_sink: Callable | None = None, stop_after_first_token: bool = False) -> Sequence:
        """Queue a request. Exactly one of ``prompt`` (text) and ``prompt_token_ids`` is used.

        ``kv_sink(seq, first_block_index, data)`` (prefill role) receives each run of completed KV
        blocks as a CPU tensor ``[layers, 2, n, block_size, Hk, D]`` right after the step that
        computed it; ``stop_after_first_token`` finishes the request once the first token is sampled.

        Raises:
            InvalidRequestError: empty or over-long prompt, bad sampling values (names the field).
        """
        seq = self._new_seq(request_id, prompt, prompt_token_ids, params)
        seq.keep_logits, seq.kv_sink, seq.stop_after_first_token = keep_logits, kv_sink, stop_after_first_token
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (a no-op for an unknown id)."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            state = {SeqStatus.WAITING: "queued", SeqStatus.RUNNING: "running",
                     SeqStatus.WAITING_REMOTE: "receiving_kv" if seq.kv_received else "awaiting_kv"
                     }.get(seq.status, seq.status.value)
            self.stats.aborts[state] = self.stats.aborts.get(state, 0) + 1
            self._finish(seq, "abort")
            self._forget(seq)

    # ---- disaggregated prefill, decode side -------------------------------------------------
    def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams | dict | None) -> Sequence | None:
        """Reserve blocks for a prompt whose KV a prefill worker will send.

        Returns the sequence (status WAITING_REMOTE, ``block_table`` covering the prompt), or None
        when there are not enough free blocks (the caller then prefills locally).
        Raises InvalidRequestError as :meth:`add_request`.
        """
        seq = self._new_seq(request_id, None, prompt_token_ids, params)
        if not self.block_manager.allocate_all(seq):
            self._forget(seq)
            self.stats.prompt_tokens -= len(prompt_token_ids)
            self.stats.local_prefill_fallbacks += 1
            return None
        seq.status = SeqStatus.WAITING_REMOTE
        self.scheduler.remote[request_id] = seq
        return seq

    def write_kv(self, request_id: str, first_block_index: int, data: torch.Tensor) -> None:
        """Write received KV blocks ``[layers, 2, n, block_size, Hk, D]`` at the request's block
        indices ``first_block_index ..``. Raises KeyError for a request not waiting for KV."""
        seq = self.scheduler.remote[request_id]
        seq.kv_received = True
        n = data.shape[2]
        self.runner.write_blocks(seq.block_table[first_block_index:first_block_index + n], data)

    def complete_remote(self, request_id: str, first_token_id: int,
                        logprob: SampleResult | None = None) -> RequestOutput:
        """The prefill worker finished: the prompt's KV is in place and ``first_token_id`` was sampled.
        The request joins the running batch for decode. Returns the first token's output."""
        seq = self.scheduler.remote.pop(request_id)
        seq.num_computed_tokens = len(seq.prompt_token_ids)
        seq.num_cached_tokens = 0
        self.block_manager.register_computed(seq)
        self.scheduler.add_prefilled(seq)
        seq.first_scheduled_time = seq.first_scheduled_time or time.monotonic()
        out = self._append_token(seq, logprob or SampleResult(first_token_id))
        if out.finished:
            self._forget(seq)
        return out

    def fallback_local(self, request_id: str) -> None:
        """Give up on the remote prefill: free the reserved blocks and prefill locally."""
        seq = self.scheduler.remote.pop(request_id, None)
        if seq is None:
            return
        self.block_manager.free_seq(seq)
        seq.num_computed_tokens = 0
        self.stats.local_prefill_fallbacks += 1
        self.scheduler.add(seq)

    # ---- stepping -----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return every request's new output.

        An error that belongs to one request (its sampling, detokenizing or KV hand-off) fails that
        request alone (an output with ``finish_reason`` "error"); an error in the model step fails the
        step's batch, and :data:`MAX_FAILED_STEPS` failed steps in a row raise: the model or the KV
        cache is broken, and the engine must stop. An error while scheduling raises at once (the
        scheduler's and block manager's state is shared by every request)."""
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        self.stats.num_steps += 1
        if batch.prefills or any(s.in_prefill for s, _ in batch.decodes):
            self.stats.num_prefill_steps += 1
        now = time.monotonic()
        for seq, n in batch.items:
            seq.first_scheduled_time = seq.first_scheduled_time or now
            in_prompt = max(0, min(seq.num_computed_tokens + n, len(seq.prompt_token_ids))
                            - seq.num_computed_tokens)
            self.stats.prompt_tokens_computed += in_prompt
        try:
            sample_seqs, logits = self.runner.execute(batch)
        except Exception as e:
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise RuntimeError(f"{self.failed_steps} model steps failed in a row; the last: {e!r}") from e
            log.exception("model step failed; failing its %d requests", len(batch.items))
            return [self.fail(seq.request_id, f"the model step failed: {e!r}") for seq, _ in batch.items]
        self.failed_steps = 0
        for seq, n in batch.items:
            seq.num_computed_tokens += n
            self.block_manager.register_computed(seq)
        outputs = []
        for seq, res in zip(sample_seqs, self._sample(logits, sample_seqs)):
            try:
                if isinstance(res, Exception):
                    raise res
                if faults_enabled() and (seq.params.model_extra or {}).get(FAULT_FIELD) == "sample":
                    raise RuntimeError("injected sampling fault (tandem_fault: sample)")
                outputs.append(self._append_token(seq, res))
            except Exception as e:
                log.exception("request %s failed while sampling", seq.request_id)
                outputs.append(self.fail(seq.request_id, f"sampling failed: {e!r}"))
        for seq, _ in batch.items:
            if seq.kv_sink is not None and seq.status != SeqStatus.FINISHED:  # finished ones sent theirs
                try:
                    self._send_kv(seq)
                except Exception as e:
                    log.exception("request %s failed handing off its KV", seq.request_id)
                    outputs.append(self.fail(seq.request_id, f"KV hand-off failed: {e!r}"))
        for out in outputs:
            if out.finished:
                seq = self.seqs.get(out.request_id)
                if seq is not None:
                    self._forget(seq)
        return outputs

    def _sample(self, logits, seqs: list[Sequence]) -> list:
        """One :class:`SampleResult` per sequence, or the exception that sampling it raised: the batch
        is sampled at once, and only when that fails one by one, to find whose request it was."""
        if not seqs:
            return []
        try:
            return sample(logits, seqs)
        except Exception:
            out = []
            for i, seq in enumerate(seqs):
                try:
                    out.append(sample(logits[i:i + 1], [seq])[0])
                except Exception as e:
                    out.append(e)
            return out

    def fail(self, request_id: str, message: str) -> RequestOutput:
        """End a request with ``finish_reason`` "error" and free its blocks; returns its last output
        (``error`` says why). Counted in ``stats.request_errors``."""
        seq = self.seqs[request_id]
        self.scheduler.remote.pop(request_id, None)
        self.stats.request_errors += 1
        self._finish(seq, "error")
        self._forget(seq)
        return RequestOutput(request_id, [], "", seq.text, True, "error", len(seq.prompt_token_ids),
                             len(seq.output_token_ids), seq.num_cached_tokens, error=message)

    def _send_kv(self, seq: Sequence) -> None:
        bs = self.config.block_size
        done = seq.status == SeqStatus.FINISHED or seq.output_token_ids
        end = -(-seq.num_computed_tokens // bs) if done else seq.num_computed_tokens // bs
        end = min(end, -(-len(seq.prompt_token_ids) // bs))
        if end > seq.num_blocks_sent:
            seq.kv_sink(seq, seq.num_blocks_sent, self.runner.read_blocks(seq.block_table[seq.num_blocks_sent:end]))
            seq.num_blocks_sent = end

    def _append_token(self, seq: Sequence, res: SampleResult) -> RequestOutput:
        rid = seq.request_id
        seq.output_token_ids.append(res.token_id)
        seq.first_token_time = seq.first_token_time or time.monotonic()
        self.stats.generation_tokens += 1
        p = seq.params
        text = seq.text + seq.detokenizer.add(res.token_id)
        reason, cut = None, False
        if res.token_id in p.stop_token_ids or (not p.ignore_eos and res.token_id in self.eos_ids):
            reason = "stop"
        if p.stop:
            window = max(len(s) for s in p.stop)
            start = max(0, len(seq.text) - window)
            hits = [i for i in (text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                text, reason, cut = text[:min(hits)], "stop", True
        if reason is None and (len(seq.output_token_ids) >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None and seq.stop_after_first_token:
            reason = "prefill_done"
        if reason in ("stop", "length") and not cut:
            # the answer ends here: bytes held for a character the last tokens did not complete come
            # out as U+FFFD, so the text is always the tokens' bytes decoded
            text += seq.detokenizer.flush()
        seq.text = text
        # While a stop string may still be forming, hold back that many characters.
        hold = 0 if reason else max((len(s) - 1 for s in p.stop), default=0)
        upto = max(seq.num_emitted_chars, len(text) - hold)
        delta = text[seq.num_emitted_chars:upto]
        seq.num_emitted_chars = upto
        if reason:
            self._finish(seq, reason)
        out = RequestOutput(rid, [res.token_id], delta, text, reason is not None, reason,
                            len(seq.prompt_token_ids), len(seq.output_token_ids), seq.num_cached_tokens,
                            [res] if p.logprobs is not None else [])
        if len(seq.output_token_ids) == 1 and seq.first_scheduled_time is not None:
            out.queue_time = seq.first_scheduled_time - seq.arrival_time
            out.prefill_time = seq.first_token_time - seq.first_scheduled_time
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.kv_sink is not None and reason not in ("abort", "error"):
            seq.status = SeqStatus.FINISHED
            self._send_kv(seq)
        self.scheduler.finish(seq)

    def _forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)

    # ---- convenience --------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | dict | None = None,
                 **kwargs) -> list[RequestOutput]:
        """Run ``prompts`` (text or token ids) to completion; returns the final output of each."""
        ids = []
        for i, p in enumerate(prompts):
            rid = f"gen-{time.monotonic_ns()}-{i}"
            if isinstance(p, str):
                self.add_request(rid, prompt=p, params=params, **kwargs)
            else:
                self.add_request(rid, prompt_token_ids=p, params=params, **kwargs)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        toks: dict[str, list[int]] = {r: [] for r in ids}
        while any(r not in final for r in ids):
            for out in self.step():
                toks[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    final[out.request_id] = out
        for r in ids:
            final[r].new_token_ids = toks[r]   # the whole completion
        return [final[r] for r in ids]

    def kv_layout(self) -> dict:
        """What a KV transfer peer must match exactly: model fingerprint and cache layout."""
        c = self.model_config
        return {"model": self.fingerprint.hex(), "dtype": self.config.dtype, "block_size": self.config.block_size,
                "num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}

    def kv_usage(self) -> float:
        """``tandem:kv_cache_usage_perc``: blocks held by requests / all blocks (0..1)."""
        return self.block_manager.usage()
