"""The Triton paged logits backend's per-batch state: the batch's page guard (bounds, shared with
DeepGEMM) and its length-balanced schedule (the Triton kernel's alone), both built in `prepare` and
rebuilt in place under CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.triton.page_guard import PageGuard, prepare_page_guard
from backends.triton.paged_mqa_logits import default_config, work_row_tokens
from backends.triton.paged_schedule import PagedSchedule, program_count
from dispatch.kv_cache import BLOCK_KV

if TYPE_CHECKING:
    from dispatch.plan import IndexerPlan


@dataclass(frozen=True)
class TritonPagedState:
    guard: PageGuard
    schedule: PagedSchedule


def prepare_triton_paged(plan: "IndexerPlan") -> TritonPagedState:
    """The guard over the plan's table and lens, and the schedule cut from its lens for the default config
    (the one every layer call of the plan runs)."""
    lens = plan.context_lens
    config = default_config(lens.shape[1], lens.device)
    schedule = PagedSchedule.allocate(lens, work_row_tokens(config, lens.shape[1]),
                                      program_count(lens.device, config.programs_per_sm), plan.max_context_len, BLOCK_KV)
    schedule.launch()
    return TritonPagedState(prepare_page_guard(plan), schedule)


def refresh_triton_paged(captured: TritonPagedState, fresh: TritonPagedState) -> None:
    """Under CUDA graphs, after dispatch.graphs has copied the new batch's lens and table into the captured
    plan's tensors: guard them again and cut the schedule again, into the same outputs."""
    captured.guard.refresh(fresh.guard.num_blocks)
    captured.schedule.launch()
