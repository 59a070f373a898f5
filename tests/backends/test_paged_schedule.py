"""The Triton paged logits kernel's length-balanced schedule against a plain-Python reference of the same
cuts, on random ragged lengths (garbage ones included), and the properties the kernel relies on: the
programs' ranges tile every (work row, page) position exactly once, in order, with equal cost."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.triton.paged_schedule import COMPUTE_COST, FILL_COST, schedule_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_KV = 64


def work_row_pages(lens: torch.Tensor, tokens: int, width: int) -> list[int]:
    """Each work row's computed pages: its tokens' longest length, clamped to [0, width], in pages."""
    rows, next_n = lens.shape
    pages = []
    for row in range(rows):
        for first in range(0, next_n, tokens):
            longest = max(min(max(int(x), 0), math.ceil(width / BLOCK_KV) * BLOCK_KV) for x in lens[row, first : first + tokens])
            pages.append(math.ceil(longest / BLOCK_KV))
    return pages


def reference_bounds(lens: torch.Tensor, tokens: int, programs: int, width: int) -> list[tuple[int, int]]:
    """Program p starts at the first (work row, page) whose cost before it reaches p * total // programs."""
    pages = math.ceil(width / BLOCK_KV)
    computed = work_row_pages(lens, tokens, width)
    costs = [c * COMPUTE_COST + (pages - c) * FILL_COST for c in computed]
    prefix = [sum(costs[:i]) for i in range(len(costs))]
    total = sum(costs)
    bounds = []
    for p in range(programs + 1):
        target = p * total // programs
        row = max(i for i, before in enumerate(prefix) if before <= target)
        into = target - prefix[row]
        done = computed[row] * COMPUTE_COST
        page = -(-into // COMPUTE_COST) if into <= done else computed[row] + -(-(into - done) // FILL_COST)
        bounds.append((row, min(page, pages)))
    return bounds


def cost_of_range(start, end, computed, pages) -> int:
    """The cost of positions [start, end) in (work row, page) order."""
    total = 0
    for row in range(start[0], end[0] + 1):
        first = start[1] if row == start[0] else 0
        last = end[1] if row == end[0] else pages
        for page in range(first, last):
            total += COMPUTE_COST if page < computed[row] else FILL_COST
    return total


def random_lens(gen, rows, next_n, width):
    ctx = torch.randint(1, width + 1, (rows,), generator=gen)
    return (ctx[:, None] - next_n + torch.arange(next_n)[None, :] + 1).clamp(min=0).to(torch.int32)


@pytest.mark.parametrize(
    "rows,next_n,tokens,programs,width",
    [
        (1, 1, 1, 1, 64),
        (1, 1, 1, 7, 2048),  # more programs than work: most own nothing
        (3, 2, 2, 4, 1000),
        (5, 4, 4, 3, 4100),
        (9, 8, 4, 11, 3000),  # two work rows a row
        (300, 4, 4, 700, 640),  # past one step of the search (512 bounds)
        (1100, 1, 1, 37, 320),  # past one step of the prefix sum
    ],
)
def test_bounds_match_reference(rows, next_n, tokens, programs, width):
    gen = torch.Generator().manual_seed(rows * 31 + programs)
    lens = random_lens(gen, rows, next_n, width)
    schedule = schedule_pages(lens.to(DEVICE), tokens, programs, width, BLOCK_KV)
    got = [tuple(pair) for pair in schedule.bounds.cpu().tolist()]
    assert got == reference_bounds(lens, tokens, programs, width)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 12),
    next_n=st.integers(1, 6),
    tokens=st.sampled_from([1, 2, 4]),
    programs=st.integers(1, 30),
    width=st.integers(1, 2000),
    seed=st.integers(0, 2**16),
)
def test_ranges_tile_every_position_once_with_equal_cost(rows, next_n, tokens, programs, width, seed):
    tokens = min(tokens, 1 << (next_n - 1).bit_length())
    gen = torch.Generator().manual_seed(seed)
    lens = random_lens(gen, rows, next_n, width)
    bounds = [tuple(pair) for pair in schedule_pages(lens.to(DEVICE), tokens, programs, width, BLOCK_KV).bounds.cpu().tolist()]
    pages = math.ceil(width / BLOCK_KV)
    work_rows = rows * math.ceil(next_n / tokens)
    assert bounds[0] == (0, 0) and bounds[-1] == (work_rows - 1, pages)
    assert bounds == sorted(bounds), "the ranges must follow each other in (work row, page) order"
    computed = work_row_pages(lens, tokens, width)
    total = cost_of_range((0, 0), (work_rows - 1, pages), computed, pages)
    for start, end in zip(bounds, bounds[1:]):
        # Every range is within one page's cost of an equal share (cuts fall on page boundaries).
        assert abs(cost_of_range(start, end, computed, pages) - total / programs) <= COMPUTE_COST


