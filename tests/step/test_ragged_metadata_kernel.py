"""The one-launch Triton kernel of an extend batch's ragged metadata (dispatch/step/ragged_metadata_kernel.py)
against build_ragged_metadata's torch device path (host_checked=False): every field equal. Both sides
compute the same integers from the same lengths and table, so exact equality is the right comparison.
Shapes: ragged batches with empty requests, non-contiguous inputs, block sizes, pools that cut the table,
and the hostile inputs of tests/step/test_untrusted_extend.py (negative lengths, totals that disagree with
them, entries far outside the pool or whose slots pass int32)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dispatch.step.ragged_metadata_kernel import (INDICES_PER_PROGRAM, MAX_SHIFTS, REQUESTS_PER_STEP,
                                                  ragged_metadata_in_one_launch)
from dispatch.contract.bounds import BAD_LENGTH
from dispatch.contract.extend_plan import DEFAULT_LOGITS_BYTES
from dispatch.step.extend_batch import ExtendBatch, build_ragged_metadata
from tests.support.extend_batch import unchecked_extend_batch

FIELDS = ("ks", "ke", "gather_slots", "row_request", "key_offsets", "length_flags", "ranges")
ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel under the interpreter


def _on_device(batch: ExtendBatch) -> ExtendBatch:
    """The batch with its tensors on DEVICE (where a GPU is visible: the lengths are then never read)."""
    if DEVICE == "cpu":
        return batch
    return dataclasses.replace(batch, prefix_lens=batch.prefix_lens.to(DEVICE),
                               extend_lens=batch.extend_lens.to(DEVICE), page_table=batch.page_table.to(DEVICE))


def _launch(batch: ExtendBatch):
    return ragged_metadata_in_one_launch(_on_device(batch))


def _assert_same(batch: ExtendBatch) -> None:
    expected = build_ragged_metadata(batch, host_checked=False)  # the torch ops, on the CPU
    got = _launch(batch)
    for name in FIELDS:
        want, have = getattr(expected, name), getattr(got, name).cpu()
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.equal(have, want), name
    assert got.total_tokens == expected.total_tokens and got.total_keys == expected.total_keys
    assert got.host_ranges == expected.host_ranges


def _random_batch(requests: int, seed: int, *, block_kv: int = 64, pool: int | None = None,
                  empty_every: int = 3) -> ExtendBatch:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 5 * block_kv, (requests,), generator=gen)
    extend = torch.randint(0, 3 * block_kv, (requests,), generator=gen)
    extend[::empty_every] = 0  # requests with no new tokens share the next one's first row
    prefix[1::empty_every] = 0
    pages = int((prefix + extend).max()) // block_kv + 2
    table = torch.randint(-5, 3 * requests * pages, (requests, pages), generator=gen, dtype=torch.int32)
    return ExtendBatch.from_lengths(prefix.tolist(), extend.tolist(), table, block_kv=block_kv, num_kv_blocks=pool)


# Several programs (more rows and keys than INDICES_PER_PROGRAM) and several steps over the requests
# (more than REQUESTS_PER_STEP) at the larger sizes.
@pytest.mark.parametrize("requests", [1, 2, 7, REQUESTS_PER_STEP + 1, 3 * REQUESTS_PER_STEP + 5])
@pytest.mark.parametrize("pool", [None, 40])
def test_ragged_batches_match_the_torch_path(requests, pool):
    batch = _random_batch(requests, seed=requests, pool=pool)
    if requests > REQUESTS_PER_STEP:
        assert batch.total_keys > INDICES_PER_PROGRAM
    _assert_same(batch)


@pytest.mark.parametrize("block_kv", [1, 16, 128])
def test_other_page_sizes_match(block_kv):
    _assert_same(_random_batch(9, seed=block_kv, block_kv=block_kv, pool=50))


def test_non_contiguous_lengths_and_table_match():
    base = _random_batch(6, seed=11, pool=60)
    lengths = torch.stack((base.prefix_lens, base.extend_lens), dim=1)  # [B, 2]: each column strided
    wide = torch.full((6, 2 * base.page_table.shape[1]), -7, dtype=torch.int32)
    wide[:, ::2] = base.page_table
    batch = ExtendBatch(prefix_lens=lengths[:, 0], extend_lens=lengths[:, 1], page_table=wide[:, ::2],
                        total_tokens=base.total_tokens, total_keys=base.total_keys, num_kv_blocks=60)
    assert not batch.page_table.is_contiguous() and batch.prefix_lens.stride(0) == 2
    _assert_same(batch)


def test_a_batch_of_only_cached_keys_and_an_empty_batch_match():
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    _assert_same(ExtendBatch.from_lengths([100, 30], [0, 0], table))
    _assert_same(ExtendBatch.from_lengths([], [], torch.zeros(0, 3, dtype=torch.int32)))


@pytest.mark.parametrize("entry", [2**26 + 1, 2**25, -(2**26), 2**31 - 1, -(2**31)])
def test_entries_far_outside_the_pool_are_slot_minus_one_as_on_the_torch_path(entry):
    table = torch.tensor([[0, 1], [2, entry]], dtype=torch.int32)
    batch = ExtendBatch.from_lengths([0, 64], [10, 10], table, num_kv_blocks=4)
    _assert_same(batch)
    assert (_launch(batch).gather_slots[74:] == -1).all()


def test_an_entry_whose_slots_pass_int32_is_no_slot_even_inside_a_huge_pool():
    table = torch.tensor([[2**25 + 3, 1]], dtype=torch.int32)
    batch = ExtendBatch.from_lengths([64], [1], table, num_kv_blocks=2**30)
    _assert_same(batch)
    slots = _launch(batch).gather_slots.cpu()
    assert (slots[:64] == -1).all() and slots[64].item() == 64


@pytest.mark.parametrize(
    ("prefix", "extend", "tokens", "keys"),
    [([1, 2], [3, -2], 1, 4), ([1, 2], [3, 4], 6, 10), ([1, 2], [3, 4], 7, 12), ([-9, 2], [3, 4], 7, 10),
     ([1, 2], [3, 4], 40, 50), ([2**31 - 1, 5], [2**31 - 1, 1], 3, 9), ([-(2**31), 0], [0, 3], 3, 3),
     ([0, 1, 2], [-5, 4, 3], 7, 10), ([0, -70, 2], [5, 4, 3], 12, 12)],
    ids=["negative-extend", "tokens-short", "keys-long", "negative-prefix", "both-long", "int32-max", "int32-min",
         "negative-first-extend", "negative-middle-prefix"],
)
def test_device_lengths_that_cannot_occur_flag_and_poison_as_on_the_torch_path(prefix, extend, tokens, keys):
    batch = unchecked_extend_batch(prefix_lens=torch.tensor(prefix, dtype=torch.int32),
                       extend_lens=torch.tensor(extend, dtype=torch.int32),
                       page_table=torch.zeros(len(prefix), 2, dtype=torch.int32), total_tokens=tokens, total_keys=keys)
    _assert_same(batch)
    got = _launch(batch)
    assert got.length_flags.item() == BAD_LENGTH and (got.gather_slots == -1).all()


def test_consistent_device_lengths_are_not_flagged():
    got = _launch(_random_batch(5, seed=2))
    assert got.length_flags.item() == 0 and (got.gather_slots >= 0).any()


@pytest.mark.gpu
def test_on_a_gpu_build_ragged_metadata_takes_the_one_launch_path_and_matches_the_torch_ops(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible to torch")
    import dispatch.step.ragged_metadata_kernel as module

    calls = []  # the one launch's function, looked up by its module at every call
    real = module.ragged_metadata_on_device
    monkeypatch.setattr(module, "ragged_metadata_on_device", lambda *args: calls.append(args) or real(*args))
    host = _random_batch(3 * REQUESTS_PER_STEP + 5, seed=5, pool=200)
    device = ExtendBatch.from_lengths(host.host_prefix_lens, host.host_extend_lens, host.page_table.cuda(),
                                      num_kv_blocks=200)
    expected = build_ragged_metadata(host, host_checked=False)  # the torch ops, on the CPU
    got = build_ragged_metadata(device)
    assert len(calls) == 1
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(expected, name)), name


def test_an_extend_plan_on_the_kernel_path_costs_one_launch_and_a_handful_of_torch_ops(monkeypatch):
    """What a GPU's host pays per extend plan at M = 16K, S = 64K: the kernel (once) and the few torch ops
    around it, none per chunk (37 on the torch path; tests/step/test_plan_host_cost.py). The interpreter's
    own tensor copies inside the launch are no GPU host cost and are not counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    import dispatch.step.ragged_metadata_kernel as module
    import dispatch.step.extend_plan
    from dispatch import load_dispatcher
    from tests.step.test_plan_host_cost import _extend_batch, _Launches

    grids = []
    real = module._ragged_metadata_kernel

    class _Counted:
        def __getitem__(self, grid):
            grids.append(grid)

            def launch(*args, **kwargs):
                with _disable_current_modes():
                    return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_ragged_metadata_kernel", _Counted())
    monkeypatch.setattr(dispatch.step.extend_plan, "one_launch", lambda batch: module.metadata_in_one_launch)
    dispatcher, batch = load_dispatcher(arch="cpu"), _on_device(_extend_batch(prefix=12288))
    expected = build_ragged_metadata(_extend_batch(prefix=12288), host_checked=False)
    for budget in (1 << 40, DEFAULT_LOGITS_BYTES):  # one chunk; four, three past key 0
        build_extend_plan = dispatch.step.extend_plan.build_extend_plan
        build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", logits_byte_budget=budget)
        grids.clear()
        with _Launches() as counted:
            plan = build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", logits_byte_budget=budget)
        # The buffer, then views only, whatever the chunks: the kernel writes every chunk's ks / ke
        # relative to its window (there were one subtraction and one unbind a chunk past key 0, and
        # three more splits). The error flags are the kernel's: no copy of its length flags.
        assert len(grids) == 1 and counted.launches == 1, dict(counted.ops)
        views = sum(n for name, n in counted.ops.items() if name != "empty")
        # the one split, the rows' [2, M] ks / ke, and with several chunks all rows' requests
        assert views <= 2 + (len(plan.chunks) > 1), dict(counted.ops)
        assert torch.equal(plan.metadata.ranges.cpu(), expected.ranges)
        assert plan.error_flags.data_ptr() != plan.metadata.length_flags.data_ptr()
        for c in plan.chunks:  # the chunks' views equal the torch path's
            rows = c.chunk.rows
            assert torch.equal(c.ks.cpu() + c.chunk.key_begin, expected.ks[rows])
            assert torch.equal(c.ke.cpu() + c.chunk.key_begin, expected.ke[rows])
            assert torch.equal(c.lengths.cpu(), expected.ke[rows] - expected.ks[rows])
            assert torch.equal(c.page_rows.cpu(), expected.row_request[rows])


