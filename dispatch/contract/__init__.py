"""The plugin contract in one module: everything a backend plugin imports.

A plugin registers `Backend` values through `hookimpl`-marked `register_backends(register)`. Each op's
`run` follows the op's call convention, written below as a typed Protocol; OP_CONTRACTS says, per op,
which Protocol and which layouts a backend of it may declare. The types live in small modules
(backend, key, layout, input_checks, hookspecs); this module is the one a plugin needs.

A backend that raises (a kernel launch failure, a missing symbol) surfaces as BackendError naming the
backend, op, key and rule, chained to the original. The project's own errors (LayoutError and
DtypeMismatchError from a backend's input checks) and CUDA out-of-memory pass through unchanged.
There is no fallback to another backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dispatch.contract.backend import ALL_ARCHS, ALL_FP8_DTYPES, ALL_MODES, PAGED_MODES, Availability, Backend, Support
from dispatch.contract.errors import BackendError, DtypeMismatchError, LayoutError
from dispatch.contract.fp8 import torch_dtype
from dispatch.contract.hookspecs import hookimpl
from dispatch.contract.key import FP8_MAX, Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.kv_cache import BLOCK_KV, split_kv_cache
from dispatch.contract.layout import Layout
from dispatch.contract.rope import RopeSpec
from dispatch.contract.verification import Verified

if TYPE_CHECKING:
    import torch

    from dispatch.contract.input_checks import check_logits_inputs, check_ragged_logits_inputs
    from dispatch.step.plan import IndexerPlan


def __getattr__(name: str):
    # check_logits_inputs imports torch; registering a backend must not (`validate` runs without torch),
    # so it loads on first use. A plugin imports it inside its run, or at the top if it needs torch anyway.
    if name in ("check_logits_inputs", "check_ragged_logits_inputs"):
        from dispatch.contract import input_checks

        return getattr(input_checks, name)
    raise AttributeError(f"module 'dispatch.contract' has no attribute {name!r}")

__all__ = [
    "ALL_ARCHS",
    "ALL_FP8_DTYPES",
    "ALL_MODES",
    "BLOCK_KV",
    "FP8_MAX",
    "OP_CONTRACTS",
    "PAGED_MODES",
    "Arch",
    "Availability",
    "Backend",
    "BackendError",
    "DispatchKey",
    "DtypeMismatchError",
    "Fp8Dtype",
    "ForwardMode",
    "IndexerQQuantRun",
    "Layout",
    "LayoutError",
    "Op",
    "OpContract",
    "PagedMqaLogitsRun",
    "RaggedKeyGather",
    "RaggedMqaLogitsRun",
    "RopeSpec",
    "Support",
    "TopkRun",
    "Verified",
    "check_logits_inputs",
    "check_ragged_logits_inputs",
    "hookimpl",
    "split_kv_cache",
    "torch_dtype",
]


class PagedMqaLogitsRun(Protocol):
    """run(plan, q, kv_cache, weights, *, clean_logits=True) -> fp32 logits [B*N, plan.max_context_len].

    q is fp8 in plan.layout (native [B, N, H, D]; flatten [B*N, 1, H, D]), kv_cache uint8
    [num_blocks, block_kv, 1, D + 4], weights fp32 [B*N, H]. The run checks its inputs with
    check_logits_inputs and, with clean_logits, writes -inf at every position past a token's length;
    without it those positions are unspecified (a backend may still write -inf there): the indexer
    step asks for that, because its top-k never reads past a length. Bounds and NaN
    (dispatch/contract/bounds.py): it never follows a page-table entry outside [0, num_blocks) that a visible
    key needs; that token's row, like the row of a token whose length passes max_context_len, is NaN
    in every column, and the bit is ORed into plan.error_flags (a torch reference raises
    IndexBoundsError instead). A NaN q element or weight, a NaN key byte or a non-finite key scale
    makes the logits it touches NaN."""

    def __call__(
        self,
        plan: IndexerPlan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        *,
        clean_logits: bool = True,
    ) -> torch.Tensor: ...


class IndexerQQuantRun(Protocol):
    """run(q, weights, positions, cos_sin_cache, *, fp8_dtype, rope, softmax_scale, head_scale,
    error_flags) -> (q fp8 [T, H, D], fp32 weights [T, H]). fp8_dtype comes from the decision's key,
    never from the backend. Numerics are the engines': the RoPE output rounded to bf16 before the amax,
    the weight folded as w * scale * softmax_scale * head_scale one fp32 product at a time. A head
    vector with NaN or inf after RoPE gets the format's NaN byte and a NaN folded weight; a position
    outside the cos/sin cache is never read, poisons its token the same way and ORs BAD_POSITION into
    error_flags (the plan's int32 [1]; a torch reference raises IndexBoundsError instead)."""

    def __call__(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        fp8_dtype: Fp8Dtype,
        rope: RopeSpec,
        softmax_scale: float,
        head_scale: float,
        error_flags: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class TopkRun(Protocol):
    """run(logits, lengths, k, *, starts, page_table, page_rows, block_size, sorted) -> int32 [rows, k].

    logits fp32 [rows, W] (last dim contiguous); row r's visible keys are columns starts[r] ..
    starts[r] + lengths[r] - 1 (starts None: 0), and nothing outside them is read. Output: positions
    relative to starts[r] of the k largest visible logits, -1 past the number selectable; a NaN is
    never selected, -inf is. With page_table [P, M] and page_rows [rows], each position p becomes the
    physical KV slot page_table[page_rows[r], p // block_size] * block_size + p % block_size.
    sorted=True orders each row by value, descending, -1s last. A top-k backend with `prepare(plan)`
    (a routing plan built once per batch from the plan's token lengths) also receives that state as
    `state=`; without it (a call outside a plan) the run builds what it needs itself."""

    def __call__(
        self,
        logits: torch.Tensor,
        lengths: torch.Tensor,
        k: int,
        *,
        starts: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        page_rows: torch.Tensor | None = None,
        block_size: int = BLOCK_KV,
        sorted: bool = False,
    ) -> torch.Tensor: ...


class RaggedMqaLogitsRun(Protocol):
    """run(q, k, scales, weights, ks, ke, *, fp8_dtype, clean_logits=True) -> fp32 logits [M, S].

    DeepGEMM's fp8_mqa_logits convention: q fp8 [M, H, D], k fp8 [S, D] (keys gathered into one
    contiguous buffer) with fp32 scales [S], weights fp32 [M, H], ks / ke int32 [M]; row m sees keys
    [ks[m], ke[m]) and logits[m, s] = sum_h w[m, h] * relu(q[m, h] . k[s]) * scales[s] there. Every
    other column is -inf; with clean_logits=False (DeepGEMM's flag) those columns are unspecified
    (garbage, NaN included), which a top-k that reads only [ks, ke) never sees. fp8_dtype is the
    decision's key's (the K cache's): the run checks q and k against it with
    check_ragged_logits_inputs. The result may have a row stride wider than S (last dim contiguous).

    A ragged backend's `prepare(plan)` returns the batch's RaggedKeyGather (below): how it wants its
    k buffer filled from the paged cache, once per layer, from slots built once per batch."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        scales: torch.Tensor,
        weights: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        *,
        fp8_dtype: Fp8Dtype,
        clean_logits: bool = True,
    ) -> torch.Tensor: ...


class RaggedKeyGather(Protocol):
    """gather(kv_cache) -> (k fp8 [S, D] in the plan's fp8 dtype, contiguous; scales fp32 [S]).

    What a ragged logits backend's prepare(plan) returns: the batch's keys copied out of one layer's
    paged cache (uint8 [num_blocks, block_kv, 1, D + 4]) through the plan's gather_slots. A slot
    outside the cache is never read: a GPU gather poisons that key (NaN scale) and sets the plan's
    error_flags; a torch reference raises LayoutError naming the request."""

    def __call__(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class OpContract:
    """What a backend of one op promises: its run's call convention and the layouts it may consume."""

    run: type
    layouts: tuple[Layout, ...]
    summary: str


OP_CONTRACTS: dict[Op, OpContract] = {
    Op.INDEXER_Q_QUANT: OpContract(
        IndexerQQuantRun, (Layout.TOKENS,), "RoPE, power-of-two scale, fp8 store, scale folded into weights"
    ),
    Op.PAGED_MQA_LOGITS: OpContract(
        PagedMqaLogitsRun, (Layout.NATIVE, Layout.FLATTEN), "fp32 logits of every visible cached key"
    ),
    Op.TOPK: OpContract(TopkRun, (Layout.ROWS,), "the k largest visible logits per row, -1 padded"),
    Op.RAGGED_MQA_LOGITS: OpContract(
        RaggedMqaLogitsRun, (Layout.RAGGED,), "fp32 logits of each query row over its key range [ks, ke)"
    ),
}
