"""Out-of-range indices from an engine: page-table entries, Q positions and lengths past max_seq_len.

Every backend must never follow them. The Triton kernels (under the interpreter here, the same code
the GPU runs) poison the affected token's row with NaN in every column and set the plan's error flag;
the torch references raise IndexBoundsError naming the row, token, index and bound. An index of
2**31 - 1 (or a position of 2**40) that a kernel dereferenced would crash this process, not fail a test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.reference.paged_mqa_logits import reference_paged_mqa_logits as reference_logits
from backends.reference.q_quant import reference_indexer_q_quant as reference_quant
from backends.triton import plugin as triton_plugin
from backends.triton.q_quant import triton_indexer_q_quant as triton_quant
from backends.triton.fp8_mode import Fp8Mode
from dispatch.contract.bounds import BAD_PAGE, BAD_POSITION, LENGTH_PAST_BOUND
from dispatch.contract.errors import IndexBoundsError
from dispatch.contract.key import Fp8Dtype
from dispatch.contract.layout import Layout
from dispatch.contract.rope import RopeSpec
from tests.support.paged_batch import paged_batch
from tests.support.plans import plan_for

BACKENDS = {backend.name: backend for backend in triton_plugin.logits_backends()}
BLOCK_KV = 64
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def bad_entries(num_blocks: int) -> list[int]:
    return [-1, -(2**31), num_blocks, num_blocks + 7, 2**31 - 1]


def lengths(seq_lens: list[int], next_n: int) -> list[list[int]]:
    return [[length - next_n + j + 1 for j in range(next_n)] for length in seq_lens]


def poisoned_tokens(table: torch.Tensor, seq_lens, next_n, num_blocks, max_len) -> list[bool]:
    """Per token (request-major): does it need an out-of-range page, or is its length past max_len?"""
    out = []
    for request, token_lens in enumerate(lengths(seq_lens, next_n)):
        for ctx in token_lens:
            needed = table[request, : min(math.ceil(ctx / BLOCK_KV), table.shape[1])]
            out.append(ctx > max_len or bool(((needed < 0) | (needed >= num_blocks)).any()))
    return out


def run_triton(layout, seq_lens, next_n, table, batch, max_len, *, pool_given=True):
    """The Triton backend through a plan: its page guard runs in prepare when the plan knows the pool
    (pool_given), else at this first layer call."""
    backend = BACKENDS["triton" if layout is Layout.NATIVE else "triton.flatten"]
    pool = batch.kv_cache.shape[0] if pool_given else None
    plan = plan_for(backend, batch.seq_lens, table, next_n, max_seq_len=max_len, num_kv_blocks=pool)
    out = backend.run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)
    return plan, out


def run_deepgemm_flatten(table, batch, next_n, max_len, *, pool_given=True):
    """deepgemm.sm90.flatten against the recording stand-in (it computes with the torch reference, which
    raises on an out-of-range entry it is handed: so the guard's table must be safe)."""
    from backends.deepgemm.plugin import deepgemm_backends
    from dispatch.contract.key import Arch
    from tests.support.fake_deep_gemm import FakeDeepGemm

    fake = FakeDeepGemm(num_sms=8)
    backend = next(b for b in deepgemm_backends(load=lambda: fake) if b.name == "deepgemm.sm90.flatten")
    pool = batch.kv_cache.shape[0] if pool_given else None
    plan = plan_for(backend, batch.seq_lens, table, next_n, arch=Arch.SM90, max_seq_len=max_len, num_kv_blocks=pool)
    return plan, backend.run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)


def expected_good_rows(plan, batch, table_in_range, max_len):
    """The reference on a table whose bad entries point at block 0: right for every unpoisoned token."""
    lens = plan.context_lens.clamp(max=max_len)
    if plan.layout is Layout.FLATTEN:
        table_in_range = table_in_range.repeat_interleave(plan.next_n, dim=0)
    q = plan.q_in_layout(batch.q_tokens)
    return reference_logits(q, batch.kv_cache, batch.weights, lens, table_in_range, max_len)


