"""The page guard: the bounds checks of the paged logits kernels, made once per batch instead of per layer.

The page table, the lengths and max_context_len belong to the batch, and every layer's cache is a slice
of one pool with the same num_blocks, so the logits backends (Triton and DeepGEMM) run this guard in
their per-batch `prepare` and every layer's kernel reads what it wrote. One launch, one program per
row, no host-device sync. It writes
- safe_table int32 [R, pages]: the row's table entries within the logits' width; an entry outside
  [0, num_blocks) becomes block 0, so a kernel that follows any entry stays inside the cache;
- lens int32 [R, N]: the length a kernel masks with: the token's own length, or -1 for a poisoned token
  (one that needs an out-of-range page, or whose length passes max_context_len). -1 is below every
  column, so the one select that writes -inf past a length covers the whole poisoned row, and the
  kernel learns about the poison from the word it loads anyway (no poison load, no second select);
- fill fp32 [R * N]: what masked positions get: -inf, or NaN for a poisoned token;
- BAD_PAGE / LENGTH_PAST_BOUND into the plan's error flags.

A token needs logical pages [0, ceil(len / block_kv)); entries past those are padding and may hold
anything. A poisoned token reads no page at all: the Triton kernel's page loop stops at the longest
unpoisoned length of its program's tokens.

The pool size: PagedBatch.num_kv_blocks when the engine passes it (the guard then runs in build_plan);
otherwise the first layer call's kv_cache.shape[0] (the guard runs then, once, and the plan keeps it).
Every layer call checks on the host, for free, that its cache holds at least that many blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from dispatch.contract import BAD_PAGE, BLOCK_KV, LENGTH_PAST_BOUND, GraphMismatchError, LayoutError

if TYPE_CHECKING:
    from dispatch.contract import PagedPlan

SCAN_PAGES = 128  # table entries per step of a row's scan


@triton.jit
def _page_guard_kernel(
    ctx_ptr,  # int32 [R, N]
    table_ptr,  # int32 [R, M], M >= pages
    safe_table_ptr,  # int32 [R, pages], contiguous
    lens_ptr,  # int32 [R, N], contiguous: the length to mask with; -1 for a poisoned token
    fill_ptr,  # fp32 [R * N]: what masked positions get; NaN for a poisoned token
    error_flags_ptr,  # int32 [1]
    num_blocks,  # a table entry must lie in [0, num_blocks)
    max_context_len,
    pages,  # ceil(max_context_len / BLOCK_KV): the table columns a kernel may read
    stride_ctx_row,
    stride_table_row,
    N: tl.constexpr,
    N_BLOCK: tl.constexpr,  # N rounded up to a power of two
    BLOCK_KV: tl.constexpr,
    SCAN_PAGES: tl.constexpr,
    BAD_PAGE: tl.constexpr,
    LENGTH_PAST_BOUND: tl.constexpr,
):
    row = tl.program_id(0)
    tok = tl.arange(0, N_BLOCK)
    tok_ok = tok < N
    ctx = tl.load(ctx_ptr + row * stride_ctx_row + tok, mask=tok_ok, other=0)
    needed = tl.minimum(tl.cdiv(tl.maximum(ctx, 0), BLOCK_KV), pages)
    first_bad = tl.full((SCAN_PAGES,), 2**30, tl.int32)  # per lane, the lowest out-of-range page seen
    for first in range(0, pages, SCAN_PAGES):
        page = first + tl.arange(0, SCAN_PAGES)
        in_width = page < pages
        entry = tl.load(table_ptr + row * stride_table_row + page, mask=in_width, other=0)
        out_of_range = (entry < 0) | (entry >= num_blocks)
        tl.store(safe_table_ptr + row * pages + page, tl.where(out_of_range, 0, entry), mask=in_width)
        first_bad = tl.minimum(first_bad, tl.where(out_of_range, page, 2**30))
    page_fault = (needed > tl.min(first_bad, axis=0)).to(tl.int32)  # [N_BLOCK]: the token needs a bad page
    past_bound = tok_ok & (ctx > max_context_len)
    poisoned = tok_ok & ((page_fault > 0) | past_bound)
    tl.store(lens_ptr + row * N + tok, tl.where(poisoned, -1, ctx), mask=tok_ok)
    tl.store(fill_ptr + row * N + tok, tl.where(poisoned, float("nan"), float("-inf")), mask=tok_ok)
    flags = tl.where(tl.max(page_fault, axis=0) > 0, BAD_PAGE, 0)
    flags |= tl.where(tl.max(past_bound.to(tl.int32), axis=0) > 0, LENGTH_PAST_BOUND, 0)
    tl.atomic_or(error_flags_ptr, flags, mask=flags != 0)


@dataclass(eq=False)
class PageGuard:
    """One batch's guard: its inputs (the plan's tensors, read at each launch), its outputs (written in
    place, so a captured CUDA graph keeps reading them) and the pool size it guarded against."""

    context_lens: torch.Tensor  # int32 [R, N]: the plan's
    block_table: torch.Tensor  # int32 [R, M]: the plan's
    max_context_len: int
    error_flags: torch.Tensor  # int32 [1]: the plan's
    block_kv: int
    safe_table: torch.Tensor  # int32 [R, pages]
    lens: torch.Tensor  # int32 [R, N]
    fill: torch.Tensor  # fp32 [R * N]
    num_blocks: int | None = None  # None until a launch: the pool size every layer's cache must cover

    @classmethod
    def allocate(
        cls,
        context_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_context_len: int,
        error_flags: torch.Tensor,
        block_kv: int = BLOCK_KV,
    ) -> "PageGuard":
        rows, next_n = context_lens.shape
        pages = triton.cdiv(max_context_len, block_kv)
        if block_table.shape[1] < pages:
            raise LayoutError(
                f"block_table has {block_table.shape[1]} pages of {block_kv}, fewer than "
                f"max_context_len={max_context_len} needs"
            )
        device = context_lens.device
        return cls(
            context_lens=context_lens,
            block_table=block_table,
            max_context_len=max_context_len,
            error_flags=error_flags,
            block_kv=block_kv,
            safe_table=torch.empty((rows, pages), dtype=torch.int32, device=device),
            lens=torch.empty((rows, next_n), dtype=torch.int32, device=device),
            fill=torch.empty(rows * next_n, dtype=torch.float32, device=device),
        )

    def launch(self, num_blocks: int) -> None:
        """Guard the current contents of the plan's lens and table against a pool of `num_blocks`."""
        arguments, constants = self.kernel_arguments(num_blocks)
        if self.context_lens.shape[0] == 0:
            return
        _page_guard_kernel[(self.context_lens.shape[0],)](*arguments, **constants)

    def kernel_arguments(self, num_blocks: int) -> tuple[tuple, dict]:
        """The guard body's arguments, in _page_guard_kernel's order, and its constexprs, for a pool of
        `num_blocks` (checked, and kept as the pool every layer's cache must cover). One list for the
        guard's own launch and for the kernels that run its body beside another's (guard_and_schedule)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise LayoutError(f"num_kv_blocks must be a host int >= 0; got {num_blocks!r}")
        self.num_blocks = num_blocks
        next_n = self.context_lens.shape[1]
        arguments = (self.context_lens, self.block_table, self.safe_table, self.lens, self.fill, self.error_flags,
                     num_blocks, self.max_context_len, self.safe_table.shape[1], self.context_lens.stride(0),
                     self.block_table.stride(0))
        constants = dict(N=next_n, N_BLOCK=triton.next_power_of_2(next_n), BLOCK_KV=self.block_kv,
                         SCAN_PAGES=SCAN_PAGES, BAD_PAGE=BAD_PAGE, LENGTH_PAST_BOUND=LENGTH_PAST_BOUND)
        return arguments, constants

    def for_cache(self, kv_cache: torch.Tensor) -> "PageGuard":
        """Per layer, host-side only (shapes): guard now if the pool size was not known at plan time, and
        refuse a cache smaller than the pool the table was checked against."""
        blocks, block_kv = kv_cache.shape[0], kv_cache.shape[1]
        if block_kv != self.block_kv:
            raise LayoutError(f"kv_cache has pages of {block_kv} tokens; the plan's page guard used {self.block_kv}")
        if self.num_blocks is None:
            self.launch(blocks)
        elif blocks < self.num_blocks:
            raise LayoutError(
                f"kv_cache has {blocks} blocks, fewer than the pool of {self.num_blocks} the batch's page table "
                "was checked against (PagedBatch.num_kv_blocks, or the first layer's cache): every layer's "
                "cache must hold the whole pool"
            )
        return self

    def refresh(self, fresh_num_blocks: int | None) -> None:
        """After dispatch.engines.graphs has copied a new batch's lens and table into the plan's tensors: guard
        them again, into the same outputs. The captured graph's cache was checked against this guard's
        pool, and a replay makes no layer call that could check again, so the pool must not change."""
        bound = self.refresh_bound(fresh_num_blocks)
        if bound is not None:  # else the next layer call guards (for_cache)
            self.launch(bound)

    def refresh_bound(self, fresh_num_blocks: int | None) -> int | None:
        """The pool a refresh guards against (None: not known yet); GraphMismatchError if it changed."""
        if fresh_num_blocks is not None and self.num_blocks is not None and fresh_num_blocks != self.num_blocks:
            raise GraphMismatchError(
                f"the batch's pool has num_kv_blocks={fresh_num_blocks}; the graph's cache was checked "
                f"against {self.num_blocks}"
            )
        return self.num_blocks if self.num_blocks is not None else fresh_num_blocks


def guard_pages(
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_blocks: int,
    max_context_len: int,
    block_kv: int,
    error_flags: torch.Tensor,
) -> PageGuard:
    """Allocate and launch at once: for a direct kernel call that has no plan to keep a guard in."""
    guard = PageGuard.allocate(context_lens, block_table, max_context_len, error_flags, block_kv)
    guard.launch(num_blocks)
    return guard


def prepare_page_guard(plan: "PagedPlan") -> PageGuard:
    """A logits backend's per-batch state: the guard over the plan's lens and table, launched now when the
    engine told the plan its pool size (plan.num_kv_blocks), else at the first layer call."""
    guard = PageGuard.allocate(plan.context_lens, plan.block_table, plan.max_context_len, plan.error_flags)
    if plan.num_kv_blocks is not None:
        guard.launch(plan.num_kv_blocks)
    return guard