def _assert_chunks_as_the_torch_path(batch: ExtendBatch, budget: int) -> int:
    """The one launch's chunk views against the torch device path's metadata and chunk_tensors_from_ranges
    (its subtractions): the same chunks and, per chunk, equal ks, ke, lengths and page rows, each a
    contiguous int32 view of the launch's one buffer. Returns the chunks."""
    from dispatch.step.extend_plan import chunk_tensors_from_ranges
    from dispatch.step.ragged_metadata_kernel import chunk_shifts, metadata_in_one_launch

    expected = build_ragged_metadata(batch, host_checked=False)
    want = chunk_tensors_from_ranges(expected, expected.chunks(budget))
    metadata, out = metadata_in_one_launch(_on_device(batch), budget)
    assert torch.equal(metadata.ranges.cpu(), expected.ranges)
    assert torch.equal(metadata.row_request.cpu(), expected.row_request)
    assert [c.chunk for c in out.chunks] == [c.chunk for c in want]
    base = metadata.gather_slots.untyped_storage().data_ptr()
    for ours, theirs in zip(out.chunks, want, strict=True):
        for field in ("ks", "ke", "lengths", "page_rows"):
            have = getattr(ours, field)
            assert have.dtype == torch.int32 and have.is_contiguous(), field
            assert torch.equal(have.cpu(), getattr(theirs, field)), (field, ours.chunk)
    if chunk_shifts([c.chunk for c in out.chunks]) is not None:  # views of the buffer, no subtraction's own
        assert all(c.ks.untyped_storage().data_ptr() == base for c in out.chunks)
    return [c.chunk for c in out.chunks]


