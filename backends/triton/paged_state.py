"""The Triton paged logits backend's per-batch state: the batch's page guard (bounds, shared with
DeepGEMM) and its length-balanced schedule (the Triton kernel's alone), both built in `prepare` and
rebuilt in place under CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.triton.guard_and_schedule import prepare_guard_and_schedule, refresh_guard_and_schedule
from backends.shared.page_guard import PageGuard
from backends.triton.paged_schedule import PagedSchedule

if TYPE_CHECKING:
    from dispatch.contract import PagedPlan


@dataclass(frozen=True)
class TritonPagedState:
    guard: PageGuard
    schedule: PagedSchedule


def prepare_triton_paged(plan: "PagedPlan") -> TritonPagedState:
    """The guard over the plan's table and lens, and the schedule cut from its lens for the default config
    (the one every layer call of the plan runs): one launch where the plan knows its pool size."""
    return TritonPagedState(*prepare_guard_and_schedule(plan))


def refresh_triton_paged(captured: TritonPagedState, fresh: TritonPagedState) -> None:
    """Under CUDA graphs, after dispatch.engines.graphs has copied the new batch's lens and table into the captured
    plan's tensors: guard them again and cut the schedule again, into the same outputs. Cut, not copied
    from `fresh`: the fresh plan's width is its own max_seq_len, which may be below the captured width
    the graph's kernel covers, and cuts made for a narrower width would leave the last columns unwritten."""
    refresh_guard_and_schedule(captured.guard, captured.schedule, fresh.guard.num_blocks)
