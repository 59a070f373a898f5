"""dispatch: declarative hardware dispatch for the DeepSeek sparse-attention indexer.

    dispatcher = load_dispatcher()                       # registry.yaml + plugins, this machine
    plan = build_plan(dispatcher, batch, kv_fp8_dtype=...)  # once per batch: decisions + layout tensors
    q_fp8, w = indexer_q_quant(plan, q, weights, positions, cos_sin, rope=..., softmax_scale=..., head_scale=...)
    logits = paged_mqa_logits(plan, q_fp8, kv_cache, w)  # per layer, through the decided backend
    indices = topk(plan, logits, 2048)                   # int32 [B*N, 2048], -1 past a token's keys
"""

from dispatch.contract.decision import Decision, Rejection
from dispatch.contract.errors import (
    BackendError,
    DispatchError,
    DtypeMismatchError,
    InvalidKeyError,
    LayoutError,
    NoBackendError,
    PluginError,
    RegistryError,
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
    "Fp8Dtype",
    "ForwardMode",
    "InvalidKeyError",
    "Layout",
    "LayoutError",
    "NoBackendError",
    "Op",
    "PluginError",
    "RegistryError",
    "Rejection",
    "build_plan",
    "load_dispatcher",
    "indexer_q_quant",
    "paged_mqa_logits",
    "topk",
]


def __getattr__(name):
    # The runtime pulls in pydantic and torch; import it on first use so `import dispatch` stays light.
    if name == "load_dispatcher":
        from dispatch.deciding.runtime import load_dispatcher

        return load_dispatcher
    if name == "build_plan":
        from dispatch.step.plan import build_plan

        return build_plan
    if name in ("indexer_q_quant", "paged_mqa_logits", "topk"):
        from dispatch.step import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'dispatch' has no attribute {name!r}")
