"""The Triton paged backend's per-batch GPU work in one launch: the page guard (one program per row) and
the length-balanced schedule (one program) as programs of a single grid, instead of two launches.

They are independent: the schedule reads the plan's lengths, which the guard only reads too (it writes
its own outputs), so running them side by side computes exactly what the two launches do one after the
other. Programs [0, R) run the guard's body for their row (the guard kernel reads its row from the
program id), program R runs the schedule's. The bodies are backends/shared/page_guard.py's and
backends/triton/paged_schedule.py's kernels, called as device functions: one source for each.

Where the pool size is unknown at prepare (the engine did not pass num_kv_blocks), the guard must wait
for the first layer call's cache; the schedule then launches alone and the guard at that call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from backends.shared.page_guard import PageGuard, _page_guard_kernel
from backends.triton.paged_mqa_logits import default_config, work_row_tokens
from backends.triton.paged_schedule import (BOUNDS_PER_STEP, COMPUTE_COST, FILL_COST, ROWS_PER_STEP, PagedSchedule,
                                            _schedule_kernel, program_count)
from dispatch.contract import LayoutError

if TYPE_CHECKING:
    from dispatch.contract import PagedPlan


@triton.jit
def _guard_and_schedule_kernel(
    ctx_ptr, table_ptr, safe_table_ptr, lens_ptr, fill_ptr, error_flags_ptr,
    num_blocks, max_context_len, guard_pages, stride_ctx_row, stride_table_row,
    cost_prefix_ptr, work_pages_ptr, bounds_ptr, num_work_rows, schedule_pages, programs, search_steps,
    guard_rows,  # R: programs [0, R) guard a row each; program R schedules
    N: tl.constexpr, N_BLOCK: tl.constexpr, BLOCK_KV: tl.constexpr, SCAN_PAGES: tl.constexpr,
    BAD_PAGE: tl.constexpr, LENGTH_PAST_BOUND: tl.constexpr,
    TG: tl.constexpr, GROUPS: tl.constexpr, COMPUTE_COST: tl.constexpr, FILL_COST: tl.constexpr,
    ROWS_PER_STEP: tl.constexpr, BOUNDS_PER_STEP: tl.constexpr,
):
    if tl.program_id(0) < guard_rows:
        _page_guard_kernel(ctx_ptr, table_ptr, safe_table_ptr, lens_ptr, fill_ptr, error_flags_ptr, num_blocks,
                           max_context_len, guard_pages, stride_ctx_row, stride_table_row, N, N_BLOCK, BLOCK_KV,
                           SCAN_PAGES, BAD_PAGE, LENGTH_PAST_BOUND)
    else:
        _schedule_kernel(ctx_ptr, stride_ctx_row, cost_prefix_ptr, work_pages_ptr, bounds_ptr, num_work_rows,
                         schedule_pages, programs, search_steps, N, TG, GROUPS, BLOCK_KV, COMPUTE_COST, FILL_COST,
                         ROWS_PER_STEP, BOUNDS_PER_STEP)


def allocate_schedule(context_lens: torch.Tensor, max_context_len: int, block_kv: int) -> PagedSchedule:
    """paged_mqa_logits.schedule_for's schedule (the default config's), allocated but not yet cut."""
    next_n = context_lens.shape[1]
    config = default_config(next_n, context_lens.device)
    programs = program_count(context_lens.device, config.programs_per_sm)
    return PagedSchedule.allocate(context_lens, work_row_tokens(config, next_n), programs, max_context_len, block_kv)


def launch_guard_and_schedule(guard: PageGuard, schedule: PagedSchedule, num_blocks: int) -> None:
    """Guard the plan's lens and table against a pool of `num_blocks` and cut the schedule: one launch
    (what guard.launch(num_blocks) then schedule.launch() compute)."""
    if schedule.context_lens is not guard.context_lens or schedule.block_kv != guard.block_kv:
        raise LayoutError("the page guard and the schedule must be over the same lens and page size")
    rows, next_n = guard.context_lens.shape
    groups = triton.cdiv(next_n, schedule.tokens)
    work_rows = rows * groups
    pages = triton.cdiv(schedule.width, schedule.block_kv)
    if rows == 0 or work_rows == 0 or pages == 0:  # one of the two has nothing to do: the other alone
        guard.launch(num_blocks)
        schedule.launch()
        return
    guard_arguments, guard_constants = guard.kernel_arguments(num_blocks)
    _guard_and_schedule_kernel[(rows + 1,)](
        *guard_arguments,
        schedule.cost_prefix, schedule.work_pages, schedule.bounds, work_rows, pages, schedule.programs,
        max(work_rows - 1, 1).bit_length() + 1,
        rows,
        **guard_constants,
        TG=schedule.tokens, GROUPS=groups, COMPUTE_COST=COMPUTE_COST, FILL_COST=FILL_COST,
        ROWS_PER_STEP=ROWS_PER_STEP, BOUNDS_PER_STEP=BOUNDS_PER_STEP,
        num_warps=4,
    )


def prepare_guard_and_schedule(plan: "PagedPlan") -> tuple[PageGuard, PagedSchedule]:
    """The Triton paged backend's per-batch state: one launch when the plan knows its pool size, else the
    schedule now and the guard at the first layer call (PageGuard.for_cache)."""
    guard = PageGuard.allocate(plan.context_lens, plan.block_table, plan.max_context_len, plan.error_flags)
    schedule = allocate_schedule(plan.context_lens, plan.max_context_len, guard.block_kv)
    if plan.num_kv_blocks is not None:
        launch_guard_and_schedule(guard, schedule, plan.num_kv_blocks)
    else:
        schedule.launch()
    return guard, schedule


def refresh_guard_and_schedule(guard: PageGuard, schedule: PagedSchedule, fresh_num_blocks: int | None) -> None:
    """Under CUDA graphs, after the new batch's lens and table were copied into the captured plan's
    tensors: what guard.refresh then schedule.launch do, in one launch where the pool is known."""
    bound = guard.refresh_bound(fresh_num_blocks)
    if bound is None:
        schedule.launch()  # the next layer call guards (for_cache)
    else:
        launch_guard_and_schedule(guard, schedule, bound)
