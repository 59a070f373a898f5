"""The Triton paged logits kernel's length-balanced schedule, built once per batch (as DeepGEMM's metadata is).

The kernel is persistent: P programs (a few per SM) each own one contiguous range of the batch's work,
in the order (work row, page), where a work row is one row's group of up to TG tokens (rows x
ceil(N / TG) of them) and a page is one 64-key page of the output's width. A page below the work row's
longest length is computed (its keys read, scored and written); a page past it is only filled with
-inf. The schedule weighs them (COMPUTE_COST and FILL_COST) and cuts the batch's total cost into P
equal shares, so a batch of a few long rows and many short ones keeps every program busy for the same
time, and a short batch spreads over the whole GPU instead of a handful of fixed-size splits.

    bounds int32 [P + 1, 2]: program p owns positions [bounds[p], bounds[p + 1]) in (work row, page)
    order; bounds[0] = (0, 0), bounds[P] = (work rows - 1, pages).

One launch of one program, no host-device sync: an exclusive prefix sum of the work rows' costs, then a
binary search per program boundary. The costs come from the plan's own lengths, clamped to the
output's width, so garbage lengths can only unbalance the schedule, never send the kernel out of its
tensors: the kernel itself masks with the page guard's lengths and reads no page past them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dispatch.contract import LayoutError, triton_interpreter_on

# Relative cost of a page that is scored (8.4 KB of keys read, a dot, TG x 256 B written) and of one
# only filled with -inf (TG x 256 B written). The ratio need not be exact: it only moves the cuts.
COMPUTE_COST = 16
FILL_COST = 1
ROWS_PER_STEP = 1024  # work rows per step of the prefix sum
BOUNDS_PER_STEP = 512  # program boundaries per step of the search


@triton.jit
def _schedule_kernel(
    lens_ptr,  # int32 [R, N]: the plan's lengths (any values: clamped to [0, width])
    stride_lens_row,
    cost_prefix_ptr,  # int64 [V]: scratch, the exclusive prefix sum of the work rows' costs
    work_pages_ptr,  # int32 [V]: scratch, each work row's computed pages
    bounds_ptr,  # int32 [P + 1, 2]: the result
    num_work_rows,  # V = R * ceil(N / TG)
    pages,  # ceil(width / BLOCK_KV): every work row's positions
    programs,  # P
    search_steps,  # ceil(log2(V)) + 1
    N: tl.constexpr,
    TG: tl.constexpr,
    GROUPS: tl.constexpr,  # ceil(N / TG)
    BLOCK_KV: tl.constexpr,
    COMPUTE_COST: tl.constexpr,
    FILL_COST: tl.constexpr,
    ROWS_PER_STEP: tl.constexpr,
    BOUNDS_PER_STEP: tl.constexpr,
):
    # Costs and their exclusive prefix sum, carried across steps, in int64: the product below
    # (p * total) needs 64 bits, and a very wide, very large batch passes 2^31 cost units.
    carry = tl.zeros((), tl.int64)
    for first in range(0, num_work_rows, ROWS_PER_STEP):
        work_row = first + tl.arange(0, ROWS_PER_STEP)
        live = work_row < num_work_rows
        row = work_row // GROUPS
        tok = (work_row % GROUPS)[:, None] * TG + tl.arange(0, TG)[None, :]
        length = tl.load(lens_ptr + row[:, None] * stride_lens_row + tok, mask=live[:, None] & (tok < N), other=0)
        longest = tl.max(tl.minimum(tl.maximum(length, 0), pages * BLOCK_KV), axis=1)
        computed = tl.cdiv(longest, BLOCK_KV)
        cost = tl.where(live, computed * COMPUTE_COST + (pages - computed) * FILL_COST, 0).to(tl.int64)
        inclusive = tl.cumsum(cost, axis=0) + carry
        tl.store(cost_prefix_ptr + work_row, inclusive - cost, mask=live)
        tl.store(work_pages_ptr + work_row, computed, mask=live)
        carry += tl.sum(cost, axis=0)
    # The stores above are read back below by other threads of this program.
    tl.debug_barrier()
    total = carry
    for first in range(0, programs + 1, BOUNDS_PER_STEP):
        p = first + tl.arange(0, BOUNDS_PER_STEP)
        live = p <= programs
        target = (p.to(tl.int64) * total) // programs
        # The last work row whose prefix is <= target: prefixes strictly rise (every row costs at
        # least `pages` fill units) and the first is 0, so `lo` always holds a row at or below it.
        lo = tl.zeros((BOUNDS_PER_STEP,), tl.int32)
        hi = tl.full((BOUNDS_PER_STEP,), 0, tl.int32) + num_work_rows
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            open_ = hi - lo > 1
            prefix = tl.load(cost_prefix_ptr + mid, mask=open_ & live, other=0)
            below = prefix <= target
            lo = tl.where(open_ & below, mid, lo)
            hi = tl.where(open_ & ~below, mid, hi)
        into = target - tl.load(cost_prefix_ptr + lo, mask=live, other=0)
        computed = tl.load(work_pages_ptr + lo, mask=live, other=0).to(tl.int64)
        # The first page whose cost-before reaches the target: computed pages first, then fill pages.
        computed_cost = computed * COMPUTE_COST
        page = tl.where(into <= computed_cost, tl.cdiv(into, COMPUTE_COST),
                        computed + tl.cdiv(into - computed_cost, FILL_COST))
        page = tl.minimum(page, pages).to(tl.int32)
        tl.store(bounds_ptr + p * 2, lo, mask=live)
        tl.store(bounds_ptr + p * 2 + 1, page, mask=live)


@dataclass(eq=False)
class PagedSchedule:
    """One batch's schedule: its input (the plan's lens, read at each launch) and outputs, written in
    place so a captured CUDA graph keeps reading them."""

    context_lens: torch.Tensor  # int32 [R, N]: the plan's
    tokens: int  # TG: tokens of one row per work row
    width: int  # the output's columns (max_context_len)
    block_kv: int
    bounds: torch.Tensor  # int32 [P + 1, 2]
    cost_prefix: torch.Tensor  # int64 [V], scratch
    work_pages: torch.Tensor  # int32 [V], scratch

    @property
    def programs(self) -> int:
        return self.bounds.shape[0] - 1

    @classmethod
    def allocate(cls, context_lens: torch.Tensor, tokens: int, programs: int, width: int, block_kv: int) -> "PagedSchedule":
        if programs < 1:
            raise LayoutError(f"a paged schedule needs at least one program; got {programs}")
        rows, next_n = context_lens.shape
        work_rows = rows * triton.cdiv(next_n, tokens)
        device = context_lens.device
        return cls(
            context_lens=context_lens,
            tokens=tokens,
            width=width,
            block_kv=block_kv,
            bounds=torch.empty((programs + 1, 2), dtype=torch.int32, device=device),
            cost_prefix=torch.empty(max(work_rows, 1), dtype=torch.int64, device=device),
            work_pages=torch.empty(max(work_rows, 1), dtype=torch.int32, device=device),
        )

    def launch(self) -> None:
        """Cut the current contents of the plan's lens into the schedule's programs."""
        rows, next_n = self.context_lens.shape
        groups = triton.cdiv(next_n, self.tokens)
        work_rows = rows * groups
        pages = triton.cdiv(self.width, self.block_kv)
        if work_rows == 0 or pages == 0:
            return  # no output: the kernel is not launched
        _schedule_kernel[(1,)](
            self.context_lens,
            self.context_lens.stride(0),
            self.cost_prefix,
            self.work_pages,
            self.bounds,
            work_rows,
            pages,
            self.programs,
            max(work_rows - 1, 1).bit_length() + 1,
            N=next_n,
            TG=self.tokens,
            GROUPS=groups,
            BLOCK_KV=self.block_kv,
            COMPUTE_COST=COMPUTE_COST,
            FILL_COST=FILL_COST,
            ROWS_PER_STEP=ROWS_PER_STEP,
            BOUNDS_PER_STEP=BOUNDS_PER_STEP,
            num_warps=4,
        )

    def matches(self, context_lens: torch.Tensor, tokens: int, width: int, block_kv: int) -> bool:
        """Host-side: whether this schedule was built for a call of these shapes."""
        return (tuple(self.context_lens.shape) == tuple(context_lens.shape) and self.tokens == tokens
                and self.width == width and self.block_kv == block_kv and self.bounds.device == context_lens.device)


def schedule_pages(context_lens: torch.Tensor, tokens: int, programs: int, width: int, block_kv: int) -> PagedSchedule:
    """Allocate and launch at once."""
    schedule = PagedSchedule.allocate(context_lens, tokens, programs, width, block_kv)
    schedule.launch()
    return schedule


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def program_count(device: torch.device, programs_per_sm: int) -> int:
    """The persistent grid: programs_per_sm on every SM; on the interpreter (one CPU 'SM'),
    programs_per_sm itself, so tests choose how many boundaries a batch gets."""
    if device.type != "cuda" or triton_interpreter_on():
        return programs_per_sm
    return programs_per_sm * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
