"""DeepGEMM's paged prepare in one launch: the page guard (one program per row) and DeepGEMM's schedule
(one program) as programs of one grid, instead of our guard plus deep_gemm's own
get_paged_mqa_logits_metadata (two launches per batch).

The schedule is DeepGEMM's rule, computed by our own kernel. The rule was read from the scheduler source
the builds ship (deep_gemm/include/deep_gemm/scheduler/: `sm90_paged_mqa_logits.cuh` in sgl-deep-gemm
0.1.5, `paged_mqa_logits.cuh` in tokenspeed-deepgemm 2.5.0.post20260629), in uint32 as there:
- per request b of the lens [B, N] (the plan's native or flatten lens), the length of its last token,
  lens[b, N - 1], is cut into ceil(len / SPLIT_KV) segments (SPLIT_KV = 256 keys: the SM90 kernel's four
  math warpgroups of 64-key blocks); prefix[b] is their inclusive prefix sum;
- of the `total` segments, the first `slots - total % slots` scheduler slots get total / slots and the
  others one more; slot s starts at segment s * q + max(s - pivot, 0) (pivot = slots - total % slots);
- row s of the schedule is (its request, its segment within the request): the request is the binary
  search's upper bound of the start in prefix (tokenspeed's build clamps it to B - 1, sgl's does not),
  the segment the start less the segments of the requests before it; the last row is (B, 0);
- one next_n atom per request on SM90 (sgl-deep-gemm computes ceil(next_n / 2) atoms for next_n >= 2,
  which is 1 at next_n 2, its SM90 maximum; tokenspeed passes 1 on SM90, its 2-CTA next_n 4 kernel
  scoring all four tokens per cluster), so the request is the row's first entry.
`slots` is what the kernel launches with: get_num_sms(), or half of it for the 2-CTA next_n 4 kernel
(`deepgemm.sm90.n4`). The binary search is DeepGEMM's, step for step, so even lengths that wrap the
uint32 sums (hostile ones: the guard poisons and flags those rows) give DeepGEMM's schedule. A build
whose shipped scheduler is not one of these two keeps deep_gemm's own kernel (schedule_rule_of: None).
Held equal to deep_gemm's own output on the H200 by tests/backends/test_deepgemm_schedule.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from backends.shared.page_guard import PageGuard, _page_guard_kernel
from dispatch.contract import LayoutError

if TYPE_CHECKING:
    from dispatch.contract import PagedPlan

SPLIT_KV = 256
REQUESTS_PER_STEP = 256  # requests per step of the schedule program's prefix sum

# (file under include/deep_gemm/scheduler/, what it must say, request clamped to B - 1, one atom up to next_n)
_RULE_SOURCES = (
    ("sm90_paged_mqa_logits.cuh", ("sm90_paged_mqa_logits_metadata", "const uint32_t q_idx = lo;",
                                   "next_n_atom = (next_n >= 2) ? 2 : 1"), False, 2),
    ("paged_mqa_logits.cuh", ("smxx_paged_mqa_logits_metadata", "const uint32_t q_idx = min(lo, batch_size - 1);",
                              "const uint32_t num_next_n_atoms,"), True, None),
)
_COMMON_MARKS = ("ceil_div(context_len, SPLIT_KV)", "sm_idx * q + (sm_idx > pivot ? sm_idx - pivot : 0)",
                 "prefix_sum[mid] * num_next_n_atoms <= seg_starts")


@dataclass(frozen=True)
class ScheduleRule:
    """Which variant of DeepGEMM's schedule rule a build's metadata kernel computes."""

    clamp_request: bool  # the found request is clamped to the last one (tokenspeed-deepgemm)
    max_next_n: int | None  # sgl-deep-gemm counts ceil(next_n / 2) atoms past next_n 2: one atom only up to 2
    source: str  # the shipped file that says so

    def serves(self, next_n: int) -> bool:
        return self.max_next_n is None or next_n <= self.max_next_n


@functools.lru_cache(maxsize=8)
def _rule_in(include: str) -> ScheduleRule | None:
    folder = Path(include)
    for name, marks, clamp, max_next_n in _RULE_SOURCES:
        path = folder / name
        if path.is_file():
            text = path.read_text(errors="replace")
            if all(mark in text for mark in marks + _COMMON_MARKS):
                return ScheduleRule(clamp_request=clamp, max_next_n=max_next_n, source=str(path))
    return None


def schedule_rule_of(module: ModuleType) -> ScheduleRule | None:
    """The schedule rule of the deep_gemm build `module`, read from the scheduler source it ships; None
    where it ships none we recognise (a stand-in, another generation): deep_gemm's own kernel then."""
    package = getattr(module, "__file__", None)
    if not package:
        return None
    return _rule_in(str(Path(package).parent / "include" / "deep_gemm" / "scheduler"))