def assert_poisoned_and_rest_exact(out, expected, poisoned):
    for row, bad in enumerate(poisoned):
        if bad:
            assert torch.isnan(out[row]).all(), f"token {row}: its row must be NaN in every column"
        else:
            assert not torch.isnan(out[row]).any(), f"token {row} is in range; NaN leaked into its row"
            assert torch.equal(torch.isneginf(out[row]), torch.isneginf(expected[row]))
            visible = torch.isfinite(expected[row])
            if visible.any():
                error = (out[row][visible] - expected[row][visible]).norm() / expected[row][visible].norm()
                assert error < 1e-5


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_out_of_range_pages_poison_exactly_the_tokens_that_need_them(data):
    next_n = data.draw(st.integers(1, 4), label="next_n")
    seq_lens = data.draw(st.lists(st.integers(next_n, 200), min_size=1, max_size=3), label="seq_lens")
    backend = data.draw(st.sampled_from(["triton", "triton.flatten", "deepgemm.sm90.flatten"]), label="backend")
    batch = paged_batch(seq_lens, next_n, heads=32 if "deepgemm" in backend else 16, head_dim=32,
                        seed=len(seq_lens) * 10 + next_n)
    num_blocks = batch.kv_cache.shape[0]
    table = batch.page_table.clone()
    cells = [(r, p) for r in range(table.shape[0]) for p in range(table.shape[1])]
    for r, p in data.draw(st.lists(st.sampled_from(cells), max_size=3, unique=True), label="corrupted"):
        table[r, p] = data.draw(st.sampled_from(bad_entries(num_blocks)), label=f"entry[{r}, {p}]")
    max_len = max(seq_lens)
    poisoned = poisoned_tokens(table, seq_lens, next_n, num_blocks, max_len)
    pool_given = data.draw(st.booleans(), label="pool given (else guarded at the first layer call)")

    if backend == "deepgemm.sm90.flatten":
        plan, out = run_deepgemm_flatten(table, batch, next_n, max_len, pool_given=pool_given)
    else:
        layout = Layout.NATIVE if backend == "triton" else Layout.FLATTEN
        plan, out = run_triton(layout, seq_lens, next_n, table, batch, max_len, pool_given=pool_given)
    in_range = torch.where((table >= 0) & (table < num_blocks), table, 0)
    assert_poisoned_and_rest_exact(out, expected_good_rows(plan, batch, in_range, max_len), poisoned)
    assert int(plan.error_flags) == (BAD_PAGE if any(poisoned) else 0)

    q = plan.q_in_layout(batch.q_tokens)
    if any(poisoned):
        with pytest.raises(IndexBoundsError, match=r"page-table entry \[\d+, \d+\] = -?\d+ is outside"):
            reference_logits(q, batch.kv_cache, batch.weights, plan.context_lens, plan.block_table, max_len)
    else:
        reference_logits(q, batch.kv_cache, batch.weights, plan.context_lens, plan.block_table, max_len)


@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FLATTEN])
def test_length_past_max_seq_len_poisons_the_row_instead_of_scoring_a_prefix(layout):
    seq_lens, next_n, max_len = [100, 300, 230], 3, 230
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=3)
    plan, out = run_triton(layout, seq_lens, next_n, batch.page_table, batch, max_len)
    poisoned = poisoned_tokens(batch.page_table, seq_lens, next_n, batch.kv_cache.shape[0], max_len)
    assert poisoned == [False] * 3 + [True] * 3 + [False] * 3
    assert_poisoned_and_rest_exact(out, expected_good_rows(plan, batch, batch.page_table, max_len), poisoned)
    assert int(plan.error_flags) == LENGTH_PAST_BOUND
    with pytest.raises(IndexBoundsError, match="context length 298 is past max_context_len=230"):
        reference_logits(plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights, plan.context_lens,
                         plan.block_table, max_len)


