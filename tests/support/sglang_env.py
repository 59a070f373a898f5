"""The engine tests' entry to SGLang: skip cleanly without it, and put tests/support/engine_stubs (torchvision,
which SGLang's multimodal modules import and the indexer never calls) on sys.path only while they run."""

from __future__ import annotations

import os

import pytest

from tests.support.engine_presence import engine_missing
from tests.support.engine_stubs_path import engine_stubs_on_path

INSTALL = "pip install --no-deps -r tests/engines/sglang-nodeps.txt && pip install -r tests/engines/sglang-deps.txt"

# SGLang's CPU path: its torch paged-logits fallback, and top-k without the fused transform kernels.
CPU_ENV = {"SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1", "SGLANG_DSA_FUSE_TOPK": "0"}


@pytest.fixture(scope="module")
def sglang_env():
    """The SGLang modules the tests use, importable; skips with the install command where sglang is not."""
    saved = {name: os.environ.get(name) for name in CPU_ENV}
    os.environ.update(CPU_ENV)
    try:
        with engine_stubs_on_path("sglang"):
            try:
                import sglang.srt.layers.attention.dsa.dsa_indexer  # noqa: F401
            except ImportError as exc:
                engine_missing(f"sglang is not importable ({exc}); install it with: {INSTALL}")
            from tests.support import sglang_harness

            yield sglang_harness
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
