"""Drift: every hook target, patched name, signature and metadata field the SGLang plugin relies on
exists in the pinned release (tests/engines/sglang-nodeps.txt), so an SGLang upgrade fails here, in
CI, instead of at serving time."""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil

import pytest

from tests.support.sglang_env import sglang_env  # noqa: F401  (the fixture)

pytestmark = pytest.mark.engines

# Every field of SGLang's metadata the plugin reads, by the class that holds it.
DSA_METADATA_FIELDS = {
    "cache_seqlens_int32", "real_page_table", "page_table_1", "indexer_logical_page_table",
    "dsa_seqlens_expanded", "dsa_extend_seq_lens_list", "paged_mqa_ctx_lens_2d",
}
INDEXER_METADATA_FIELDS = {"attn_metadata", "topk_transform_method", "force_unfused_topk"}
# Attributes the plugin reads from SGLang objects that are set in their __init__ (checked in its source).
INDEXER_ATTRIBUTES = ("self.index_topk", "self.num_init_tokens", "self.num_local_tokens")
BACKEND_ATTRIBUTES = ("self.speculative_num_draft_tokens", "self.dsa_index_topk", "self.forward_metadata")


def test_release_is_the_pinned_one(sglang_env):
    from pathlib import Path

    from dispatch.engines.sglang.release import KNOWN_RELEASES, installed_release

    pins = (Path(__file__).parent / "sglang-nodeps.txt").read_text()
    assert f"sglang=={installed_release()}" in pins.split()
    assert installed_release() in KNOWN_RELEASES


def test_every_hook_target_resolves_with_the_signature_the_hook_expects(sglang_env):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from dispatch.engines.sglang.hooks import HOOKS

    assert callable(HookRegistry.register) and callable(HookRegistry.apply_hooks)
    for target, hook, hook_type in HOOKS:
        owner, name = target.rsplit(".", 1)
        original = vars(pkgutil.resolve_name(owner))[name]  # the class's own attribute, not inherited
        HookType[hook_type]
        theirs = list(inspect.signature(original).parameters)
        ours = list(inspect.signature(hook).parameters)
        if hook_type == "REPLACE":
            assert ours == theirs, f"{target}: SGLang's parameters {theirs}, the plugin's {ours}"
        elif name == "init_forward_metadata":
            assert theirs == ["self", "forward_batch"] and ours[2:] == theirs[1:]  # AFTER: (result, self, ...)
        else:
            assert "forward_mode" in theirs, f"{target} no longer takes forward_mode"


def test_metadata_fields_exist(sglang_env):
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.layers.attention.dsa_backend import DSAMetadata

    assert DSA_METADATA_FIELDS <= {f.name for f in dataclasses.fields(DSAMetadata)}
    assert INDEXER_METADATA_FIELDS <= {f.name for f in dataclasses.fields(DSAIndexerMetadata)}
    assert callable(DSAIndexerMetadata.get_dsa_extend_len_cpu)


def test_objects_and_switches_the_plugin_reads(sglang_env):
    from sglang.kernels.ops.quantization import fp8_kernel
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.model_executor import forward_context
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    indexer_source = inspect.getsource(Indexer)
    assert all(f"{attribute} =" in indexer_source for attribute in INDEXER_ATTRIBUTES)
    backend_source = inspect.getsource(DeepseekSparseAttnBackend)
    assert all(attribute in backend_source for attribute in BACKEND_ATTRIBUTES)
    assert callable(Indexer._get_index_k_read_buffer)
    assert callable(DSATokenToKVPool.get_index_k_with_scale_buffer)
    assert callable(forward_context.get_token_to_kv_pool)
    assert fp8_kernel.fp8_dtype is not None
    assert envs.SGLANG_DSA_FUSE_TOPK.get() in (True, False)
    assert {"PAGED", "RAGGED"} <= set(TopkTransformMethod.__members__)
    for method in ("is_decode_or_idle", "is_target_verify", "is_draft_extend_v2", "is_extend_without_speculative", "is_idle"):
        assert callable(getattr(ForwardMode, method)), method
    # The extend batch's host lengths the ragged plan reads.
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    assert {"extend_prefix_lens_cpu", "extend_seq_lens_cpu"} <= {f.name for f in dataclasses.fields(ForwardBatch)}