def test_plan_check_errors_decodes_raises_and_clears():
    seq_lens, next_n = [90, 40], 2
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=4)
    table = batch.page_table.clone()
    table[0, 1] = 2**31 - 1
    plan, out = run_triton(Layout.NATIVE, seq_lens, next_n, table, batch, 100)
    with pytest.raises(IndexBoundsError, match="page-table entry outside") as error:
        plan.check_errors()
    assert "past max_context_len" not in str(error.value)
    plan.check_errors()  # read and cleared
    assert torch.isnan(out[:2]).all() and not torch.isnan(out[2:]).any()


def test_debug_mode_raises_on_the_host_before_the_launch(monkeypatch):
    seq_lens, next_n = [90, 40], 1
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=5)
    table = batch.page_table.clone()
    table[1, 0] = -3
    monkeypatch.setenv("DISPATCH_DEBUG_BOUNDS", "1")
    with pytest.raises(IndexBoundsError, match=r"row 1 token 0: page-table entry \[1, 0\] = -3"):
        run_triton(Layout.NATIVE, seq_lens, next_n, table, batch, 90)


# --- Q positions ----------------------------------------------------------------------------------

MAX_POS = 256
QUANT = dict(rope=RopeSpec.gptj_tail(), softmax_scale=128**-0.5, head_scale=0.125)
MODES = [
    pytest.param(Fp8Dtype.E4M3FN, None, id="e4m3fn"),
    pytest.param(Fp8Dtype.E4M3FNUZ, Fp8Mode.FNUZ_EMULATED, id="fnuz-emulated"),
    pytest.param(Fp8Dtype.E4M3FNUZ, Fp8Mode.FNUZ_NATIVE, id="fnuz-native"),
]


def quant_inputs(tokens=6, heads=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 128, generator=gen).to(torch.bfloat16)
    weights = torch.randn(tokens, heads, generator=gen)
    angles = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.bfloat16)
    return q, weights, cache


@pytest.mark.parametrize("fp8_dtype, mode", MODES)
@pytest.mark.parametrize(
    "bad, dtype",
    [(-1, torch.int64), (MAX_POS, torch.int64), (2**40, torch.int64), (-(2**40), torch.int64),
     (-1, torch.int32), (MAX_POS, torch.int32), (2**31 - 1, torch.int32)],
)
def test_position_outside_the_cos_sin_cache_is_never_read(fp8_dtype, mode, bad, dtype):
    q, weights, cache = quant_inputs(seed=abs(bad) % 97)
    positions = torch.tensor([3, bad, 0, MAX_POS - 1, bad, 17], dtype=dtype)
    flags = torch.zeros(1, dtype=torch.int32)
    q_fp8, folded = triton_quant(q, weights, positions, cache, fp8_dtype=fp8_dtype, error_flags=flags,
                                 fnuz_mode=mode, **QUANT)
    assert int(flags) == BAD_POSITION
    bad_tokens = torch.tensor([False, True, False, False, True, False])
    assert torch.isnan(folded[bad_tokens]).all() and not torch.isnan(folded[~bad_tokens]).any()
    nan_byte = 0x7F if fp8_dtype is Fp8Dtype.E4M3FN else 0x80
    assert (q_fp8.view(torch.uint8)[bad_tokens] == nan_byte).all()
    good = torch.where(bad_tokens, 0, positions)
    want_q, want_w = reference_quant(q, weights, good, cache, fp8_dtype=fp8_dtype, **QUANT)
    # Exact: Q quant is elementwise and correctly rounded step by step (tests/backends/test_triton_q_quant.py).
    assert torch.equal(q_fp8.view(torch.uint8)[~bad_tokens], want_q.view(torch.uint8)[~bad_tokens])
    assert torch.equal(folded[~bad_tokens], want_w[~bad_tokens])
    message = rf"token 1: position {bad} is outside the cos/sin cache's \[0, {MAX_POS}\)"
    with pytest.raises(IndexBoundsError, match=message):
        reference_quant(q, weights, positions, cache, fp8_dtype=fp8_dtype, **QUANT)


