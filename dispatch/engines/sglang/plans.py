"""dispatch's plan for an SGLang forward batch, built from SGLang's own DSAMetadata once per batch
and kept beside it: every layer's indexer call finds the plan its batch's metadata was given.

The forward mode and next_n come from SGLang's batch (its forward mode, its speculative draft count),
never from a tensor's shape; the shapes are then checked against them. A CUDA-graph replay refills the
captured metadata object in place, and its plan is refilled in place too (refresh_captured_plan)."""

from __future__ import annotations

import weakref

import torch

from dispatch.contract.errors import LayoutError
from dispatch.step.extend_plan import ExtendPlan
from dispatch.engines.graphs import refresh_captured_plan
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch, PagedPlan, build_plan
from dispatch.step.extend_batch import ExtendBatch

PAGE_SIZE = 64  # SGLang's DSA pages (its indexer asserts it on CUDA), dispatch's BLOCK_KV


def dispatch_mode(sglang_mode) -> ForwardMode:
    """SGLang's ForwardMode -> dispatch's, for the modes whose indexer call the plugin replaces."""
    if sglang_mode.is_decode_or_idle():
        return ForwardMode.DECODE
    if sglang_mode.is_target_verify():
        return ForwardMode.TARGET_VERIFY
    if sglang_mode.is_draft_extend_v2():
        return ForwardMode.DRAFT_EXTEND
    if sglang_mode.is_extend_without_speculative():
        return ForwardMode.EXTEND
    raise LayoutError(f"SGLang forward mode {sglang_mode.name} has no dispatch indexer step")


def check_served(metadata) -> None:
    """The plugin serves SGLang's plain index cache; KPool (pooled index keys) has another layout."""
    if getattr(metadata, "pooled_index_kpool", 1) > 1:
        raise LayoutError(
            f"SGLang's metadata pools index keys (pooled_index_kpool={metadata.pooled_index_kpool}); the dispatch "
            "plugin serves --dsa-index-kpool 1 only: leave `dispatch` out of SGLANG_PLUGINS for this model"
        )


def paged_batch(metadata, mode: ForwardMode, next_n: int) -> PagedBatch:
    """The paged batch SGLang's DSAMetadata describes. cache_seqlens_int32 [B] is each request's total
    length (drafts included), and real_page_table its 64-token pages: one row per request in decode,
    repeated next_n times per request (SGLang expands it per token) in target_verify / draft_extend."""
    check_served(metadata)
    seq_lens = metadata.cache_seqlens_int32
    table = metadata.real_page_table
    batch_size = seq_lens.shape[0]
    rows_per_request = 1 if mode is ForwardMode.DECODE else next_n
    if table.shape[0] != batch_size * rows_per_request:
        raise LayoutError(
            f"SGLang's real_page_table has {table.shape[0]} rows; a {mode.value} batch of {batch_size} requests "
            f"at next_n {next_n} has {batch_size * rows_per_request}"
        )
    if rows_per_request > 1:
        table = table[::rows_per_request]
    return PagedBatch(
        seq_lens=seq_lens,
        page_table=table.to(torch.int32).contiguous(),  # a per-batch copy of [B, pages] when strided
        # The logits' width, as SGLang's own _get_topk_paged sets it (a host int: no sync).
        max_seq_len=max(table.shape[1] * PAGE_SIZE, next_n),
        forward_mode=mode,
        next_n=next_n,
    )


def extend_batch(metadata, forward_batch) -> ExtendBatch:
    """The extend batch: host prefix and new-token counts (SGLang keeps both on the host) and the
    logical 64-token page table."""
    check_served(metadata)
    prefix = forward_batch.extend_prefix_lens_cpu
    extend = forward_batch.extend_seq_lens_cpu
    table = metadata.indexer_logical_page_table
    if table is None:
        table = metadata.real_page_table
    return ExtendBatch.from_lengths(list(prefix), list(extend), table.to(torch.int32), block_kv=PAGE_SIZE)


class PlanTable:
    """Plans by the identity of the DSAMetadata they were built from (a weak reference: a batch's
    plan goes when SGLang drops its metadata). DSAMetadata is an unhashable frozen dataclass, hence ids."""

    def __init__(self) -> None:
        self._plans: dict[int, tuple[weakref.ref, PagedPlan | ExtendPlan]] = {}

    def get(self, metadata) -> PagedPlan | ExtendPlan | None:
        entry = self._plans.get(id(metadata))
        if entry is None or entry[0]() is not metadata:
            return None
        return entry[1]

    def put(self, metadata, plan) -> None:
        key = id(metadata)
        self._plans[key] = (weakref.ref(metadata, lambda _ref, key=key: self._plans.pop(key, None)), plan)


PLANS = PlanTable()


def plan_paged(step, metadata, sglang_mode, next_n: int) -> PagedPlan | None:
    """The plan for this metadata: built once, or, for a metadata object refilled in place (a CUDA
    graph's static metadata on replay), the captured plan refilled in place. None for an empty batch."""
    if metadata.cache_seqlens_int32.shape[0] == 0:
        return None
    batch = paged_batch(metadata, dispatch_mode(sglang_mode), next_n)
    captured = PLANS.get(metadata)
    if captured is None:
        fresh = step.plan(batch)
        PLANS.put(metadata, fresh)
        return fresh
    # Decided at the captured bound, as CapturedIndexerStep.update does: the capture's length sub-band.
    fresh = build_plan(step.dispatcher, batch, kv_fp8_dtype=step.kv_fp8_dtype, band_seq_len=captured.max_context_len)
    refresh_captured_plan(captured, batch, fresh)
    return captured


def plan_extend(step, metadata, forward_batch) -> ExtendPlan:
    plan = PLANS.get(metadata)
    if plan is None:
        plan = step.plan(extend_batch(metadata, forward_batch))
        PLANS.put(metadata, plan)
    return plan
