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
