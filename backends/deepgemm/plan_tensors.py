"""DeepGEMM's paged plan in one host call: the plan's lengths and flags, the page guard and DeepGEMM's
SM90 schedule from backends/shared/plan_prepare.cu's one launch, where it is built and the build's
schedule rule is one we compute (backends/deepgemm/guard_and_schedule.py); else None, and the plan
takes the Triton launches of DeepGemmPagedLogits.prepare, which compute the same tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

from backends.deepgemm.state import DeepGemmState
from backends.shared.plan_extension import loaded, page_guard
from dispatch.contract import BAD_PAGE, BLOCK_KV, LENGTH_PAST_BOUND, Layout, PlanTensors

VECTOR_BYTES = 16  # the widest load DeepGEMM's SM90 kernels make from the lengths, the table, the schedule


class PagedLogits(Protocol):
    """What this reads of the paged backend (backends/deepgemm/adapter.py's DeepGemmPagedLogits)."""

    layout: Layout
    load: Callable[[], ModuleType]
    sm90_schedule: bool

    def schedule_slots(self, module: ModuleType, device) -> int: ...


def deepgemm_plan_tensors(impl: PagedLogits, *, seq_lens, page_table, next_n: int, max_context_len: int,
                          num_kv_blocks: int | None) -> PlanTensors | None:
    extension = loaded()
    if extension is None or impl.layout is not Layout.NATIVE or not impl.sm90_schedule:
        return None
    module = impl.load()
    rule = _rule_of(module)
    if rule is None or not rule.serves(next_n):
        return None
    slots = impl.schedule_slots(module, seq_lens.device)  # get_num_sms() each batch: set_num_sms may move it
    pool = -1 if num_kv_blocks is None else num_kv_blocks
    outputs = extension.deepgemm_prepare(seq_lens, page_table, next_n, pool, max_context_len, BLOCK_KV, BAD_PAGE,
                                         LENGTH_PAST_BOUND, slots, rule.clamp_request)
    if not outputs:  # a batch the launch does not take (plan_prepare.cu's servable)
        return None
    context_lens, flags, safe_table, lens, fill, readable, _prefix, schedule = outputs
    if (context_lens.data_ptr() | safe_table.data_ptr() | schedule.data_ptr()) % VECTOR_BYTES:
        # Never by construction (plan_prepare.cu aligns every output): a check that costs ~1 us, beside a
        # misaligned vector load in DeepGEMM's kernel, which ends the process.
        return None
    guard = page_guard(context_lens, page_table, max_context_len, flags, safe_table, lens, fill, num_kv_blocks)
    return PlanTensors(context_lens, flags, DeepGemmState(schedule, guard), readable)


@functools.lru_cache(maxsize=8)
def _rule_of(module: ModuleType):
    """The build's schedule rule, read from its shipped source once per module (the files do not move
    while it is loaded; reading them costs the host ~10 us a batch)."""
    from backends.deepgemm.guard_and_schedule import schedule_rule_of

    return schedule_rule_of(module)