# (prefix, extend, budget, the window starts the kernel is handed: None for more than it takes). A tight
# chunk's window starts at its first row's request's first key, so it moves only where a chunk starts in
# another request than the chunk before: at most once a request, however many chunks.
@pytest.mark.parametrize(
    ("prefix", "extend", "budget", "shifts"),
    [([0], [5], 1 << 20, 0), ([0], [300], 4096, 0), ([0, 300], [17, 1], 4096, 1), ([12, 0, 700], [40, 3, 90], 20000, 1),
     ([0] * 4, [256] * 4, 1 << 14, 3), ([100, 0, 50], [0, 0, 200], 4096, 1), ([64, 0], [0, 0], 4096, 0),
     ([0] * 9, [64] * 9, 64 * 64 * 4, MAX_SHIFTS), ([0] * 12, [64] * 12, 64 * 64 * 4, None), ([5] * 3, [400] * 3, 6000, 2)],
    ids=["one-chunk", "one-request-many-chunks", "two-windows", "ragged", "four-requests",
         "first-request-only-cached", "no-rows", "exactly-max-shifts", "past-max-shifts", "cut-inside-requests"],
)
def test_the_launchs_chunk_views_equal_the_torch_paths_chunks(prefix, extend, budget, shifts):
    """Ragged lengths, requests of no new tokens (the first chunk's window then starts past key 0), one
    request cut into many chunks, a batch of no rows, and more window starts than the kernel's shift
    arguments (MAX_SHIFTS: those chunks subtract their own, as the torch path does)."""
    from dispatch.step.ragged_metadata_kernel import chunk_shifts

    pages = -(-max(p + e for p, e in zip(prefix, extend)) // 64) + 1
    table = torch.arange(len(prefix) * pages, dtype=torch.int32).view(len(prefix), pages)
    batch = ExtendBatch.from_lengths(prefix, extend, table, num_kv_blocks=table.numel())
    chunks = _assert_chunks_as_the_torch_path(batch, budget)
    assert len(chunks) == 0 if not sum(extend) else len(chunks) > (budget < 1 << 20)
    got = chunk_shifts(chunks)
    assert (got if got is None else len(got)) == shifts


def test_chunk_views_without_host_lengths_span_every_key_and_need_no_shift():
    """Without host lengths every chunk's window is all keys from key 0: the rows' own ks / ke, however
    many chunks the budget cuts (here more than the kernel's shift arguments)."""
    host = _random_batch(5, seed=3, pool=80)
    batch = ExtendBatch(prefix_lens=host.prefix_lens, extend_lens=host.extend_lens, page_table=host.page_table,
                        total_tokens=host.total_tokens, total_keys=host.total_keys, num_kv_blocks=80)
    budget = 4 * batch.total_keys * max(batch.total_tokens // (2 * MAX_SHIFTS), 1)
    assert len(_assert_chunks_as_the_torch_path(batch, budget)) > MAX_SHIFTS


def test_chunk_shifts_name_each_change_of_window_start_up_to_the_kernels_arguments():
    from dispatch.contract.extend_plan import Chunk
    from dispatch.step.ragged_metadata_kernel import chunk_shifts

    assert chunk_shifts([]) == () and chunk_shifts([Chunk(0, 9, 0, 40)]) == ()
    assert chunk_shifts([Chunk(0, 4, 64, 90), Chunk(4, 9, 64, 99), Chunk(9, 12, 130, 150)]) == ((0, 64), (9, 130))
    many = [Chunk(i, i + 1, 10 * i, 10 * i + 5) for i in range(MAX_SHIFTS + 2)]
    assert len(chunk_shifts(many[:MAX_SHIFTS + 1])) == MAX_SHIFTS and chunk_shifts(many) is None


def test_a_plan_on_the_kernel_path_starts_its_error_flags_from_the_length_flags_in_a_word_of_its_own(monkeypatch):
    """The kernel writes the plan's error flags beside the length flags (no copy launched): a hostile
    batch's plan starts flagged BAD_LENGTH, and what a layer ORs into the plan's word leaves the metadata's."""
    import dispatch.step.extend_plan
    import dispatch.step.ragged_metadata_kernel as module
    from dispatch import load_dispatcher

    monkeypatch.setattr(dispatch.step.extend_plan, "one_launch", lambda batch: module.metadata_in_one_launch)
    dispatcher = load_dispatcher(arch="cpu")
    for extend, flagged in (([3, -2], BAD_LENGTH), ([3, 4], 0)):
        batch = _on_device(unchecked_extend_batch(
            prefix_lens=torch.tensor([1, 2], dtype=torch.int32), extend_lens=torch.tensor(extend, dtype=torch.int32),
            page_table=torch.zeros(2, 2, dtype=torch.int32), total_tokens=7, total_keys=10))
        plan = dispatch.step.extend_plan.build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn")
        assert plan.error_flags.item() == plan.metadata.length_flags.item() == flagged
        plan.error_flags.bitwise_or_(1 << 20)
        assert plan.metadata.length_flags.item() == flagged


# Compiles the kernel for sm_90 with Triton's own compiler (no GPU needed), twice: every integer argument
# a runtime int32 (the chunk shifts int64), and every one that can be 1 a constant 1, as Triton's launcher
# specializes an argument equal to 1 (a batch of one row, key or request): the CPU tests run the
# interpreter, which does not.
_COMPILE_FOR_SM90 = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dispatch.step import ragged_metadata_kernel as module

    kernel = module._ragged_metadata_kernel
    names = kernel.arg_names
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    values = {"BLOCK": module.INDICES_PER_PROGRAM, "REQUESTS_PER_STEP": module.REQUESTS_PER_STEP, "BLOCK_KV": 64,
              "PAGE_SHIFT": 6, "BAD_LENGTH": module.BAD_LENGTH}
    assert constexpr == set(values), f"give the sm90 compile test a value for {constexpr - set(values)}"
    # The chunk shifts are never specialized (do_not_specialize): runtime int64 whatever their value.
    shifts = [p.name for p in kernel.params if p.do_not_specialize]
    assert shifts == [f"shift_{i}" for i in range(module.MAX_SHIFTS)], shifts
    ints = [n for n in names if n not in constexpr and not n.endswith("_ptr") and n not in shifts]
    for ones in ([], [n for n in ints if n != "limit"]):
        signature = {n: "constexpr" if n in constexpr or n in ones else "*i32" if n.endswith("_ptr")
                     else "i64" if n in shifts else "i32" for n in names}
        given = {(names.index(n),): values.get(n, 1) for n in names if signature[n] == "constexpr"}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=given), target=GPUTarget("cuda", 90, 32))
        print(len(ones), ".target sm_90" in compiled.asm["ptx"])
''')


def test_the_kernel_compiles_for_sm90_with_arguments_runtime_and_specialized_to_one():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter cannot compile
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["0", "True", "9", "True"]