def test_positions_in_range_leave_the_flag_clear():
    q, weights, cache = quant_inputs(seed=1)
    flags = torch.zeros(1, dtype=torch.int32)
    triton_quant(q, weights, torch.arange(6) * 40, cache, fp8_dtype=Fp8Dtype.E4M3FN, error_flags=flags, **QUANT)
    assert int(flags) == 0


# --- DeepGEMM (through its recording stand-in) and the engine-facing step -------------------------


@pytest.mark.parametrize("name", ["deepgemm.sm90", "deepgemm.sm90.flatten"])
def test_deepgemm_gets_a_safe_table_and_poisons_the_rows(name):
    from backends.deepgemm.plugin import deepgemm_backends
    from dispatch.contract.key import Arch
    from tests.support.fake_deep_gemm import FakeDeepGemm

    fake = FakeDeepGemm(num_sms=8)
    backend = next(b for b in deepgemm_backends(load=lambda: fake) if b.name == name)
    seq_lens, next_n = [70, 5, 130], 2
    batch = paged_batch(seq_lens, next_n, seed=6)
    num_blocks = batch.kv_cache.shape[0]
    table = batch.page_table.clone()
    table[2, 1] = num_blocks  # request 2 needs page 1 (keys 64..129) for both tokens
    table[1, 1] = -5  # padding: request 1 has one page
    plan = plan_for(backend, batch.seq_lens, table, next_n, arch=Arch.SM90)
    out = backend.run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)
    (call,) = fake.calls_to("fp8_fp4_paged_mqa_logits")
    passed = call.args[4]
    assert ((passed >= 0) & (passed < num_blocks)).all(), "deep_gemm was handed an out-of-range entry"
    poisoned = poisoned_tokens(table, seq_lens, next_n, num_blocks, max(seq_lens))
    assert poisoned == [False, False, False, False, True, True]
    in_range = torch.where((table >= 0) & (table < num_blocks), table, 0)
    assert_poisoned_and_rest_exact(out, expected_good_rows(plan, batch, in_range, max(seq_lens)), poisoned)
    with pytest.raises(IndexBoundsError, match="page-table entry outside"):
        plan.check_errors()


def test_indexer_step_on_the_reference_raises_naming_the_entry():
    from dispatch import load_dispatcher
    from dispatch.engines.indexer_step import IndexerStep
    from dispatch.contract.key import ForwardMode
    from dispatch.step.paged_plan import PagedBatch

    seq_lens, next_n = [100, 20], 2
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=8)
    step = IndexerStep(load_dispatcher(), kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=32**-0.5, head_scale=16**-0.5, index_topk=8)
    table = batch.page_table.clone()
    table[0, 1] = 2**31 - 1
    plan = step.plan(PagedBatch(batch.seq_lens, table, 100, ForwardMode.TARGET_VERIFY, next_n=next_n))
    tokens = len(seq_lens) * next_n
    q = torch.randn(tokens, 16, 32, dtype=torch.bfloat16)
    angles = torch.arange(128, dtype=torch.float64)[:, None] * torch.ones(8)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    positions = torch.tensor([98, 99, 18, 19])
    if plan.logits.backend.startswith("torch.reference"):
        with pytest.raises(IndexBoundsError, match=r"page-table entry \[0, 1\] = 2147483647"):
            step.select(plan, q, torch.randn(tokens, 16), positions, cache, batch.kv_cache)
    else:  # a Triton path: the rows are poisoned and the flag says why
        step.select(plan, q, torch.randn(tokens, 16), positions, cache, batch.kv_cache)
        with pytest.raises(IndexBoundsError, match="page-table entry outside"):
            plan.check_errors()


