"""The vLLM plugin: `register`, the `vllm.general_plugins` entry point `dispatch` (pyproject.toml).

vLLM's `load_general_plugins` calls it in every process (engine, workers). It does nothing unless
VLLM_PLUGINS names `dispatch` (vLLM itself loads every general plugin when VLLM_PLUGINS is unset; this
one stays off then). Named, it checks the vLLM release, then routes the indexer through dispatch at
vLLM's two call sites of DeepSeek V3.2's indexer:
- the `SparseAttnIndexer` custom op, through vLLM's documented `@SparseAttnIndexer.register_oot`
  (the layer the DeepseekV2 V3.2 path and V4 call);
- the V3.2 NVIDIA path, which calls the module function directly from
  `vllm.models.deepseek_v32.attention` (register_oot cannot reach it). vLLM has no hook there, so the
  plugin rebinds that one module name to dispatch's function of the same signature (wrapped by vLLM's
  own `eager_break_during_capture`, as the original is), after checking that the name still holds
  vLLM's function. Nothing else of vLLM is changed."""

from __future__ import annotations

import logging
import os

from dispatch.contract.errors import PluginError

PLUGIN_NAME = "dispatch"  # the entry point's name: what VLLM_PLUGINS must list
DIRECT_CALL_MODULE = "vllm.models.deepseek_v32.attention"
DIRECT_CALL_NAME = "sparse_attn_indexer"
OOT_LAYER = "SparseAttnIndexer"

logger = logging.getLogger("vllm.plugins.dispatch")


def named_in_vllm_plugins() -> bool:
    """VLLM_PLUGINS as vLLM parses it (vllm/envs.py: comma-separated; unset is None)."""
    value = os.environ.get("VLLM_PLUGINS")
    return value is not None and PLUGIN_NAME in value.split(",")


def register() -> None:
    """The entry point. Idempotent: vLLM may call it more than once in a process."""
    if not named_in_vllm_plugins():
        logger.debug("dispatch's vLLM plugin is installed but off: VLLM_PLUGINS does not name `%s`", PLUGIN_NAME)
        return
    from dispatch.engines.vllm.version import check_vllm_version

    version = check_vllm_version()
    indexer = _dispatch_indexer()
    _register_layer()
    _rebind_direct_call(indexer)
    from dispatch.deciding.clusters import requested_cluster
    from dispatch.deciding.runtime import registry_path

    logger.info(
        "dispatch plugin `%s` active for vllm %s: registry %s, cluster %s; serving %s (register_oot) and %s.%s",
        PLUGIN_NAME, version, registry_path(), requested_cluster() or "by the registry's match, at first use",
        OOT_LAYER, DIRECT_CALL_MODULE, DIRECT_CALL_NAME,
    )


_INDEXER = None


def _dispatch_indexer():
    global _INDEXER
    if _INDEXER is None:
        from vllm.model_executor.layers import sparse_attn_indexer as layer_module

        from dispatch.engines.vllm.op import DispatchIndexer
        from dispatch.deciding.runtime import load_dispatcher

        _INDEXER = DispatchIndexer(layer_module.sparse_attn_indexer, load_dispatcher)
    return _INDEXER


def _register_layer() -> None:
    from vllm.model_executor.custom_op import op_registry_oot

    from dispatch.engines.vllm.layer import dispatch_layer_class

    registered = op_registry_oot.get(OOT_LAYER)
    if registered is not None and getattr(registered, "dispatch_plugin", False):
        return
    if registered is not None:
        raise PluginError(
            f"another plugin already replaced vLLM's `{OOT_LAYER}` ({registered.__module__}.{registered.__qualname__}); "
            "dispatch will not override it silently: load one of the two"
        )
    dispatch_layer_class(_dispatch_indexer)


def _rebind_direct_call(indexer) -> None:
    import importlib

    module = importlib.import_module(DIRECT_CALL_MODULE)
    current = getattr(module, DIRECT_CALL_NAME, None)
    if getattr(current, "dispatch_plugin", False):
        return
    if current is not indexer.vllm_function:
        raise PluginError(
            f"`{DIRECT_CALL_MODULE}.{DIRECT_CALL_NAME}` is not vLLM's sparse_attn_indexer "
            f"({current!r}); dispatch will not replace what another plugin put there"
        )
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    def sparse_attn_indexer(*args, **kwargs):
        return indexer(*args, **kwargs)

    replacement = eager_break_during_capture(sparse_attn_indexer)
    replacement.dispatch_plugin = True
    setattr(module, DIRECT_CALL_NAME, replacement)
