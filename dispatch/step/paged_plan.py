"""The per-batch plan: one decision per op and the tensors of the decided layout, built once per
batch from the engine's metadata and carried, as the tag, into every layer's call."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dispatch.contract.calling import call_backend
from dispatch.contract.decision import Decision
from dispatch.contract.errors import InvalidBatchError, LayoutError
from dispatch.contract.fp8 import fp8_dtype_of
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op, parse_enum
from dispatch.contract.layout import Layout
# The plan types live in the contract (a backend reads them); named here too, where the step builds them.
from dispatch.contract.plan import DecidedPlan, PagedPlan  # noqa: F401

if TYPE_CHECKING:
    from dispatch.deciding.dispatcher import Dispatcher


@dataclass(frozen=True)
class PagedBatch:
    """What an engine knows about a batch before the first layer runs; refused where built if it
    cannot occur. Checked here: the host-visible facts (types, shapes, dtypes, max_seq_len, next_n)
    and, when seq_lens is on the CPU, every request's length. Lengths on a GPU are not read: that
    would synchronise the host with the device on every batch."""

    seq_lens: torch.Tensor  # int32 [B]: each request's total length L, draft tokens included
    page_table: torch.Tensor  # int32 [B, M]: logical page -> physical KV block
    max_seq_len: int  # host-side bound on max(L); engines keep it on the host, so reading it costs no sync
    forward_mode: ForwardMode
    next_n: int  # tokens scored per request in this batch (1 + drafts when verifying)
    # Blocks in the engine's KV pool: every layer's kv_cache.shape[0] (engines slice layers out of one
    # pool). Given, the page table is checked against it once per batch, in build_plan; None defers that
    # to the first layer call, which reads it from that layer's cache (dispatch/contract/bounds.py).
    num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward_mode", parse_enum(ForwardMode, self.forward_mode, "forward_mode"))
        check_batch(self)


_LENGTH_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1  # the plan's lengths and the kernels' page entries are int32


def check_batch(batch: PagedBatch) -> None:
    """Every length L must hold the next_n tokens it scores (L >= next_n >= 1) and fit max_seq_len."""
    next_n, bound = batch.next_n, batch.max_seq_len
    if isinstance(next_n, bool) or not isinstance(next_n, int) or next_n < 1:
        raise InvalidBatchError(f"PagedBatch `next_n` is {next_n!r}; expected an integer >= 1")
    if not isinstance(batch.seq_lens, torch.Tensor) or batch.seq_lens.dim() != 1:
        raise InvalidBatchError(f"PagedBatch `seq_lens` is {_described(batch.seq_lens)}; expected an int32 tensor [B]")
    if batch.seq_lens.dtype not in _LENGTH_DTYPES:
        raise InvalidBatchError(f"PagedBatch `seq_lens` has dtype {batch.seq_lens.dtype}; expected torch.int32 (or int64)")
    size = batch.seq_lens.shape[0]
    if size == 0:
        raise InvalidBatchError("PagedBatch `seq_lens` is empty; a batch has at least one request")
    table = batch.page_table
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] != size:
        raise InvalidBatchError(
            f"PagedBatch `page_table` is {_described(table)}; expected an int32 tensor [B={size}, max_pages]"
        )
    if table.dtype != torch.int32:
        raise InvalidBatchError(f"PagedBatch `page_table` has dtype {table.dtype}; expected torch.int32")
    if table.device != batch.seq_lens.device:
        raise InvalidBatchError(
            f"PagedBatch `page_table` is on {table.device} and `seq_lens` on {batch.seq_lens.device}; expected one device"
        )
    bound_ok = not isinstance(bound, bool) and isinstance(bound, int)
    if bound_ok and batch.seq_lens.device.type == "cpu":
        _check_lengths(batch.seq_lens.tolist(), next_n, bound)  # first: these name the request at fault
    if not bound_ok or bound < next_n:
        raise InvalidBatchError(
            f"PagedBatch `max_seq_len` is {bound!r}; expected a host int >= next_n ({next_n}): every request's "
            "length includes the tokens it scores"
        )
    if bound > INT32_MAX:
        raise InvalidBatchError(f"PagedBatch `max_seq_len` is {bound}; the plan's lengths are int32 (at most {INT32_MAX})")
    blocks = batch.num_kv_blocks
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 <= blocks <= INT32_MAX):
        raise InvalidBatchError(
            f"PagedBatch `num_kv_blocks` is {blocks!r}; expected None or a host int in [0, {INT32_MAX}] (the "
            "pool's block count, every layer's kv_cache.shape[0])"
        )


def _check_lengths(lengths: list[int], next_n: int, bound: int) -> None:
    for request, length in enumerate(lengths):
        if length < next_n:
            raise InvalidBatchError(
                f"request {request} has seq_len {length}; every request's total length must be at least next_n "
                f"({next_n}), the tokens it scores in this batch (draft tokens included)"
            )
        if length > bound:
            raise InvalidBatchError(f"request {request} has seq_len {length}, above the batch's max_seq_len {bound}")


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


# The ops a batch's plan decides, per forward mode, in the order IndexerStep.select runs them. Paged
# batches (decode, target_verify, draft_extend) score the paged cache; extend batches score
# keys gathered into one buffer with the ragged kernel (dispatch/step/extend_plan.py). Adding an op to the
# indexer step means adding it here; its per-batch work is its backend's `prepare`, kept per op.
PAGED_STEP_OPS: tuple[Op, ...] = (Op.INDEXER_Q_QUANT, Op.PAGED_MQA_LOGITS, Op.TOPK)
EXTEND_STEP_OPS: tuple[Op, ...] = (Op.INDEXER_Q_QUANT, Op.RAGGED_MQA_LOGITS, Op.TOPK)
STEP_OPS = PAGED_STEP_OPS  # the paged step's, as before the extend path existed


def ops_for(mode: ForwardMode | str) -> tuple[Op, ...]:
    """The ops a batch of `mode` runs, so its plan decides exactly these (and explain, validate's
    callers and rank agreement ask for these): extend the ragged step, every other mode the paged one."""
    mode = mode if mode.__class__ is ForwardMode else ForwardMode(mode)  # (a plan's is parsed: no enum call)
    return EXTEND_STEP_OPS if mode is ForwardMode.EXTEND else PAGED_STEP_OPS


def decider(dispatcher: "Dispatcher", key: DispatchKey, pinned: dict[Op, str] | None, allow_disabled: bool,
            batch_size: int | None = None, max_seq_len: int | None = None):
    """decide(op) -> Decision for `key` and a batch of `batch_size` requests of at most `max_seq_len`
    keys: the pinned backend where `pinned` names one, else the rules' (with the measured band of that
    batch size and its length sub-band, where there are)."""
    pinned = pinned or {}

    def decide(op: Op) -> Decision:
        if op in pinned:
            return dispatcher.pin(op, key, pinned[op], allow_disabled=allow_disabled)
        return dispatcher.decide(op, key, batch_size=batch_size, max_seq_len=max_seq_len)

    return decide


def decide_ops(dispatcher: "Dispatcher", key: DispatchKey, ops: tuple[Op, ...], pinned: dict[Op, str] | None,
               allow_disabled: bool, batch_size: int | None = None,
               max_seq_len: int | None = None) -> Mapping[Op, Decision]:
    """Every op's decision for a plan: the dispatcher's cached mapping (Dispatcher.decide_ops) where
    nothing is pinned, else decider's, op by op."""
    if not pinned:
        return dispatcher.decide_ops(ops, key, batch_size=batch_size, max_seq_len=max_seq_len)
    decide = decider(dispatcher, key, pinned, allow_disabled, batch_size, max_seq_len)
    return {op: decide(op) for op in ops}