# --- The page guard runs once per batch, not per layer --------------------------------------------


def count_guard_launches(monkeypatch) -> list[int]:
    """The pool of every guard launch: alone (PageGuard.launch) or with the schedule in one launch."""
    import backends.triton.guard_and_schedule as fused
    from backends.shared.page_guard import PageGuard

    launches = []
    original, original_fused = PageGuard.launch, fused.launch_guard_and_schedule

    def counted(self, num_blocks):
        launches.append(num_blocks)
        return original(self, num_blocks)

    def counted_fused(guard, schedule, num_blocks):
        launches.append(num_blocks)
        monkeypatch.setattr(PageGuard, "launch", original)  # its fallbacks launch the guard alone: not twice
        try:
            return original_fused(guard, schedule, num_blocks)
        finally:
            monkeypatch.setattr(PageGuard, "launch", counted)

    monkeypatch.setattr(PageGuard, "launch", counted)
    monkeypatch.setattr(fused, "launch_guard_and_schedule", counted_fused)
    return launches


@pytest.mark.parametrize("pool_given", [True, False], ids=["pool-given", "first-layer"])
def test_the_guard_runs_once_per_batch_however_many_layers(monkeypatch, pool_given):
    launches = count_guard_launches(monkeypatch)
    seq_lens, next_n = [90, 40], 2
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=11)
    table = batch.page_table.clone()
    table[0, 1] = 2**31 - 1
    backend = BACKENDS["triton"]
    pool = batch.kv_cache.shape[0] if pool_given else None
    plan = plan_for(backend, batch.seq_lens, table, next_n, num_kv_blocks=pool)
    assert len(launches) == (1 if pool_given else 0)
    outs = [backend.run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights) for _ in range(3)]
    assert launches == [batch.kv_cache.shape[0]]
    for out in outs:
        assert torch.isnan(out[:2]).all() and not torch.isnan(out[2:]).any()
    with pytest.raises(IndexBoundsError, match="page-table entry outside"):
        plan.check_errors()


@pytest.mark.parametrize("pool_given", [True, False], ids=["pool-given", "first-layer"])
def test_a_layer_cache_smaller_than_the_checked_pool_is_refused(pool_given):
    from dispatch.contract.errors import LayoutError

    seq_lens, next_n = [90, 40], 1
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=12)
    blocks = batch.kv_cache.shape[0]
    backend = BACKENDS["triton"]
    pool = blocks + 3 if pool_given else None
    plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, num_kv_blocks=pool)
    q = plan.q_in_layout(batch.q_tokens)
    if not pool_given:  # the first layer's cache sets the pool; a later, smaller one is refused
        backend.run(plan, q, batch.kv_cache, batch.weights)
        smaller = batch.kv_cache[: blocks - 1]
    else:
        smaller = batch.kv_cache
    with pytest.raises(LayoutError, match=rf"kv_cache has {smaller.shape[0]} blocks, fewer than the pool of"):
        backend.run(plan, q, smaller, batch.weights)


def test_the_engines_pool_is_the_bound_even_inside_a_larger_tensor():
    # Blocks past the declared pool belong to no request (another layer's slice, say): an entry there
    # poisons its token although the tensor handed in is large enough to hold it.
    seq_lens, next_n = [130, 70], 1
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=13)
    pool = batch.kv_cache.shape[0]
    tensor = torch.cat([batch.kv_cache, batch.kv_cache[:2]])  # two blocks past the pool, same bytes
    table = batch.page_table.clone()
    table[1, 1] = pool  # inside the tensor, outside the pool; request 1 needs page 1 (keys 64..69)
    backend = BACKENDS["triton"]
    plan = plan_for(backend, batch.seq_lens, table, next_n, num_kv_blocks=pool)
    out = backend.run(plan, plan.q_in_layout(batch.q_tokens), tensor, batch.weights)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    assert int(plan.error_flags) == BAD_PAGE


