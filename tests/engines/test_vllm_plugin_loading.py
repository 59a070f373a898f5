"""The vLLM plugin loaded as vLLM loads it: `load_general_plugins` calls the entry point; it stays off
unless VLLM_PLUGINS names `dispatch`, then replaces the SparseAttnIndexer layer (register_oot) and the
V3.2 module name, logs one line naming plugin, registry and cluster, and refuses to override another
plugin's replacement. The registered torch op runs a forward end to end on the CPU."""

import importlib
import logging
from importlib import metadata

import pytest
import torch

from tests.support.vllm_engine import BLOCK, assert_topk_matches, import_vllm, kv_cache_and_keys, reference_logits, \
    visible_keys, vllm_metadata

pytestmark = pytest.mark.engines


@pytest.fixture
def vllm_state(monkeypatch):
    """vLLM's global plugin state, restored after the test."""
    indexer = import_vllm()
    from vllm import plugins
    from vllm.model_executor import custom_op

    from dispatch.engines.vllm import plugin

    attention = importlib.import_module(plugin.DIRECT_CALL_MODULE)
    saved = dict(custom_op.op_registry_oot), getattr(attention, plugin.DIRECT_CALL_NAME)
    monkeypatch.setattr(plugins, "plugins_loaded", False)
    monkeypatch.setattr(plugin, "_INDEXER", None)
    entry = metadata.EntryPoint(name="dispatch", value="dispatch.engines.vllm.plugin:register",
                                group="vllm.general_plugins")
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points",
                        lambda **kw: [entry] if kw.get("group") == "vllm.general_plugins" else real(**kw))
    yield indexer, attention
    custom_op.op_registry_oot.clear()
    custom_op.op_registry_oot.update(saved[0])
    setattr(attention, plugin.DIRECT_CALL_NAME, saved[1])


def test_pyproject_declares_the_entry_point():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"dispatch": "dispatch.engines.vllm.plugin:register"}


def test_off_unless_vllm_plugins_names_it(vllm_state, monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers import sparse_attn_indexer as layer
    from vllm.plugins import load_general_plugins

    _, attention = vllm_state
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)  # vLLM then loads every plugin: this one stays off
    load_general_plugins()
    assert "SparseAttnIndexer" not in op_registry_oot
    assert attention.sparse_attn_indexer is layer.sparse_attn_indexer


def test_on_when_named(vllm_state, monkeypatch, caplog):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.plugins import load_general_plugins

    from dispatch.engines.vllm import plugin

    _, attention = vllm_state
    monkeypatch.setenv("VLLM_PLUGINS", "other,dispatch")
    with caplog.at_level(logging.INFO, logger="vllm.plugins.dispatch"):
        load_general_plugins()
    assert op_registry_oot["SparseAttnIndexer"].dispatch_plugin
    assert attention.sparse_attn_indexer.dispatch_plugin
    line = [r.getMessage() for r in caplog.records if "active" in r.getMessage()]
    assert len(line) == 1 and "registry" in line[0] and "cluster" in line[0] and "`dispatch`" in line[0]
    plugin.register()  # vLLM may call it again in the same process: nothing changes
    assert attention.sparse_attn_indexer.dispatch_plugin


def test_another_plugins_layer_is_not_overridden(vllm_state, monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    from dispatch.engines.vllm import plugin
    from dispatch.contract.errors import PluginError

    monkeypatch.setenv("VLLM_PLUGINS", "dispatch")
    op_registry_oot["SparseAttnIndexer"] = type("TheirIndexer", (), {})
    with pytest.raises(PluginError, match="another plugin already replaced vLLM's `SparseAttnIndexer`"):
        plugin.register()


def test_the_registered_op_serves_a_forward(vllm_state, monkeypatch):
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.utils.torch_utils import _encode_layer_name

    from dispatch.engines.vllm import plugin
    from dispatch.engines.vllm.layer import OP_NAME

    indexer_module, _ = vllm_state
    monkeypatch.setenv("VLLM_PLUGINS", "dispatch")
    plugin.register()
    seq_lens, query_lens = [70, 130], [2, 2]
    generator = torch.Generator().manual_seed(5)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    cache = kv_cache_and_keys(6, torch.float8_e4m3fn, generator)
    q = (torch.randn(4, 8, 128, generator=generator) * 40).to(torch.float8_e4m3fn)
    weights = torch.randn(4, 8, generator=generator)
    metadata = vllm_metadata(indexer_module, seq_lens, query_lens, 2, table)
    buffer = torch.zeros(4, 32, dtype=torch.int32)
    prefix = "model.layers.3.self_attn.indexer.k_cache"
    context = ForwardContext(no_compile_layers={}, attn_metadata={prefix: metadata}, slot_mapping={})
    with override_forward_context(context):
        getattr(torch.ops.vllm, OP_NAME)(
            torch.empty(4, 16), _encode_layer_name(prefix), cache, q, None, None, weights, 128, "ue8m0", 32, 128,
            4096, 4096, buffer, True, False, False, _encode_layer_name(""),
        )
    assert_topk_matches(buffer, reference_logits(q, weights, cache, table, visible_keys(seq_lens, query_lens)), 32)
    assert BLOCK == cache.shape[1]
