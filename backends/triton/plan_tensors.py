"""The Triton paged backend's plan in one host call: the plan's lengths and flags, the page guard and
the length-balanced schedule (backends/triton/paged_schedule.py's, for the default config every layer
call of the plan runs) from backends/shared/plan_prepare.cu's one launch, where it is built; else None,
and the plan takes prepare_triton_paged's Triton launches, which compute the same tensors.

Imported only where a plan takes this path (backends/triton/plugin.py imports it on first use), so its
imports, triton's among them, sit at the top: inside the function they cost every batch ~1.5 us."""

from __future__ import annotations

import functools

import torch

from backends.shared.plan_extension import loaded, page_guard
from backends.triton.paged_mqa_logits import default_config, work_row_tokens
from backends.triton.paged_schedule import COMPUTE_COST, FILL_COST, PagedSchedule, program_count
from backends.triton.paged_state import TritonPagedState
from dispatch.contract import BAD_PAGE, BLOCK_KV, LENGTH_PAST_BOUND, PlanTensors, triton_interpreter_on


def triton_plan_tensors(*, seq_lens, page_table, next_n: int, max_context_len: int,
                        num_kv_blocks: int | None) -> PlanTensors | None:
    extension = loaded()
    if extension is None:
        return None
    programs, tokens = launch_shape(next_n, seq_lens.device, triton_interpreter_on())
    pool = -1 if num_kv_blocks is None else num_kv_blocks
    outputs = extension.triton_prepare(seq_lens, page_table, next_n, pool, max_context_len, BLOCK_KV, BAD_PAGE,
                                       LENGTH_PAST_BOUND, programs, tokens, COMPUTE_COST, FILL_COST)
    if not outputs:  # a batch the launch does not take (plan_prepare.cu's servable)
        return None
    context_lens, flags, safe_table, lens, fill, readable, cost_prefix, work_pages, bounds = outputs
    guard = page_guard(context_lens, page_table, max_context_len, flags, safe_table, lens, fill, num_kv_blocks)
    schedule = PagedSchedule(context_lens=context_lens, tokens=tokens, width=max_context_len, block_kv=BLOCK_KV,
                             bounds=bounds, cost_prefix=cost_prefix, work_pages=work_pages)
    return PlanTensors(context_lens, flags, TritonPagedState(guard, schedule), readable)


@functools.lru_cache(maxsize=64)
def launch_shape(next_n: int, device: torch.device, interpreted: bool) -> tuple[int, int]:
    """(programs, tokens per work row) of the default config at next_n on `device`: the same for every
    batch, so found once (a config, the SM count and a power of two cost the H200's host ~10 us a plan).
    `interpreted` (TRITON_INTERPRET, which program_count reads) is part of the key, not read here."""
    del interpreted
    config = default_config(next_n, device)
    return program_count(device, config.programs_per_sm), work_row_tokens(config, next_n)
