"""prepare and run of the DeepGEMM paged MQA logits backends, for one layout each.

prepare builds deep_gemm's schedule once per batch, from the very plan.context_lens tensor every layer's
kernel call then receives, and the plan keeps it as its state: a plain tensor, so a CUDA-graph replay
can refresh it in place with the lens. run checks its inputs against the plan's tag, launches, and writes
-inf past each token's length (masking.py says what that costs).

Bounds: deep_gemm follows every table entry a length covers without checking it, so run first launches
backends/triton/page_guard.py (one small kernel, no sync): deep_gemm gets a copy of the table whose
out-of-range entries point at block 0, the masking pass makes an affected token's row all NaN, and the
plan's error flag is set. What the guard cannot fix: a length past max_context_len. The lens must stay
the ones the schedule was built from, so deep_gemm still scores (and writes) that token's keys up to its
length, past the row's width, into the 256-aligned padding or the next row. The guard flags and poisons
the row; the engine must still guarantee max_seq_len >= every length (DISPATCH_DEBUG_BOUNDS=1 checks it
on the host before the launch and raises).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from backends.deepgemm import api
from backends.deepgemm.inputs import check_kernel_inputs
from backends.deepgemm.masking import mask_past_lengths
from dispatch.bounds import check_pages, debug_bounds_on
from dispatch.checks import check_logits_inputs
from dispatch.errors import LayoutError
from dispatch.layout import Layout
from dispatch.plan import IndexerPlan


@dataclass(frozen=True)
class DeepGemmPagedLogits:
    """The paged logits op through deep_gemm, for plans tagged with `layout`."""

    layout: Layout
    load: Callable[[], ModuleType]

    def prepare(self, plan: IndexerPlan) -> torch.Tensor:
        """The batch's schedule, int32 [num_sms + 1, 2], built from plan.context_lens itself."""
        module = self.load()
        lens = plan.context_lens
        return api.build_schedule(module, lens, api.num_sms(module, lens.device))

    def run(self, plan: IndexerPlan, q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        check_logits_inputs(plan, q, kv_cache, weights, consumes=self.layout)
        self._check_schedule(plan)
        check_kernel_inputs(q, kv_cache, weights, plan.context_lens, plan.block_table)
        num_blocks = kv_cache.shape[0]
        if num_blocks == 0 and plan.max_context_len > 0:
            raise LayoutError("kv_cache has no blocks, so no page-table entry can be valid")
        if debug_bounds_on():
            check_pages(plan.context_lens, plan.block_table, num_blocks, plan.max_context_len, api.BLOCK_KV)
        from backends.triton.page_guard import guard_pages  # triton ships with torch on CUDA

        guarded = guard_pages(
            plan.context_lens, plan.block_table, num_blocks, plan.max_context_len, api.BLOCK_KV, plan.error_flags
        )
        logits = api.paged_mqa_logits(
            self.load(), q, kv_cache, weights, plan.context_lens, guarded.safe_table, plan.state, plan.max_context_len
        )
        return mask_past_lengths(logits, guarded.mask_lens, guarded.fill)

    def _check_schedule(self, plan: IndexerPlan) -> None:
        state = plan.state
        if not isinstance(state, torch.Tensor) or state.dim() != 2 or state.dtype != torch.int32:
            raise LayoutError(
                f"the plan holds no DeepGEMM schedule (state is {type(state).__name__}); build it with build_plan"
            )
