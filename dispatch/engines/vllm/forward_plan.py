"""dispatch's plans for one vLLM forward, built from vLLM's own indexer metadata
(`DeepseekV32IndexerMetadata`, made by `DeepseekV32IndexerMetadataBuilder.build`) once per forward.

vLLM orders a forward's requests decodes first: tokens [0, num_decode_tokens) are the decode part,
the rest (vLLM's prefills) the extend part. The decode part becomes one paged plan (a PagedBatch of the decode
requests' total lengths and page-table rows: dispatch, not vLLM's start-up flag, decides native or
flatten). The extend part becomes one extend plan per group of vLLM's prefill chunks: a chunk of whole
requests is a group; a request vLLM split over several query chunks (its logits alone pass vLLM's
budget: the later chunks carry `skip_kv_gather`) is one group, re-chunked by dispatch's own budget.
Everything read on the host is a host value vLLM keeps (counts, `max_seq_len`, `total_seq_lens`,
`token_start/end`, `decode_is_uniform`); every tensor op is on the device: no host-device sync."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dispatch.deciding.dispatcher import Dispatcher
from dispatch.step.extend_plan import ExtendPlan, build_extend_plan
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch, PagedPlan, build_plan
from dispatch.step.extend_batch import DEFAULT_LOGITS_BYTES, ExtendBatch


@dataclass(frozen=True)
class ExtendPart:
    """One extend plan and the forward's token rows it serves."""

    rows: slice
    plan: ExtendPlan


@dataclass(frozen=True, eq=False)
class ForwardPlans:
    """Every plan of one forward; `metadata` is the vLLM object they were built from."""

    metadata: Any
    decode: PagedPlan | None
    decode_tokens: int
    extend_parts: tuple[ExtendPart, ...]

    @property
    def plans(self) -> tuple[PagedPlan | ExtendPlan, ...]:
        return ((self.decode,) if self.decode is not None else ()) + tuple(p.plan for p in self.extend_parts)


def not_served(metadata: Any) -> str | None:
    """Why dispatch cannot plan this forward from vLLM's metadata, or None when it can. Decided from
    host values only; the caller hands such a forward to vLLM's own function, whole."""
    if metadata.num_decodes > 0:
        decode = metadata.decode
        if not decode.decode_is_uniform:
            return "decode requests of unequal query lengths (vLLM's padded path)"
        if metadata.num_decodes * decode.write_max_decode_len != metadata.num_decode_tokens:
            return "decode tokens are not num_decodes x next_n"
        if metadata.block_table is None:
            return "the metadata carries no per-request block table"
    if metadata.num_prefills > 0:
        for chunk in metadata.prefill.chunks:
            if chunk.pcp_deinterleave_idx is not None or chunk.local_cu_seq_lens is not chunk.cu_seq_lens:
                return "prefill under decode/prefill context parallelism"
        if metadata.prefill.row_shard_sizes is not None:
            return "prefill rows sharded over tensor-parallel ranks"
    return None


def build_forward_plans(
    dispatcher: Dispatcher,
    metadata: Any,
    *,
    kv_fp8_dtype: torch.dtype,
    num_kv_blocks: int,
    block_kv: int,
    logits_byte_budget: int = DEFAULT_LOGITS_BYTES,
) -> ForwardPlans:
    """The forward's plans (call not_served first: this assumes it returned None)."""
    decode = None
    if metadata.num_decodes > 0:
        decode = build_plan(dispatcher, decode_batch(metadata, num_kv_blocks), kv_fp8_dtype=kv_fp8_dtype)
    extend_parts = ()
    if metadata.num_prefills > 0:
        extend_parts = tuple(
            ExtendPart(rows, build_extend_plan(dispatcher, batch, kv_fp8_dtype=kv_fp8_dtype,
                                                logits_byte_budget=logits_byte_budget))
            for rows, batch in extend_batches(metadata.prefill.chunks, block_kv)
        )
    return ForwardPlans(metadata, decode, metadata.num_decode_tokens, extend_parts)


def decode_batch(metadata: Any, num_kv_blocks: int) -> PagedBatch:
    """The decode requests as a PagedBatch: vLLM's per-request total lengths and block-table rows
    (the builder's own inputs, before it expands them for its native or flatten kernel)."""
    requests, next_n = metadata.num_decodes, metadata.decode.write_max_decode_len
    return PagedBatch(
        seq_lens=metadata.seq_lens[:requests],
        page_table=metadata.block_table[:requests],
        max_seq_len=metadata.max_seq_len,
        forward_mode=ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY,
        next_n=next_n,
        num_kv_blocks=num_kv_blocks,
    )


def chunk_groups(chunks: list[Any]) -> list[list[Any]]:
    """vLLM's prefill chunks grouped so that no request is split: a chunk with `skip_kv_gather`
    continues the previous chunk's request (vLLM reuses the gathered K for it)."""
    groups: list[list[Any]] = []
    for chunk in chunks:
        if chunk.skip_kv_gather and groups:
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return groups


def extend_batches(chunks: list[Any], block_kv: int) -> list[tuple[slice, ExtendBatch]]:
    """(token rows, ExtendBatch) per chunk group. Request r of a group has
    cu_seq_lens[r + 1] - cu_seq_lens[r] keys in all (its prefix and its new tokens); its new tokens are
    the group's rows whose first key cu_seqlen_ks is cu_seq_lens[r]."""
    batches = []
    for group in chunk_groups(chunks):
        first, last = group[0], group[-1]
        rows = slice(first.token_start, last.token_end)
        cu = first.cu_seq_lens
        requests = first.num_reqs
        if len(group) > 1 or requests == 1:  # one request: all the group's rows are its new tokens
            extend = torch.full((1,), rows.stop - rows.start, dtype=torch.int32, device=cu.device)
        else:
            owner = torch.searchsorted(cu, first.cu_seqlen_ks, right=True).to(torch.int32) - 1
            extend = torch.zeros(requests, dtype=torch.int32, device=cu.device)
            extend.index_add_(0, owner, torch.ones_like(owner))
        total = (cu[1:] - cu[:-1]).to(torch.int32)
        batches.append((rows, ExtendBatch(
            prefix_lens=total - extend,
            extend_lens=extend,
            page_table=first.block_table,
            total_tokens=rows.stop - rows.start,
            total_keys=first.total_seq_lens,
            block_kv=block_kv,
        )))
    return batches