@triton.jit
def _schedule_body(ctx_ptr, stride_ctx_row, prefix_ptr, schedule_ptr, batch, slots, search_steps,
                   N: tl.constexpr, SPLIT_KV: tl.constexpr, CLAMP_REQUEST: tl.constexpr,
                   REQUESTS_PER_STEP: tl.constexpr, SLOTS_BLOCK: tl.constexpr):
    # Segments per request and their inclusive prefix sums, in uint32 as DeepGEMM's kernel computes them,
    # into prefix[0, B); prefix[B] = the total, so a search that ends past the last request finds no segments.
    carry = tl.zeros((), tl.uint32)
    split_kv = tl.full((REQUESTS_PER_STEP,), SPLIT_KV, tl.uint32)  # unsigned division wants unsigned sides
    for step in range(0, batch, REQUESTS_PER_STEP):
        request = step + tl.arange(0, REQUESTS_PER_STEP)
        live = request < batch
        length = tl.load(ctx_ptr + request.to(tl.int64) * stride_ctx_row + (N - 1), mask=live, other=0)
        length = length.to(tl.uint32, bitcast=True)
        segments = tl.where(live, (length + (split_kv - 1)) // split_kv, 0).to(tl.uint32)
        inclusive = tl.cumsum(segments, 0) + carry
        tl.store(prefix_ptr + request, inclusive.to(tl.int32, bitcast=True), mask=live)
        carry += tl.sum(segments, 0)
    tl.store(prefix_ptr + batch, carry.to(tl.int32, bitcast=True))
    tl.debug_barrier()  # the prefix sums are read back by other threads of this program

    total = carry
    unsigned_slots = slots.to(tl.uint32)
    share = total // unsigned_slots
    pivot = unsigned_slots - total % unsigned_slots
    slot = tl.arange(0, SLOTS_BLOCK).to(tl.uint32)
    live = slot < unsigned_slots
    start = slot * share + tl.where(slot > pivot, slot - pivot, 0)
    lo = tl.zeros((SLOTS_BLOCK,), tl.int32)
    hi = tl.zeros((SLOTS_BLOCK,), tl.int32) + batch
    for _ in range(search_steps):  # DeepGEMM's upper-bound search, step for step
        active = live & (lo < hi)
        mid = (lo + hi) // 2
        below = tl.load(prefix_ptr + mid, mask=active, other=0).to(tl.uint32, bitcast=True) <= start
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    request = tl.minimum(lo, batch - 1) if CLAMP_REQUEST else lo
    before = tl.load(prefix_ptr + request - 1, mask=live & (request > 0), other=0).to(tl.uint32, bitcast=True)
    upto = tl.load(prefix_ptr + request, mask=live, other=0).to(tl.uint32, bitcast=True)
    offset = start - before
    own = upto - before
    nonempty = own > 0
    divisor = tl.where(nonempty, own, 1)
    atom = tl.where(nonempty, offset // divisor, 0)
    split = tl.where(nonempty, offset % divisor, 0)
    first = request.to(tl.uint32, bitcast=True) + atom
    tl.store(schedule_ptr + slot * 2, first.to(tl.int32, bitcast=True), mask=live)
    tl.store(schedule_ptr + slot * 2 + 1, split.to(tl.int32, bitcast=True), mask=live)
    tl.store(schedule_ptr + slots * 2, batch)
    tl.store(schedule_ptr + slots * 2 + 1, 0)


@triton.jit
def _schedule_kernel(ctx_ptr, stride_ctx_row, prefix_ptr, schedule_ptr, batch, slots, search_steps,
                     N: tl.constexpr, SPLIT_KV: tl.constexpr, CLAMP_REQUEST: tl.constexpr,
                     REQUESTS_PER_STEP: tl.constexpr, SLOTS_BLOCK: tl.constexpr):
    _schedule_body(ctx_ptr, stride_ctx_row, prefix_ptr, schedule_ptr, batch, slots, search_steps,
                   N, SPLIT_KV, CLAMP_REQUEST, REQUESTS_PER_STEP, SLOTS_BLOCK)


@triton.jit
def _guard_and_schedule_kernel(
    ctx_ptr, table_ptr, safe_table_ptr, lens_ptr, fill_ptr, error_flags_ptr,
    num_blocks, max_context_len, guard_pages, stride_ctx_row, stride_table_row,
    prefix_ptr, schedule_ptr, batch, slots, search_steps,
    N: tl.constexpr, N_BLOCK: tl.constexpr, BLOCK_KV: tl.constexpr, SCAN_PAGES: tl.constexpr,
    BAD_PAGE: tl.constexpr, LENGTH_PAST_BOUND: tl.constexpr,
    SPLIT_KV: tl.constexpr, CLAMP_REQUEST: tl.constexpr, REQUESTS_PER_STEP: tl.constexpr,
    SLOTS_BLOCK: tl.constexpr,
):
    # Programs [0, B) guard a row each (the guard reads its row from the program id); program B schedules.
    # Both only read the lens, so side by side they compute what they compute one after the other.
    if tl.program_id(0) < batch:
        _page_guard_kernel(ctx_ptr, table_ptr, safe_table_ptr, lens_ptr, fill_ptr, error_flags_ptr, num_blocks,
                           max_context_len, guard_pages, stride_ctx_row, stride_table_row, N, N_BLOCK, BLOCK_KV,
                           SCAN_PAGES, BAD_PAGE, LENGTH_PAST_BOUND)
    else:
        _schedule_body(ctx_ptr, stride_ctx_row, prefix_ptr, schedule_ptr, batch, slots, search_steps,
                       N, SPLIT_KV, CLAMP_REQUEST, REQUESTS_PER_STEP, SLOTS_BLOCK)


@dataclass(frozen=True)
class DeepGemmSchedule:
    """A batch's schedule [slots + 1, 2] int32 as deep_gemm's kernel reads it, and its scratch."""

    context_lens: torch.Tensor  # int32 [B, N]: the plan's, read at each launch
    schedule: torch.Tensor  # int32 [slots + 1, 2]
    prefix: torch.Tensor  # int32 [B + 1]: the segments' prefix sums
    slots: int
    rule: ScheduleRule

    @classmethod
    def allocate(cls, context_lens: torch.Tensor, slots: int, rule: ScheduleRule) -> "DeepGemmSchedule":
        if context_lens.dim() != 2 or context_lens.dtype != torch.int32 or context_lens.stride(1) != 1:
            raise LayoutError(f"deep_gemm's schedule reads int32 lens [B, N] with unit column stride; got "
                              f"{context_lens.dtype} {list(context_lens.shape)} strides {list(context_lens.stride())}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise LayoutError(f"the schedule needs at least one scheduler slot; got {slots!r}")
        device = context_lens.device
        return cls(context_lens, torch.empty((slots + 1, 2), dtype=torch.int32, device=device),
                   torch.empty(context_lens.shape[0] + 1, dtype=torch.int32, device=device), slots, rule)

    def arguments(self) -> tuple:
        batch = self.context_lens.shape[0]
        return (self.prefix, self.schedule, batch, self.slots, max(batch, 1).bit_length() + 1)

    def constants(self) -> dict:
        return dict(SPLIT_KV=SPLIT_KV, CLAMP_REQUEST=self.rule.clamp_request, REQUESTS_PER_STEP=REQUESTS_PER_STEP,
                    SLOTS_BLOCK=triton.next_power_of_2(self.slots))

    def launch(self) -> None:
        """The schedule alone (the guard waits for the first layer's cache)."""
        _schedule_kernel[(1,)](self.context_lens, self.context_lens.stride(0), *self.arguments(),
                               N=self.context_lens.shape[1], **self.constants())


def launch_guard_and_schedule(guard: PageGuard, schedule: DeepGemmSchedule, num_blocks: int) -> None:
    """Guard the plan's lens and table against a pool of `num_blocks` and compute deep_gemm's schedule:
    one launch (what guard.launch(num_blocks) then schedule.launch() compute)."""
    if schedule.context_lens is not guard.context_lens:
        raise LayoutError("the page guard and the schedule must be over the same lens")
    rows, next_n = guard.context_lens.shape
    if rows == 0:  # the guard has nothing to do; the schedule's last row is still written
        guard.launch(num_blocks)
        schedule.launch()
        return
    guard_arguments, guard_constants = guard.kernel_arguments(num_blocks)
    _guard_and_schedule_kernel[(rows + 1,)](
        *guard_arguments,
        *schedule.arguments(),
        **guard_constants,
        **schedule.constants(),
        num_warps=4,
    )


def prepare_guard_and_schedule(plan: "PagedPlan", slots: int, rule: ScheduleRule) -> tuple[PageGuard, DeepGemmSchedule]:
    """DeepGEMM's per-batch state: one launch when the plan knows its pool size, else the schedule now
    and the guard at the first layer call (PageGuard.for_cache)."""
    guard = PageGuard.allocate(plan.context_lens, plan.block_table, plan.max_context_len, plan.error_flags)
    schedule = DeepGemmSchedule.allocate(plan.context_lens, slots, rule)
    if plan.num_kv_blocks is not None:
        launch_guard_and_schedule(guard, schedule, plan.num_kv_blocks)
    else:
        schedule.launch()
    return guard, schedule
