"""Compile every kernel for sm_90 (H100/H200) with Triton's bundled ptxas, on the CPU.

The interpreter runs kernels as numpy code and misses what only the compiler enforces (a runtime
``if`` may not change a variable's type, shared-memory limits, register spills). This runs
bench/gpu_compile_check.py in a subprocess (it must import the kernels with TRITON_INTERPRET=0).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _ptxas_available(), reason="this Triton build ships no NVIDIA ptxas")
def test_every_kernel_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_compile_check.py"), "--arch", "90"],
                          capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "HGMMA" in proc.stdout, "prefill attention should compile to Hopper's wgmma"
    assert "QGMMA" in proc.stdout, "the FP8 GEMM should compile to FP8 wgmma"
