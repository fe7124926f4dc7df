"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over a paged KV cache.

Architecture as in Touvron et al., "LLaMA" (2023) and Hugging Face's ``modeling_llama``; Qwen2 adds
a bias to the Q/K/V projections. Q/K/V and gate/up are fused into single matmuls, and every op goes
through :class:`tandem.kernels.ops.Ops`, so one model serves the torch, Triton and flash-attn paths.

With ``quantization="fp8"`` the four projections of every layer (qkv, o, gate_up, down) hold e4m3
weights with per-output-channel scales and run through ``ops.fp8_linear`` (activations quantized
per token; see :mod:`tandem.kernels.fp8`); embeddings, norms and the LM head stay in ``dtype``.
With ``quantization="int8"`` (CPUs) the same four projections hold int8 weights with per-output-channel
scales and run weight-only (:mod:`tandem.kernels.int8`); the rest stays in ``dtype`` likewise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tandem.kernels.fp8 import quantize_weight_fp8
from tandem.kernels.int8 import int8_linear, quantize_weight_int8
from tandem.kernels.ops import Ops
from tandem.kernels.rope import build_cos_sin_cache
from tandem.worker.api.model_config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where each token of a step reads and writes the paged KV cache.

    Tokens are ordered decodes first (one query per sequence), then prefill chunks.

    Attributes:
        slot_mapping: ``[T]`` int64, the cache slot of each token (``block * block_size + offset``).
        num_decode_tokens: how many leading tokens are single-token decodes.
        decode_block_tables: ``[Bd, max_blocks]`` int32; decode_seq_lens ``[Bd]`` int32.
        prefill_block_tables: ``[Bp, max_blocks]`` int32; prefill_cu_seqlens_q ``[Bp + 1]`` int32;
            prefill_seq_lens ``[Bp]`` int32 (cached prefix + chunk).
    """
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None


class LlamaModel:
    """Weights plus the forward pass; no autograd, no nn.Module bookkeeping on the hot path."""

    LINEARS = ("qkv", "o", "gate_up", "down")

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops,
                 dtype: torch.dtype, device: str, max_position: int, quantization: str = "none",
                 progress: Callable[[str, int, int], None] | None = None):
        """Build the serving layout from HF-named ``weights``, which are *consumed*: each entry is
        popped as it is placed, so the loaded and the fused copies of a layer never both stay alive
        (pass a copy of the dict to keep yours). ``progress("converting", layers done, layers)``.
        Raises ValueError for an unknown quantization (or int8 off the CPU), KeyError for a missing
        weight."""
        if quantization not in ("none", "fp8", "int8"):
            raise ValueError(f"quantization must be none, fp8 or int8, got {quantization!r}")
        if quantization == "int8" and not str(device).startswith("cpu"):
            raise ValueError("quantization int8 is weight-only for CPUs; on GPUs use fp8")
        self.config, self.ops, self.dtype, self.device = config, ops, dtype, device
        self.fp8 = quantization == "fp8"
        self.int8 = quantization == "int8"
        c = config
        progress = progress or (lambda phase, done, total: None)

        def w(name):
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        def fused(names):
            # placed one part at a time, then joined on the device: one layer's parts at most are
            # alive twice
            parts = [weights.pop(n).to(device=device, dtype=dtype) for n in names]
            out = torch.cat(parts)
            del parts
            return out

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "in_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "qkv": fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                "qkv_bias": fused([p + f"self_attn.{x}_proj.bias" for x in "qkv"]) if c.qkv_bias else None,
                "o": w(p + "self_attn.o_proj.weight"),
                "gate_up": fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                "down": w(p + "mlp.down_proj.weight"),
            })
            if self.fp8:  # replace each projection by (e4m3 weight [N, K], per-channel scale [N])
                L = self.layers[-1]
                for name in self.LINEARS:
                    L[name] = quantize_weight_fp8(L[name])
            if self.int8:  # (int8 weight [N, K], per-channel scale [N])
                L = self.layers[-1]
                for name in self.LINEARS:
                    L[name] = quantize_weight_int8(L[name])
            progress("converting", i + 1, c.num_layers)
        self.cos_sin = build_cos_sin_cache(c.head_dim, max_position, c.rope_theta, c.rope_scaling,
                                           dtype=torch.float32, device=device)
        self.scale = c.head_dim ** -0.5
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def weight_bytes(self) -> int:
        """Bytes of the placed weights (a tied LM head counted once)."""
        seen, total = set(), 0
        for t in [self.embed, self.lm_head, self.norm] + [x for L in self.layers for v in L.values()
                                                          for x in (v if isinstance(v, tuple) else (v,))]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def _linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T (+ bias)``; ``w`` is a tensor, or ``(w_q, w_scale)`` under FP8 or INT8 quantization."""
        if self.fp8:
            return self.ops.fp8_linear(x, w[0], w[1], bias)
        if self.int8:
            return int8_linear(x, w[0], w[1], bias)
        return self.ops.linear(x, w, bias)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids, positions: ``[T]`` int64.
            meta: the step's :class:`AttentionMetadata`.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, updated in place.
            logits_indices: ``[S]`` int64 rows of the step whose logits are wanted (None: all rows).

        Returns:
            ``[S, vocab]`` float32 logits.
        """
        c, ops = self.config, self.ops
        h = F.embedding(input_ids, self.embed)
        residual = None
        nd = meta.num_decode_tokens
        for li, L in enumerate(self.layers):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, L["in_norm"], c.rms_norm_eps)
            else:
                x, residual = ops.rms_norm(h, L["in_norm"], c.rms_norm_eps, residual)
            qkv = self._linear(x, L["qkv"], L["qkv_bias"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(-1, c.num_heads, c.head_dim)
            k = k.reshape(-1, c.num_kv_heads, c.head_dim)
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_cache[li, 0], kv_cache[li, 1]
            q, _ = ops.rope_and_cache(q, k, v, positions, self.cos_sin, k_cache, v_cache, meta.slot_mapping)
            if nd == q.shape[0]:
                attn = ops.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_seq_lens, self.scale)
            elif nd == 0:
                attn = ops.prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                             meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, self.scale)
            else:
                attn = torch.cat([
                    ops.decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_seq_lens, self.scale),
                    ops.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                          meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, self.scale)])
            h = self._linear(attn.reshape(-1, self.q_size), L["o"])
            x, residual = ops.rms_norm(h, L["post_norm"], c.rms_norm_eps, residual)
            h = self._linear(ops.silu_and_mul(self._linear(x, L["gate_up"])), L["down"])
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        x, _ = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual)
        return self.ops.linear(x, self.lm_head).float()