@pytest.mark.parametrize("name", ["triton", "triton.flatten", "deepgemm.sm90"])
def test_a_refreshed_plan_guards_the_new_batch_in_place(name):
    """What dispatch.engines.graphs.update does before a replay: the new lens and table copied into the captured
    plan, then refresh_state. The guard's tensors keep their addresses (the graph reads them) and now
    poison the new batch's bad entry."""
    from dispatch.contract.errors import GraphMismatchError
    from dispatch.contract.key import Arch

    if name.startswith("deepgemm"):
        from backends.deepgemm.plugin import deepgemm_backends
        from tests.support.fake_deep_gemm import FakeDeepGemm

        fake = FakeDeepGemm(num_sms=8)
        backend = next(b for b in deepgemm_backends(load=lambda: fake) if b.name == name)
        heads, arch = 32, Arch.SM90
    else:
        backend, heads, arch = BACKENDS[name], 16, Arch.CPU
    next_n = 2
    first = paged_batch([100, 60], next_n, heads=heads, head_dim=32, seed=14)
    pool = first.kv_cache.shape[0]
    plan = plan_for(backend, first.seq_lens, first.page_table, next_n, arch=arch, num_kv_blocks=pool)
    q = plan.q_in_layout(first.q_tokens)
    backend.run(plan, q, first.kv_cache, first.weights)
    guard = plan.state.guard
    addresses = (guard.safe_table.data_ptr(), guard.lens.data_ptr(), guard.fill.data_ptr())
    schedule = getattr(plan.state, "schedule", None)  # Triton's length-balanced cuts (a tensor for DeepGEMM)
    schedule_tensor = schedule.bounds if name.startswith("triton") else schedule
    schedule_address, first_cuts = schedule_tensor.data_ptr(), schedule_tensor.clone()

    second_lens = torch.tensor([70, 100], dtype=torch.int32)
    second_table = first.page_table.clone()
    second_table[1, 1] = -7  # request 1 now needs page 1
    fresh = plan_for(backend, second_lens, second_table, next_n, arch=arch, num_kv_blocks=pool,
                     max_seq_len=plan.max_context_len)
    plan.context_lens.copy_(fresh.context_lens)
    plan.block_table.copy_(fresh.block_table)
    plan.reset_errors()
    backend.refresh_state(plan.state, fresh.state)
    assert (guard.safe_table.data_ptr(), guard.lens.data_ptr(), guard.fill.data_ptr()) == addresses
    # The schedule is cut again from the new lengths, in place.
    assert schedule_tensor.data_ptr() == schedule_address and not torch.equal(schedule_tensor, first_cuts)
    out = backend.run(plan, q, first.kv_cache, first.weights)
    poisoned = poisoned_tokens(second_table, [70, 100], next_n, pool, plan.max_context_len)
    assert poisoned == [False, False, True, True]
    for row, bad in enumerate(poisoned):
        assert torch.isnan(out[row]).all() if bad else not torch.isnan(out[row]).any()
    assert int(plan.error_flags) == BAD_PAGE

    other_pool = plan_for(backend, second_lens, second_table, next_n, arch=arch, num_kv_blocks=pool + 1,
                          max_seq_len=plan.max_context_len)
    with pytest.raises(GraphMismatchError, match=f"num_kv_blocks={pool + 1}"):
        backend.refresh_state(plan.state, other_pool.state)


