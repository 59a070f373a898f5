"""The plan's one-launch prepare (backends/shared/plan_prepare.cu) against the Triton launches it stands in
for: the same lengths, error flags, page guard (safe table, mask lengths, fill), readable lengths (a
top-k's, cut to max_seq_len) and schedule (the Triton kernel's cuts; DeepGEMM's SM90 rule, both
variants), exactly (both sides compute the same integers; the fill compared NaN for NaN), at ragged
lengths, several batch sizes (one past a CTA's 256 threads) and next_n, the pool given and deferred, and
hostile input: entries outside the pool, lengths past max_seq_len, negative, zero and int64 past 2^31, a
table wider than needed and one sliced from a wider one. Then build_plan with it against build_plan
without it, and the guard deferred to the first layer."""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm.guard_and_schedule import DeepGemmSchedule, ScheduleRule, launch_guard_and_schedule
from backends.shared import plan_extension
from backends.shared.page_guard import PageGuard
from backends.triton.paged_state import prepare_triton_paged
from backends.triton.plan_tensors import triton_plan_tensors
from dispatch.contract import BAD_PAGE, BLOCK_KV, LENGTH_PAST_BOUND, PagedPlan, new_error_flags
from dispatch.step.paged_plan import visible_lengths

pytestmark = pytest.mark.gpu

SGL = ScheduleRule(clamp_request=False, max_next_n=2, source="test")
TOKENSPEED = ScheduleRule(clamp_request=True, max_next_n=None, source="test")


@pytest.fixture(scope="module")
def extension():
    built = plan_extension.warm()
    if not built.ok:
        pytest.skip(f"the one-launch prepare cannot be built here: {built.reason}")
    return plan_extension.loaded()


