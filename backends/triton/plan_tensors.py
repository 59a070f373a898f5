"""The Triton paged backend's plan in one host call: the plan's lengths and flags, the page guard and
the length-balanced schedule (backends/triton/paged_schedule.py's, for the default config every layer
call of the plan runs) from backends/shared/plan_prepare.cu's one launch, where it is built; else None,
and the plan takes prepare_triton_paged's Triton launches, which compute the same tensors."""

from __future__ import annotations

from backends.shared.plan_extension import loaded, page_guard, servable
from dispatch.contract import BAD_PAGE, BLOCK_KV, LENGTH_PAST_BOUND, PlanTensors


def triton_plan_tensors(*, seq_lens, page_table, next_n: int, max_context_len: int,
                        num_kv_blocks: int | None) -> PlanTensors | None:
    extension = loaded()
    if extension is None or not servable(seq_lens, page_table, next_n, max_context_len):
        return None
    from backends.triton.paged_mqa_logits import default_config, work_row_tokens
    from backends.triton.paged_schedule import COMPUTE_COST, FILL_COST, PagedSchedule, program_count
    from backends.triton.paged_state import TritonPagedState

    config = default_config(next_n, seq_lens.device)
    programs = program_count(seq_lens.device, config.programs_per_sm)
    tokens = work_row_tokens(config, next_n)
    pool = -1 if num_kv_blocks is None else num_kv_blocks
    context_lens, flags, safe_table, lens, fill, cost_prefix, work_pages, bounds = extension.triton_prepare(
        seq_lens, page_table, next_n, pool, max_context_len, BLOCK_KV, BAD_PAGE, LENGTH_PAST_BOUND, programs, tokens,
        COMPUTE_COST, FILL_COST)
    guard = page_guard(context_lens, page_table, max_context_len, flags, safe_table, lens, fill, num_kv_blocks)
    schedule = PagedSchedule(context_lens=context_lens, tokens=tokens, width=max_context_len, block_kv=BLOCK_KV,
                             bounds=bounds, cost_prefix=cost_prefix, work_pages=work_pages)
    return PlanTensors(context_lens, flags, TritonPagedState(guard, schedule))
