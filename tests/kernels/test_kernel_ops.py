"""select_ops wiring and the flash-attn backend."""
import importlib.util

import pytest
import torch

from kernel_helpers import TOL, assert_close
from tandem.kernels import ops

HAS_CUDA = torch.cuda.is_available()
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


@pytest.mark.parametrize("backend,suffix", [("torch", "_ref"), ("triton", "_triton"),
                                            ("auto", "_ref" if not HAS_CUDA else "_triton")])
def test_select_ops_picks_implementations(backend, suffix):
    chosen = ops.select_ops(backend, "cuda" if (backend == "auto" and HAS_CUDA) else "cpu")
    for name in ops._OPS:
        fn = getattr(chosen, name)
        assert fn.__name__.endswith(suffix), f"{backend}: {name} -> {fn.__name__}"


def test_every_op_has_both_versions_with_the_same_signature():
    import importlib
    import inspect
    for name, (module, stem) in ops._OPS.items():
        mod = importlib.import_module(module)
        ref = inspect.signature(getattr(mod, stem + "_ref"))
        tri = inspect.signature(getattr(mod, stem + "_triton"))
        for p in ref.parameters:
            assert p in tri.parameters, f"{name}: {p} missing from the Triton version"
            assert ref.parameters[p].default == tri.parameters[p].default, f"{name}: default of {p}"


def test_unknown_backend():
    with pytest.raises(ValueError, match="attentionBackend"):
        ops.select_ops("cutlass")


@pytest.mark.skipif(not HAS_CUDA, reason="flash-attn runs on CUDA only")
@pytest.mark.skipif(not HAS_FLASH, reason="flash-attn is not installed (no PyPI wheel; its sdist "
                                          "needs CUDA to build), so the flash-attn backend is untested here")
def test_flash_attn_backend():
    from tandem.kernels import attention, flash
    dtype, d, bs = torch.float16, 64, 16
    kc = torch.randn(16, bs, 2, d, dtype=dtype, device="cuda")
    vc = torch.randn_like(kc)
    tables = torch.randperm(16, device="cuda").view(2, 8).int()
    seq_lens = torch.tensor([40, 77], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 10, 87], dtype=torch.int32, device="cuda")
    q = torch.randn(87, 8, d, dtype=dtype, device="cuda")
    out = flash.prefill_attention_flash(q, kc, vc, tables, cu, seq_lens, d ** -0.5)
    ref = attention.prefill_attention_ref(q.double(), kc.double(), vc.double(), tables, cu, seq_lens, d ** -0.5)
    assert_close(out, ref, TOL[dtype], "flash prefill")
    qd = torch.randn(2, 8, d, dtype=dtype, device="cuda")
    out = flash.decode_attention_flash(qd, kc, vc, tables, seq_lens, d ** -0.5)
    ref = attention.decode_attention_ref(qd.double(), kc.double(), vc.double(), tables, seq_lens, d ** -0.5)
    assert_close(out, ref, TOL[dtype], "flash decode")


class _FakeFlashAttn:
    """A stand-in for flash_attn with FlashAttention-2's call signatures and semantics (causal mask
    aligned bottom-right, paged K/V through ``block_table``), computed with the torch reference. It
    tests our wrapper's gathering and arguments on the CPU; the real package is tested above."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None):
        from tandem.kernels.attention import prefill_attention_ref
        assert causal and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).int()
        assert max_seqlen_k == int(lens.max())
        if block_table is None:  # contiguous: rebuild a one-block-per-sequence "cache"
            width = max_seqlen_k
            kc = torch.zeros(len(lens), width, *k.shape[1:], dtype=k.dtype)
            vc = torch.zeros_like(kc)
            for b, n in enumerate(lens.tolist()):
                s = int(cu_seqlens_k[b])
                kc[b, :n], vc[b, :n] = k[s:s + n], v[s:s + n]
            block_table = torch.arange(len(lens), dtype=torch.int32)[:, None]
            k, v = kc, vc
        return prefill_attention_ref(q, k, v, block_table, cu_seqlens_q, lens, softmax_scale)

    @staticmethod
    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                softmax_scale=None, causal=False):
        from tandem.kernels.attention import decode_attention_ref
        assert q.shape[1] == 1 and causal
        return decode_attention_ref(q[:, 0], k_cache, v_cache, block_table, cache_seqlens,
                                    softmax_scale)[:, None]


@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_wrapper_with_a_stand_in(monkeypatch, block_size):
    """flash.py's gather path (16-token blocks) and pass-through path (256-token pages) against the
    reference, with a stand-in flash_attn module."""
    import sys

    from tandem.kernels import attention, flash
    monkeypatch.setitem(sys.modules, "flash_attn", _FakeFlashAttn)
    d, hk, hq = 16, 1, 4
    lens, qlens = [300, 40], [20, 40]
    width = (max(lens) + block_size - 1) // block_size
    nb = 2 * width + 1
    kc = torch.randn(nb, block_size, hk, d, dtype=torch.float64)
    vc = torch.randn_like(kc)
    tables = torch.randperm(nb)[:2 * width].view(2, width).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 20, 60], dtype=torch.int32)
    q = torch.randn(60, hq, d, dtype=torch.float64)
    out = flash.prefill_attention_flash(q, kc, vc, tables, cu, seq_lens, 0.25)
    assert_close(out, attention.prefill_attention_ref(q, kc, vc, tables, cu, seq_lens, 0.25), 1e-12, "prefill")
    qd = torch.randn(2, hq, d, dtype=torch.float64)
    out = flash.decode_attention_flash(qd, kc, vc, tables, seq_lens, 0.25)
    assert_close(out, attention.decode_attention_ref(qd, kc, vc, tables, seq_lens, 0.25), 1e-12, "decode")
    assert flash._usable_paged(kc, 1.0) == (block_size == 256)


@pytest.mark.skipif(HAS_FLASH, reason="flash-attn is installed here")
def test_flash_attn_backend_missing_fails_at_selection():
    with pytest.raises(ImportError, match="flash-attn"):
        ops.select_ops("flash-attn", "cuda")
