"""The plugin's hooks, registered with SGLang's own HookRegistry (sglang/srt/plugins/hook_registry.py):
the only mechanism it uses to change SGLang. tests/engines/test_sglang_plugin_drift.py checks every target and
signature here against the pinned release."""

from __future__ import annotations

import inspect
import logging

from dispatch.engines.sglang import indexer, plans
from dispatch.engines.sglang.release import check_release
from dispatch.engines.sglang.session import session
from dispatch.contract.key import ForwardMode

logger = logging.getLogger("dispatch.engines.sglang")

INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"
BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"


def after_init_forward_metadata(_result, backend, forward_batch):
    """After SGLang builds a batch's DSAMetadata: plan the batch once, from that metadata."""
    _plan_for(backend, forward_batch.forward_mode, forward_batch)


def after_graph_metadata(_result, backend, *args, **kwargs):
    """After SGLang builds a CUDA graph's static DSAMetadata, or refills it in place for a replay:
    plan it, or refill the captured plan in place."""
    method = type(backend)._apply_cuda_graph_metadata
    arguments = inspect.signature(getattr(method, "__wrapped__", method)).bind(backend, *args, **kwargs).arguments
    _plan_for(backend, arguments["forward_mode"], None)


def _plan_for(backend, mode, forward_batch) -> None:
    metadata = getattr(backend, "forward_metadata", None)
    if metadata is None or mode.is_idle():
        return
    step = session().step(backend.dsa_index_topk, to_slots=False)  # planning does not depend on either
    dispatch_mode = plans.dispatch_mode(mode)
    if dispatch_mode is ForwardMode.EXTEND:
        if forward_batch is not None and metadata.real_page_table.shape[0] > 0:
            plans.plan_extend(step, metadata, forward_batch)
        return
    next_n = 1 if dispatch_mode is ForwardMode.DECODE else backend.speculative_num_draft_tokens
    plans.plan_paged(step, metadata, mode, next_n)


# (target, hook, HookType name): what install registers, in order.
HOOKS = (
    (f"{INDEXER}._get_topk_paged", indexer.get_topk_paged, "REPLACE"),
    (f"{INDEXER}._get_topk_ragged", indexer.get_topk_ragged, "REPLACE"),
    (f"{BACKEND}.init_forward_metadata", after_init_forward_metadata, "AFTER"),
    (f"{BACKEND}._apply_cuda_graph_metadata", after_graph_metadata, "AFTER"),
)


def install() -> None:
    """Check the release, load dispatch's registry, register the hooks; SGLang's load_plugins applies them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    version = check_release()
    here = session()
    for target, hook, hook_type in HOOKS:
        HookRegistry.register(target, hook, HookType[hook_type])
    logger.info(
        "dispatch SGLang plugin (sglang %s): the DSA indexer's logits and top-k are dispatch's (%s); %s",
        version, ", ".join(target.rsplit(".", 1)[1] for target, _, kind in HOOKS if kind == "REPLACE"), here.describe(),
    )