def test_garbage_lengths_stay_inside_the_width():
    """Negative and huge lengths (the page guard poisons them; the schedule only clamps) give valid cuts."""
    lens = torch.tensor([[-5, 2**30], [7, -1], [2**31 - 1, 0]], dtype=torch.int32)
    width = 700
    schedule = schedule_pages(lens.to(DEVICE), 2, 5, width, BLOCK_KV)
    bounds = [tuple(pair) for pair in schedule.bounds.cpu().tolist()]
    assert bounds == reference_bounds(lens, 2, 5, width)
    assert all(0 <= row < 3 and 0 <= page <= math.ceil(width / BLOCK_KV) for row, page in bounds)


def test_a_refreshed_plan_is_cut_for_the_captured_width_not_the_fresh_one():
    """Under CUDA graphs a later batch may be shorter than the captured bound: its own plan's width (its
    max_seq_len) is narrower than the captured plan's, which the graph's kernel covers. The refreshed
    schedule must cover the captured width, so every column is written (-inf past each length)."""
    from backends.reference.paged_mqa_logits import reference_paged_mqa_logits
    from backends.triton import plugin
    from tests.support.paged_batch import paged_batch
    from tests.support.plans import plan_for

    backend = next(b for b in plugin.logits_backends() if b.name == "triton")
    first = paged_batch([300, 200], 2, heads=16, head_dim=32, seed=3)
    pool = first.kv_cache.shape[0]
    plan = plan_for(backend, first.seq_lens, first.page_table, 2, num_kv_blocks=pool)
    q = plan.q_in_layout(first.q_tokens)
    backend.run(plan, q, first.kv_cache, first.weights)

    second_lens = torch.tensor([90, 40], dtype=torch.int32)
    fresh = plan_for(backend, second_lens, first.page_table, 2, num_kv_blocks=pool)
    assert fresh.max_context_len < plan.max_context_len
    plan.context_lens.copy_(fresh.context_lens)
    backend.refresh_state(plan.state, fresh.state)
    out = backend.run(plan, q, first.kv_cache, first.weights)
    ref = reference_paged_mqa_logits(q, first.kv_cache, first.weights, plan.context_lens, plan.block_table,
                                     plan.max_context_len, plan.fp8_dtype)
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    visible = ~torch.isinf(ref)
    assert float((out[visible] - ref[visible]).norm() / ref[visible].norm()) < 1e-5


@pytest.mark.parametrize("next_n", [1, 2, 3, 4, 8])
def test_the_one_launchs_program_and_token_counts_are_the_default_configs(next_n, monkeypatch):
    """backends/triton/plan_tensors.py finds them once per (next_n, device, interpreter on): the values
    paged_schedule's own path computes for every batch."""
    from backends.triton.paged_mqa_logits import default_config, work_row_tokens
    from backends.triton.paged_schedule import program_count
    from backends.triton.plan_tensors import launch_shape

    device = torch.device("cpu")
    for interpreted in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpreted)
        config = default_config(next_n, device)
        expected = (program_count(device, config.programs_per_sm), work_row_tokens(config, next_n))
        assert launch_shape(next_n, device, interpreted == "1") == expected
