"""Drift: every hook target, patched name, signature and metadata field the vLLM plugin relies on
exists in the installed (pinned) vLLM, so an upgrade fails here, not at serving time. Also the plugin's
entry point itself: off unless VLLM_PLUGINS names it, on through vLLM's own loader when it does."""

import dataclasses
import importlib
import inspect

import pytest

from tests.support.vllm_engine import import_vllm

pytestmark = pytest.mark.engines

# vLLM 0.33.0's sparse_attn_indexer parameters, in order: DispatchIndexer.__call__ takes exactly these.
OP_PARAMETERS = (
    "hidden_states", "k_cache_prefix", "kv_cache", "q_quant", "q_scale", "k", "weights", "quant_block_size",
    "scale_fmt", "topk_tokens", "head_dim", "max_model_len", "total_seq_lens", "topk_indices_buffer",
    "skip_k_cache_insert", "use_pcp", "pcp_shard_decode_requests", "dense_mha_metadata_layer_name",
    "use_fp4_cache", "dcp_rank", "dcp_world_size", "cp_kv_cache_interleave_size", "skip_topk_buffer_clear",
    "candidate_blocks", "candidate_block_size", "candidate_write", "topk_backend",
)
METADATA_FIELDS = {
    "DeepseekV32IndexerMetadata": {"seq_lens", "max_seq_len", "slot_mapping", "num_decodes", "num_decode_tokens",
                                   "num_prefills", "decode", "prefill", "block_table"},
    "DeepSeekV32IndexerDecodeMetadata": {"decode_is_uniform", "write_max_decode_len", "seq_lens", "block_table"},
    "DeepseekV32IndexerPrefillMetadata": {"chunks", "row_shard_sizes"},
    "DeepseekV32IndexerPrefillChunkMetadata": {"block_table", "cu_seqlen_ks", "cu_seqlen_ke", "cu_seq_lens",
                                               "total_seq_lens", "token_start", "token_end", "num_reqs",
                                               "skip_kv_gather", "local_cu_seq_lens", "pcp_deinterleave_idx"},
}
# The layer attributes the out-of-tree layer's forward reads (set in SparseAttnIndexer.__init__).
LAYER_ATTRIBUTES = ("k_cache", "quant_block_size", "scale_fmt", "topk_tokens", "head_dim", "max_model_len",
                    "max_total_seq_len", "topk_indices_buffer", "skip_k_cache_insert", "use_pcp",
                    "pcp_shard_decode_requests", "dense_mha_metadata_layer_name", "use_fp4_cache", "dcp_rank",
                    "dcp_world_size", "_parallel_config", "candidate_blocks", "candidate_block_size",
                    "candidate_write", "topk_backend")


@pytest.fixture(scope="module")
def vllm_indexer():
    return import_vllm()


def test_the_pinned_release_is_the_one_the_plugin_knows(vllm_indexer):
    from dispatch.engines.vllm.version import KNOWN_VLLM_VERSIONS, check_vllm_version

    assert check_vllm_version() in KNOWN_VLLM_VERSIONS


def test_an_unknown_release_is_refused_by_name():
    from dispatch.engines.vllm.version import check_vllm_version
    from dispatch.contract.errors import PluginError

    with pytest.raises(PluginError, match=r"this is vllm 0\.34\.0"):
        check_vllm_version("0.34.0")


def test_the_op_signature_is_the_plugins(vllm_indexer):
    from vllm.model_executor.layers import sparse_attn_indexer as layer

    from dispatch.engines.vllm.op import DispatchIndexer

    assert tuple(inspect.signature(layer.sparse_attn_indexer).parameters) == OP_PARAMETERS
    assert tuple(inspect.signature(DispatchIndexer.__call__).parameters)[1:] == OP_PARAMETERS
    assert callable(layer.sparse_attn_indexer_fake)


def test_the_direct_call_site_calls_the_module_name(vllm_indexer):
    from vllm.model_executor.layers import sparse_attn_indexer as layer

    from dispatch.engines.vllm.plugin import DIRECT_CALL_MODULE, DIRECT_CALL_NAME

    attention = importlib.import_module(DIRECT_CALL_MODULE)
    assert getattr(attention, DIRECT_CALL_NAME) is layer.sparse_attn_indexer
    source = inspect.getsource(attention.DeepseekV32Attention._sparse_indexer_and_attn)
    assert f"{DIRECT_CALL_NAME}(" in source, "V3.2 no longer calls the module function: revisit the rebinding"


def test_the_hooks_exist(vllm_indexer):
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_general_plugins
    from vllm.utils.torch_utils import _encode_layer_name, _resolve_layer_name, direct_register_custom_op

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert issubclass(SparseAttnIndexer, CustomOp) and isinstance(op_registry_oot, dict)
    assert callable(SparseAttnIndexer.register_oot) and callable(load_general_plugins)
    assert all(callable(f) for f in (eager_break_during_capture, _encode_layer_name, _resolve_layer_name,
                                      direct_register_custom_op))
    init = inspect.getsource(SparseAttnIndexer.__init__)
    missing = [name for name in LAYER_ATTRIBUTES if f"self.{name} =" not in init]
    assert not missing, f"SparseAttnIndexer no longer sets {missing}"
    assert tuple(inspect.signature(SparseAttnIndexer.forward_cuda).parameters) == (
        "self", "hidden_states", "q_quant", "k", "weights")


@pytest.mark.parametrize("name", list(METADATA_FIELDS))
def test_the_metadata_fields_exist(vllm_indexer, name):
    fields = {field.name for field in dataclasses.fields(getattr(vllm_indexer, name))}
    assert METADATA_FIELDS[name] <= fields, f"{name} lost {sorted(METADATA_FIELDS[name] - fields)}"


def test_vllms_own_rules_are_the_ones_explain_states(vllm_indexer):
    from vllm.utils import deep_gemm

    from dispatch.engines.vllm.rules import SM90_NATIVE_NEXT_N

    source = inspect.getsource(deep_gemm.native_next_n_supported)
    assert "next_n in (1, 2, 4)" in source and SM90_NATIVE_NEXT_N == {1, 2, 4}
    flattening = inspect.getsource(vllm_indexer._use_flattening)
    assert "_supports_native_decode" in flattening and "enable_adaptive_verification" in flattening