def _batch(batch: int, next_n: int, seed: int, *, hostile: bool, max_len: int = 3000, pool: int = 4096,
           dtype=torch.int32, wide: bool = False):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(next_n, max_len + 1, (batch,), generator=gen, dtype=torch.int64)
    pages = -(-max_len // BLOCK_KV) + (3 if wide else 0)
    table = torch.randint(0, pool, (batch, pages + (5 if wide else 0)), generator=gen, dtype=torch.int32)
    if wide:
        table = table[:, 2:2 + pages + 1]  # a slice of a wider table: its rows' stride is not its width
    if hostile:
        table[0, 0] = -1  # a page row 0 needs: BAD_PAGE on both paths
        pick = torch.randint(0, batch, (max(batch // 4, 1),), generator=gen)
        table[pick, torch.randint(0, pages, pick.shape, generator=gen)] = torch.tensor(
            [-1, pool, 2**31 - 1, -(2**31)], dtype=torch.int32)[torch.arange(pick.numel()) % 4]
        seq[0] = max_len + 7  # past max_seq_len
        if batch > 2:
            seq[1] = 0
            # int32 near its least: the add wraps on both paths; int64 past 2^31 must not wrap to a small length
            seq[2] = -(2**31) + 1 if dtype == torch.int32 else 2**32 + 5
        if batch > 3:
            seq[3] = -5
    return seq.to(dtype).cuda(), table.cuda(), max_len, pool


def _plan(seq, table, next_n, max_len, pool):
    """The plan the Triton path makes: the lengths by torch ops, the flags zeroed, then prepare."""
    return PagedPlan(key=None, decisions={}, batch_size=seq.shape[0], next_n=next_n,
                     context_lens=visible_lengths(seq, next_n), block_table=table, max_context_len=max_len,
                     num_kv_blocks=pool, error_flags=new_error_flags(seq.device))


def _same_guard(ours: PageGuard, theirs: PageGuard):
    assert torch.equal(ours.context_lens, theirs.context_lens)
    assert torch.equal(ours.safe_table, theirs.safe_table)
    assert torch.equal(ours.lens, theirs.lens)
    assert torch.equal(ours.fill.isnan(), theirs.fill.isnan())
    assert torch.equal(ours.fill.nan_to_num(0.0), theirs.fill.nan_to_num(0.0))
    assert torch.equal(ours.error_flags, theirs.error_flags)
    assert ours.num_blocks == theirs.num_blocks


CASES = [(1, 1), (3, 2), (128, 4), (300, 1), (257, 2), (64, 3)]


@pytest.mark.parametrize("batch,next_n", CASES)
@pytest.mark.parametrize("hostile", [False, True], ids=["clean", "hostile"])
@pytest.mark.parametrize("pool_known", [True, False], ids=["pool-given", "pool-deferred"])
def test_triton_plan_tensors_equal_the_triton_launches(extension, batch, next_n, hostile, pool_known):
    for seed, dtype, wide in ((0, torch.int32, False), (1, torch.int64, True)):
        seq, table, max_len, pool = _batch(batch, next_n, seed + batch, hostile=hostile, dtype=dtype, wide=wide)
        given = pool if pool_known else None
        made = triton_plan_tensors(seq_lens=seq, page_table=table, next_n=next_n, max_context_len=max_len,
                                   num_kv_blocks=given)
        theirs = prepare_triton_paged(_plan(seq, table, next_n, max_len, given))
        if not pool_known:  # both guards wait for the first layer's cache; guard both against it now
            made.state.guard.launch(pool)
            theirs.guard.launch(pool)
        torch.cuda.synchronize()
        assert torch.equal(made.context_lens, theirs.guard.context_lens) and made.error_flags is made.state.guard.error_flags
        readable = _plan(seq, table, next_n, max_len, given).readable_token_lengths()  # the clamp it stands in for
        assert made.readable_lengths.dtype == torch.int32 and torch.equal(made.readable_lengths, readable)
        _same_guard(made.state.guard, theirs.guard)
        if hostile:
            assert int(made.error_flags) & BAD_PAGE and int(made.error_flags) & LENGTH_PAST_BOUND
        ours, their = made.state.schedule, theirs.schedule
        assert (ours.tokens, ours.width, ours.block_kv) == (their.tokens, their.width, their.block_kv)
        assert torch.equal(ours.bounds, their.bounds)
        assert torch.equal(ours.cost_prefix, their.cost_prefix) and torch.equal(ours.work_pages, their.work_pages)


@pytest.mark.parametrize("rule", [SGL, TOKENSPEED], ids=["sgl", "tokenspeed"])
@pytest.mark.parametrize("batch,next_n,slots", [(1, 1, 132), (3, 2, 132), (128, 4, 66), (300, 1, 132), (64, 2, 5)])
@pytest.mark.parametrize("hostile", [False, True], ids=["clean", "hostile"])
def test_deepgemm_plan_launch_equals_the_triton_launch(extension, rule, batch, next_n, slots, hostile):
    for seed, dtype in ((0, torch.int32), (1, torch.int64)):
        seq, table, max_len, pool = _batch(batch, next_n, seed + slots, hostile=hostile, max_len=70000, pool=90000,
                                           dtype=dtype)
        context_lens, flags, safe, lens, fill, readable, prefix, schedule = extension.deepgemm_prepare(
            seq, table, next_n, pool, max_len, BLOCK_KV, BAD_PAGE, LENGTH_PAST_BOUND, slots, rule.clamp_request)
        plan = _plan(seq, table, next_n, max_len, pool)
        assert torch.equal(readable, plan.readable_token_lengths())
        guard = PageGuard.allocate(plan.context_lens, table, max_len, plan.error_flags)
        theirs = DeepGemmSchedule.allocate(plan.context_lens, slots, rule)
        launch_guard_and_schedule(guard, theirs, pool)
        torch.cuda.synchronize()
        ours = PageGuard(context_lens, table, max_len, flags, BLOCK_KV, safe, lens, fill, pool)
        _same_guard(ours, guard)
        assert torch.equal(schedule, theirs.schedule) and torch.equal(prefix, theirs.prefix)


@pytest.mark.parametrize("batch,next_n", [(1, 1), (3, 1), (1, 4), (5, 2)])
def test_every_output_starts_where_a_tensor_of_its_own_would(extension, batch, next_n):
    """512-byte boundaries, whatever the sizes before it: DeepGEMM loads a schedule row as one uint2, and
    the schedule at an odd word crashed its kernel (misaligned address, H200, B = 1, 2026-12-01)."""
    for max_len in (2100, 8192, 64):
        seq, table, _, pool = _batch(batch, next_n, max_len, hostile=False, max_len=max_len)
        outputs = extension.deepgemm_prepare(seq, table, next_n, pool, max_len, BLOCK_KV, BAD_PAGE, LENGTH_PAST_BOUND,
                                             66, True)
        outputs += extension.triton_prepare(seq, table, next_n, pool, max_len, BLOCK_KV, BAD_PAGE, LENGTH_PAST_BOUND,
                                            264, 4, 16, 1)
        assert [t.data_ptr() % 512 for t in outputs] == [0] * len(outputs)


def _not_taken():
    """(what is wrong, seq_lens, page_table, next_n, max_len): batches the Triton launches take or refuse themselves."""
    seq, table, max_len, _ = _batch(4, 2, 7, hostile=False)
    wide = torch.zeros(4, table.shape[1] * 2, dtype=torch.int32, device="cuda")
    return [
        ("lengths on the CPU", seq.cpu(), table, 2, max_len),
        ("int16 lengths", seq.to(torch.int16), table, 2, max_len),
        ("strided lengths", torch.stack([seq, seq], 1)[:, 0], table, 2, max_len),
        ("[B, 1] lengths", seq[:, None], table, 2, max_len),
        ("int64 table", seq, table.long(), 2, max_len),
        ("table strided along its pages", seq, wide[:, ::2], 2, max_len),
        ("table narrower than max_seq_len needs", seq, table[:, :-1], 2, max_len),
        ("next_n 0", seq, table, 0, max_len),
        ("next_n 33", seq, table, 33, max_len),
        ("no requests", seq[:0], table[:0], 2, max_len),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_batch_the_launch_does_not_take_gets_no_tensors(extension, case):
    """Which batches it serves, the launch answers itself (plan_prepare.cu's servable, the questions the
    Triton path would raise on): no tensors, nothing launched, and the plan takes the Triton launches."""
    what, seq, table, next_n, max_len = _not_taken()[case]
    assert extension.triton_prepare(seq, table, next_n, 64, max_len, BLOCK_KV, BAD_PAGE, LENGTH_PAST_BOUND, 264, 4,
                                    16, 1) == [], what
    assert extension.deepgemm_prepare(seq, table, next_n, 64, max_len, BLOCK_KV, BAD_PAGE, LENGTH_PAST_BOUND, 66,
                                      True) == [], what
    if next_n >= 1:  # (a PagedBatch refuses next_n 0 where it is built)
        assert triton_plan_tensors(seq_lens=seq, page_table=table, next_n=next_n, max_context_len=max_len,
                                   num_kv_blocks=64) is None, what


def test_a_table_with_other_rows_than_the_lengths_is_refused(extension):
    seq, table, max_len, pool = _batch(4, 2, 3, hostile=False)
    with pytest.raises(RuntimeError, match="one row per request"):
        extension.triton_prepare(seq, table[:3], 2, pool, max_len, BLOCK_KV, BAD_PAGE, LENGTH_PAST_BOUND, 264, 4, 16, 1)


def test_build_plan_through_the_one_launch_equals_build_plan_without_it(extension, monkeypatch):
    """The decided Triton backend's plan, made by its one launch, against the same plan with the
    extension hidden: every tensor the layers read is equal, and the deferred guard guards at the first
    layer's cache into the one launch's outputs."""
    from dispatch import load_dispatcher
    from dispatch.contract import ForwardMode, Op
    from dispatch.step.paged_plan import PagedBatch, build_plan

    dispatcher = load_dispatcher()
    for pool_known in (True, False):
        seq, table, max_len, pool = _batch(128, 4, 7, hostile=True)
        batch = PagedBatch(seq_lens=seq, page_table=table, max_seq_len=max_len, forward_mode=ForwardMode.TARGET_VERIFY,
                           next_n=4, num_kv_blocks=pool if pool_known else None)
        pinned = {Op.PAGED_MQA_LOGITS: "triton"}
        fast = build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", pinned=pinned)
        with monkeypatch.context() as hidden:
            hidden.setattr(plan_extension, "loaded", lambda: None)
            hidden.setattr("backends.triton.plan_tensors.loaded", lambda: None)
            slow = build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", pinned=pinned)
        assert fast.context_lens.data_ptr() != slow.context_lens.data_ptr()  # two paths were taken
        cache = torch.empty((pool, BLOCK_KV, 1, 132), dtype=torch.uint8, device="cuda")
        ours, theirs = fast.state.guard.for_cache(cache), slow.state.guard.for_cache(cache)
        torch.cuda.synchronize()
        _same_guard(ours, theirs)
        assert torch.equal(fast.state.schedule.bounds, slow.state.schedule.bounds)
        assert torch.equal(fast.block_table, slow.block_table) and torch.equal(fast.page_rows, slow.page_rows)
        assert fast.readable_lengths is not None and slow.readable_lengths is None
        assert torch.equal(fast.readable_token_lengths(), slow.readable_token_lengths())
