"""dispatch: declarative hardware dispatch for the DeepSeek sparse-attention indexer.

The front door; everything an engine imports is here:

    from dispatch import IndexerStep, PagedBatch, ExtendBatch, RopeSpec, load_dispatcher
    step = IndexerStep(load_dispatcher(), kv_fp8_dtype=..., rope=RopeSpec.neox_head(), softmax_scale=..., head_scale=...)
    plan = step.plan(batch)             # once per batch: a decision per op + the decided layout's tensors
    indices = step.select(plan, q, weights, positions, cos_sin_cache, kv_cache)  # per layer: int32 [T, 2048]

The errors are here too (DispatchError and its kinds). The wings behind it, each importing only the
ones before it: contract (what a backend plugin imports: dispatch.contract), registry, deciding, step,
engines, bench, cli; docs/concepts.md says which lives where.
"""

from dispatch.contract.decision import Decision, Rejection
from dispatch.contract.errors import (
    BackendError,
    DispatchError,
    DtypeMismatchError,
    EngineVersionError,
    GraphMismatchError,
    IndexBoundsError,
    InvalidBatchError,
    InvalidKeyError,
    LayoutError,
    NoBackendError,
    OptionError,
    PluginError,
    RankDisagreementError,
    RegistryError,
    UnservedCallError,
)
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.layout import Layout

__all__ = [
    "Arch",
    "BackendError",
    "Decision",
    "DispatchError",
    "DispatchKey",
    "DtypeMismatchError",
    "EngineVersionError",
    "ExtendBatch",
    "PagedBatch",
    "Fp8Dtype",
    "ForwardMode",
    "GraphMismatchError",
    "IndexBoundsError",
    "IndexerStep",
    "InvalidBatchError",
    "InvalidKeyError",
    "Layout",
    "LayoutError",
    "NoBackendError",
    "Op",
    "OptionError",
    "PluginError",
    "RankDisagreementError",
    "RegistryError",
    "Rejection",
    "RopeSpec",
    "UnservedCallError",
    "build_plan",
    "indexer_q_quant",
    "load_dispatcher",
    "paged_mqa_logits",
    "topk",
]

# What an engine imports, each from the wing it lives in; loaded on first use (the runtime pulls in
# pydantic and torch), so `import dispatch` stays light.
_FRONT_DOOR = {
    "IndexerStep": "dispatch.engines.indexer_step",
    "PagedBatch": "dispatch.step.paged_plan",
    "ExtendBatch": "dispatch.step.extend_batch",
    "RopeSpec": "dispatch.contract.rope",
    "load_dispatcher": "dispatch.deciding.runtime",
    "build_plan": "dispatch.step.paged_plan",
    "indexer_q_quant": "dispatch.contract.ops",
    "paged_mqa_logits": "dispatch.contract.ops",
    "topk": "dispatch.contract.ops",
}


def __getattr__(name):
    if name in _FRONT_DOOR:
        import importlib

        return getattr(importlib.import_module(_FRONT_DOOR[name]), name)
    raise AttributeError(f"module 'dispatch' has no attribute {name!r}")