@pytest.mark.gpu
@pytest.mark.parametrize("pool_given", [True, False], ids=["pool-given", "first-layer"])
@pytest.mark.parametrize("layout", [Layout.NATIVE, Layout.FLATTEN])
def test_out_of_range_pages_on_gpu(layout, pool_given):
    """Serving-like shape on the GPU: entries of 2**31 - 1, -1 and num_blocks in needed and padding pages."""
    seq_lens, next_n = [3000, 64, 700, 1], 4
    batch = paged_batch(seq_lens, next_n, heads=64, head_dim=128, seed=9, device="cuda")
    num_blocks = batch.kv_cache.shape[0]
    table = batch.page_table.clone()
    table[0, 30], table[1, 5], table[2, 10] = 2**31 - 1, -1, num_blocks  # needed, padding, needed by a few
    max_len = max(seq_lens)
    poisoned = poisoned_tokens(table.cpu(), seq_lens, next_n, num_blocks, max_len)
    plan, out = run_triton(layout, seq_lens, next_n, table, batch, max_len, pool_given=pool_given)
    in_range = torch.where((table >= 0) & (table < num_blocks), table, 0)
    expected = expected_good_rows(plan, batch, in_range, max_len)
    for row, bad in enumerate(poisoned):
        assert torch.isnan(out[row]).all() if bad else not torch.isnan(out[row]).any()
    good = ~torch.tensor(poisoned, device=out.device)
    visible = torch.isfinite(expected[good])
    error = (out[good][visible] - expected[good][visible]).norm() / expected[good][visible].norm()
    assert error < 1e-3
    with pytest.raises(IndexBoundsError, match="page-table entry outside"):
        plan.check_errors()


# --- The step without the logits' -inf tail --------------------------------------------------------


@pytest.mark.parametrize("logits_backend", ["triton", "triton.flatten"])
def test_indexer_step_without_the_tail_still_gives_poisoned_tokens_no_keys(logits_backend):
    """IndexerStep.select asks for clean_logits=False: a poisoned token still selects nothing (its row
    is NaN), and every other token selects what the top-k of the clean logits selects."""
    from dispatch import load_dispatcher
    from dispatch.engines.indexer_step import IndexerStep
    from dispatch.contract.key import ForwardMode, Op
    from dispatch.contract.ops import paged_mqa_logits, topk
    from dispatch.step.paged_plan import PagedBatch, build_plan

    seq_lens, next_n, k = [100, 70, 130], 2, 8
    batch = paged_batch(seq_lens, next_n, heads=16, head_dim=32, seed=12)
    dispatcher = load_dispatcher()
    step = IndexerStep(dispatcher, kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=32**-0.5, head_scale=16**-0.5, index_topk=k)
    table = batch.page_table.clone()
    table[1, 0] = 2**31 - 1  # request 1 needs a page outside the pool: its two tokens are poisoned
    forward = PagedBatch(batch.seq_lens, table, 192, ForwardMode.TARGET_VERIFY, next_n=next_n,
                           num_kv_blocks=batch.kv_cache.shape[0])
    pinned = {Op.INDEXER_Q_QUANT: "triton", Op.PAGED_MQA_LOGITS: logits_backend, Op.TOPK: "triton"}
    plan = build_plan(dispatcher, forward, kv_fp8_dtype=torch.float8_e4m3fn, pinned=pinned, allow_disabled=True)
    tokens = len(seq_lens) * next_n
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, 16, 32, generator=gen).to(torch.bfloat16)
    weights = torch.randn(tokens, 16, generator=gen)
    angles = torch.arange(256, dtype=torch.float64)[:, None] * torch.ones(8)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    positions = torch.tensor([98, 99, 68, 69, 128, 129])
    out = step.select(plan, q, weights, positions, cache, batch.kv_cache)
    assert (out[2:4] == -1).all()
    q_fp8, folded = step._quantise(plan, q, weights, positions, cache)
    clean = paged_mqa_logits(plan, q_fp8, batch.kv_cache, folded)  # with the tail
    want = topk(plan, clean, k)
    for token in (0, 1, 4, 5):
        assert set(out[token].tolist()) == set(want[token].tolist()), token
    with pytest.raises(IndexBoundsError, match="page-table entry outside"):
        plan.check_errors()