def prepare_states(decisions: Mapping[Op, Decision], plan: Any) -> dict[Op, Any]:
    """Each decided backend's per-batch state (its prepare(plan)), for those that have one."""
    return {
        op: call_backend(decision, plan, entry=decision.impl.prepare)
        for op, decision in decisions.items()
        if decision.impl.prepare is not None
    }


def visible_lengths(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Causal lengths [B, N]: token j of a request of total length L sees keys 0 .. L - N + j.

    int64 lengths are clamped into int32 before they narrow, so a length past 2^31 stays past every
    bound (the kernels flag it LENGTH_PAST_BOUND) instead of wrapping to a small one."""
    if seq_lens.dtype != torch.int32:  # (an int32 one is used as is: even a no-op `to` costs the host a call)
        seq_lens = seq_lens.clamp(-1, INT32_MAX).to(torch.int32)
    return (seq_lens[:, None] + _causal_offsets(next_n, seq_lens.device)).clamp_(min=0)


@functools.lru_cache(maxsize=64)
def _causal_offsets(next_n: int, device: torch.device) -> torch.Tensor:
    # Built once per (next_n, device): the plan is on every batch's host path.
    return torch.arange(1 - next_n, 1, device=device, dtype=torch.int32)


def layout_tensors(layout: Layout, seq_lens: torch.Tensor, page_table: torch.Tensor, next_n: int):
    """(context_lens, block_table) in `layout`, from per-request lengths and pages."""
    lens = visible_lengths(seq_lens, next_n)
    if layout is Layout.NATIVE:
        return lens, page_table
    if layout is Layout.FLATTEN:
        return lens.reshape(-1, 1), page_table.repeat_interleave(next_n, dim=0)
    raise LayoutError(f"layout `{layout.value}` is not a paged-logits layout")


def build_plan(
    dispatcher: "Dispatcher",
    batch: PagedBatch,
    *,
    kv_fp8_dtype: Fp8Dtype | torch.dtype,
    arch: Arch | str | None = None,
    pinned: dict[Op, str] | None = None,
    allow_disabled: bool = False,
    prepare: bool = True,
    band_seq_len: int | None = None,
) -> PagedPlan:
    """Decide every op of ops_for(batch.forward_mode) for this batch and build the decided layout's tensors. No host-device sync.

    `kv_fp8_dtype` is the K cache's fp8 dtype (a key name or the cache's torch dtype): it becomes the
    key's fp8_dtype, so Q is quantised into exactly the dtype the cache holds. `pinned` names a backend
    per op to use instead of the rules' choice (still checked for support and availability;
    `allow_disabled` lets a benchmark pin a backend the registry or a cluster disabled). `prepare=False`
    describes the plan without running any backend's per-batch prepare (`states` stays empty):
    explain does so, since a what-if for another machine must not need that machine's libraries.
    `band_seq_len` is the max_seq_len a measured length sub-band is picked by (default the batch's own):
    a captured graph's update passes the captured bound, so a replayed batch keeps the capture's choice.
    """
    if batch.forward_mode is ForwardMode.EXTEND:  # (parsed where the batch was built)
        raise LayoutError(
            "an extend batch is planned from an ExtendBatch (dispatch.step.extend_batch) through IndexerStep.plan or "
            "dispatch.step.extend_plan.build_extend_plan: its keys are gathered and scored ragged, not paged"
        )
    key = dispatch_key(arch or dispatcher.target_arch, batch.forward_mode, batch.next_n, key_fp8_dtype(kv_fp8_dtype))
    # The batch's declared size picks the measured band: seq_lens.shape[0] is the request count the
    # engine hands over (a host int, fixed per captured graph), not a path inferred from tensor values,
    # so deciding by it costs no sync and two batches of one size always decide alike.
    # Its declared max_seq_len, the host's bound on its longest request, picks the length sub-band
    # inside that band in the same way (the row width a top-k's speed depends on first).
    batch_size = batch.seq_lens.shape[0]
    decisions = decide_ops(dispatcher, key, ops_for(key.forward_mode), pinned, allow_disabled, batch_size,
                           batch.max_seq_len if band_seq_len is None else band_seq_len)
    logits = decisions[Op.PAGED_MQA_LOGITS]
    made = logits_plan_tensors(logits, batch) if prepare else None
    if made is None:
        context_lens, block_table = layout_tensors(logits.layout, batch.seq_lens, batch.page_table, batch.next_n)
        error_flags, states, readable = None, {}, None
    else:  # the lengths, the flags and the logits backend's state came from its one host call
        context_lens, block_table, error_flags = made.context_lens, batch.page_table, made.error_flags
        states, readable = {Op.PAGED_MQA_LOGITS: made.state}, made.readable_lengths
    plan = PagedPlan(
        key=key,
        decisions=decisions,
        batch_size=batch_size,
        next_n=batch.next_n,
        context_lens=context_lens,
        block_table=block_table,
        max_context_len=batch.max_seq_len,
        num_kv_blocks=batch.num_kv_blocks,
        page_rows=page_rows(logits.layout, batch_size, batch.next_n, batch.seq_lens.device),
        states=states,
        error_flags=error_flags,
        readable_lengths=readable,
    )
    if not prepare:
        return plan
    others = {op: decision for op, decision in decisions.items() if op not in states}
    # Filled in place, before the plan leaves here: a dataclasses.replace of the frozen plan costs a GPU
    # host ~5 us a batch.
    states.update(prepare_states(others, plan))
    return plan


def logits_plan_tensors(logits: Decision, batch: PagedBatch):
    """The decided logits backend's plan_tensors for this batch (PlanTensors), or None where it has none
    or cannot make them here; its own failures name it, as its prepare's do."""
    if logits.impl.plan_tensors is None or logits.layout is not Layout.NATIVE:
        return None
    return call_backend(logits, entry=logits.impl.plan_tensors, seq_lens=batch.seq_lens, page_table=batch.page_table,
                        next_n=batch.next_n, max_context_len=batch.max_seq_len, num_kv_blocks=batch.num_kv_blocks)


def dispatch_key(arch: Arch | str, forward_mode: ForwardMode | str, next_n: int, fp8_dtype: Fp8Dtype | str) -> DispatchKey:
    """DispatchKey(arch, forward_mode, next_n, fp8_dtype), built once per distinct value: its checks cost
    the host ~7 us, and a plan is built every batch. A value that cannot be hashed is checked afresh (the
    key's own checks name it)."""
    try:
        return _dispatch_key(arch, forward_mode, next_n, fp8_dtype)
    except TypeError:
        return DispatchKey(arch=arch, forward_mode=forward_mode, next_n=next_n, fp8_dtype=fp8_dtype)


@functools.lru_cache(maxsize=256, typed=True)  # typed: True and 1 are different next_n
def _dispatch_key(arch, forward_mode, next_n, fp8_dtype) -> DispatchKey:
    return DispatchKey(arch=arch, forward_mode=forward_mode, next_n=next_n, fp8_dtype=fp8_dtype)


def key_fp8_dtype(kv_fp8_dtype: Fp8Dtype | str | torch.dtype) -> Fp8Dtype | str:
    """The key's fp8 dtype from the K cache's (a key name, or the cache's torch dtype)."""
    if isinstance(kv_fp8_dtype, (Fp8Dtype, str)):
        return kv_fp8_dtype
    return fp8_dtype_of(kv_fp8_dtype, "the K cache")


@functools.lru_cache(maxsize=64)
def page_rows(layout: Layout, batch_size: int, next_n: int, device: torch.device) -> torch.Tensor:
    """int32 [B*N]: which row of the layout's block table holds token r's pages (native: r // N, one
    row per request; flatten: r). Cached: it depends only on the shape, and graphs replay it as is."""
    tokens = torch.arange(batch_size * next_n, device=device, dtype=torch.int32)
    return tokens // next_n if layout is Layout.NATIVE else tokens
