"""The paged backend's page guard and schedule in one launch (backends/triton/guard_and_schedule.py)
against the two launches they replace: every output equal (integers exactly; the fill's floats bit for
bit: both write the same constants), on ragged and garbage lengths, bad page entries, several next_n,
and the refresh of a captured plan."""

from __future__ import annotations

import pytest
import torch

from backends.triton.guard_and_schedule import (allocate_schedule, launch_guard_and_schedule,
                                                prepare_guard_and_schedule, refresh_guard_and_schedule)
from backends.shared.page_guard import PageGuard
from backends.triton.paged_mqa_logits import schedule_for
from dispatch.contract.bounds import BAD_PAGE, LENGTH_PAST_BOUND
from dispatch.contract.errors import GraphMismatchError, LayoutError
from dispatch.contract.kv_cache import BLOCK_KV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels under the interpreter


def _inputs(rows: int, next_n: int, width: int, seed: int, pool: int):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(-3, width + 70, (rows, next_n), generator=gen, dtype=torch.int32)
    pages = -(-width // BLOCK_KV) + 1
    table = torch.randint(-2, pool + 2, (rows, pages), generator=gen, dtype=torch.int32)
    lens[0, 0] = width + 1  # at least one token past the bound, whatever the draw
    return lens.to(DEVICE), table.to(DEVICE)


def _outputs(guard: PageGuard, schedule) -> dict[str, torch.Tensor]:
    return dict(safe_table=guard.safe_table, lens=guard.lens, fill_bits=guard.fill.view(torch.int32),
                flags=guard.error_flags, bounds=schedule.bounds, cost_prefix=schedule.cost_prefix,
                work_pages=schedule.work_pages)


def _two_launches(lens, table, width, pool):
    guard = PageGuard.allocate(lens, table, width, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    guard.launch(pool)
    return _outputs(guard, schedule_for(lens, width, BLOCK_KV))


def _one_launch(lens, table, width, pool):
    guard = PageGuard.allocate(lens, table, width, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    schedule = allocate_schedule(lens, width, BLOCK_KV)
    launch_guard_and_schedule(guard, schedule, pool)
    assert guard.num_blocks == pool
    return _outputs(guard, schedule)


@pytest.mark.parametrize(("rows", "next_n", "width", "pool"),
                         [(1, 1, 64, 4), (3, 2, 200, 9), (17, 4, 1000, 30), (40, 1, 4096, 100), (5, 3, 130, 0)])
def test_one_launch_writes_what_the_guard_then_the_schedule_write(rows, next_n, width, pool):
    lens, table = _inputs(rows, next_n, width, seed=rows * 7 + next_n, pool=pool)
    expected = _two_launches(lens, table, width, pool)
    got = _one_launch(lens, table, width, pool)
    for name, want in expected.items():
        assert torch.equal(got[name], want), name
    assert got["flags"].item() & (BAD_PAGE | LENGTH_PAST_BOUND)  # the garbage was seen, not only copied


def test_strided_lens_and_table_match():
    lens, table = _inputs(9, 4, 700, seed=3, pool=20)
    wide = torch.zeros(9, 2 * table.shape[1], dtype=torch.int32, device=DEVICE)
    wide[:, : table.shape[1]] = table
    tall = torch.zeros(9, 8, dtype=torch.int32, device=DEVICE)
    tall[:, :4] = lens
    strided_lens, strided_table = tall[:, :4], wide[:, : table.shape[1]]
    expected = _two_launches(strided_lens, strided_table, 700, 20)
    got = _one_launch(strided_lens, strided_table, 700, 20)
    for name, want in expected.items():
        assert torch.equal(got[name], want), name


class _Plan:
    """What prepare reads of a plan."""

    def __init__(self, lens, table, width, pool):
        self.context_lens, self.block_table, self.max_context_len = lens, table, width
        self.error_flags, self.num_kv_blocks = torch.zeros(1, dtype=torch.int32, device=DEVICE), pool


def test_prepare_guards_in_the_same_launch_when_the_pool_is_known_and_waits_for_the_cache_otherwise():
    lens, table = _inputs(6, 2, 500, seed=4, pool=12)
    guard, schedule = prepare_guard_and_schedule(_Plan(lens, table, 500, 12))
    expected = _two_launches(lens, table, 500, 12)
    for name, want in _outputs(guard, schedule).items():
        assert torch.equal(want, expected[name]), name
    unknown, cut = prepare_guard_and_schedule(_Plan(lens, table, 500, None))
    assert unknown.num_blocks is None and torch.equal(cut.bounds, expected["bounds"])
    # The first layer call guards.
    unknown.for_cache(torch.zeros(12, BLOCK_KV, 1, 132, dtype=torch.uint8, device=DEVICE))
    assert torch.equal(unknown.safe_table, expected["safe_table"]) and torch.equal(unknown.lens, expected["lens"])


def test_a_refresh_guards_and_cuts_the_new_lengths_in_place_and_refuses_another_pool():
    lens, table = _inputs(6, 2, 500, seed=5, pool=12)
    guard, schedule = prepare_guard_and_schedule(_Plan(lens, table, 500, 12))
    bounds_before = schedule.bounds
    new_lens, new_table = _inputs(6, 2, 500, seed=6, pool=12)
    lens.copy_(new_lens)
    table.copy_(new_table)
    refresh_guard_and_schedule(guard, schedule, 12)
    assert schedule.bounds is bounds_before  # in place: a captured graph keeps reading it
    expected = _two_launches(new_lens, new_table, 500, 12)
    for name, want in _outputs(guard, schedule).items():
        if name != "flags":  # the plan's flags accumulate over both batches
            assert torch.equal(want, expected[name]), name
    with pytest.raises(GraphMismatchError, match="num_kv_blocks=13"):
        refresh_guard_and_schedule(guard, schedule, 13)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_a_bad_pool_size_is_refused_before_any_launch(bad):
    lens, table = _inputs(2, 1, 64, seed=1, pool=4)
    guard = PageGuard.allocate(lens, table, 64, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(LayoutError, match="num_kv_blocks must be a host int >= 0"):
        launch_guard_and_schedule(guard, allocate_schedule(lens, 64, BLOCK_KV), bad)
    assert guard.num_blocks is None


def test_prepare_with_the_pool_known_is_one_triton_launch(monkeypatch):
    import backends.triton.guard_and_schedule as fused
    import backends.shared.page_guard as guard_module
    import backends.triton.paged_schedule as schedule_module

    launched = []

    def counting(module, name):
        real = getattr(module, name)

        class _Counted:
            def __getitem__(self, grid):
                launched.append(name)
                return real[grid]
        monkeypatch.setattr(module, name, _Counted())

    counting(fused, "_guard_and_schedule_kernel")
    counting(guard_module, "_page_guard_kernel")
    counting(schedule_module, "_schedule_kernel")
    lens, table = _inputs(8, 4, 900, seed=9, pool=16)
    prepare_guard_and_schedule(_Plan(lens, table, 900, 16))
    assert launched == ["_guard_and_schedule_kernel"]
    launched.clear()
    prepare_guard_and_schedule(_Plan(lens, table, 900, None))  # the guard waits for the first layer's cache
    assert launched == ["_schedule_kernel"]
