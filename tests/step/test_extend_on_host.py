"""build_extend_plan's one-pass host path (dispatch/step/extend_on_host.py: the metadata and every chunk's
tensors of a CPU batch with host lengths) against the reference construction, the torch device path's
metadata (build_ragged_metadata with host_checked=False, the ops a GPU without Triton runs) and its
chunks' views (chunk_tensors_from_ranges): every tensor equal, exactly (both sides compute the same
integers), at ragged shapes, requests of no new tokens or no keys, one request, no requests, budgets
that cut the rows into one chunk or many (some past key 0, some inside a request), page sizes, and
pools and tables whose entries are no block."""

from __future__ import annotations

import pytest
import torch

from dispatch import load_dispatcher
from dispatch.contract.errors import LayoutError
from dispatch.step.extend_batch import ExtendBatch, build_ragged_metadata, page_limit
from dispatch.step.extend_on_host import metadata_and_chunks_on_host
from dispatch.step.extend_plan import build_extend_plan, chunk_tensors_from_ranges

METADATA = ("ks", "ke", "gather_slots", "row_request", "key_offsets")
CHUNK = ("ks", "ke", "lengths", "page_rows")


def _batch(prefix, extend, *, block_kv=64, extra_pages=1, pool=None, seed=0, low=0):
    gen = torch.Generator().manual_seed(seed)
    pages = -(-max((p + e for p, e in zip(prefix, extend)), default=0) // block_kv) + extra_pages
    table = torch.randint(low, 4 * len(prefix) * pages + 5, (len(prefix), pages), generator=gen, dtype=torch.int32)
    return ExtendBatch.from_lengths(prefix, extend, table, block_kv=block_kv, num_kv_blocks=pool)


def _assert_same(batch: ExtendBatch, budget: int) -> tuple:
    metadata, chunks = metadata_and_chunks_on_host(batch, page_limit(batch), budget)
    expected = build_ragged_metadata(batch, host_checked=False)
    expected_chunks = chunk_tensors_from_ranges(expected, expected.chunks(budget))
    for name in METADATA:
        want, have = getattr(expected, name), getattr(metadata, name)
        assert have.dtype == want.dtype == torch.int32 and have.shape == want.shape, name
        assert torch.equal(have, want), name
    assert metadata.host_ranges == expected.host_ranges and metadata.length_flags is None
    assert (metadata.total_tokens, metadata.total_keys) == (expected.total_tokens, expected.total_keys)
    assert [c.chunk for c in chunks] == [c.chunk for c in expected_chunks]
    for ours, theirs in zip(chunks, expected_chunks):
        for name in CHUNK:
            have, want = getattr(ours, name), getattr(theirs, name)
            assert have.dtype == torch.int32 and have.is_contiguous() and torch.equal(have, want), name
    return metadata, chunks


@pytest.mark.parametrize("seed", range(6))
def test_ragged_batches_match_the_reference_construction(seed):
    gen = torch.Generator().manual_seed(seed)
    requests = int(torch.randint(1, 10, (1,), generator=gen))
    prefix = torch.randint(0, 400, (requests,), generator=gen)
    extend = torch.randint(0, 200, (requests,), generator=gen)
    extend[::3] = 0  # requests of no new tokens own no rows (and no piece of a chunk)
    budget = int(torch.randint(4 * 700, 4 * 200_000, (1,), generator=gen))
    _assert_same(_batch(prefix.tolist(), extend.tolist(), pool=50 + seed, seed=seed, low=-3), budget)


def test_budgets_from_one_chunk_to_many_match():
    batch = _batch([0, 300, 12, 0], [170, 1, 90, 40], pool=30, seed=3)
    counts = set()
    for budget in (1 << 30, 200_000, 20_000, 4 * 600):
        _, chunks = _assert_same(batch, budget)
        counts.add(len(chunks))
        if budget < 1 << 30:
            assert any(c.chunk.key_begin for c in chunks), "a budget meant to cut past key 0 did not"
    assert 1 in counts and max(counts) >= 8
    with pytest.raises(LayoutError, match="its logits alone"):  # one row's logits past the budget: refused alike
        metadata_and_chunks_on_host(batch, page_limit(batch), 4 * 100)
    with pytest.raises(LayoutError, match="its logits alone"):
        build_ragged_metadata(batch, host_checked=False).chunks(4 * 100)


def test_edge_batches_match():
    _assert_same(_batch([100], [7]), 1 << 20)  # one request
    _assert_same(_batch([0], [1]), 1 << 20)  # one row, one key
    _assert_same(_batch([100, 30], [0, 0]), 1 << 20)  # keys but no rows: no chunks
    _assert_same(_batch([0, 0], [0, 0]), 1 << 20)  # no keys
    metadata, chunks = _assert_same(ExtendBatch.from_lengths([], [], torch.zeros(0, 2, dtype=torch.int32)), 1 << 20)
    assert chunks == () and metadata.gather_slots.numel() == 0
    _assert_same(_batch([2000] + [3] * 7, [5] * 8, pool=90), 1 << 16)  # skewed
    _assert_same(_batch([10] * 67, [2] * 67, pool=200, seed=1), 1 << 14)  # many requests


@pytest.mark.parametrize("block_kv", [1, 16, 64, 128])
def test_page_sizes_pools_and_filled_pages_match(block_kv):
    batch = _batch([70, 0, 33], [5, 40, 0], block_kv=block_kv, extra_pages=3, pool=25, seed=block_kv, low=-2)
    _assert_same(batch, 1 << 14)
    # Every request but the last fills its pages (the slots' repeat by block_kv, cut at S).
    _assert_same(_batch([3 * block_kv - 1, block_kv - 1, 0, 5], [1, 1, 0, 7], block_kv=block_kv, pool=9), 1 << 14)
    table = torch.tensor([[0, 2**26 + 1, -1], [2**31 - 1, 3, 1]], dtype=torch.int32)
    for pool in (4, None):
        batch = ExtendBatch.from_lengths([2 * block_kv, block_kv], [block_kv, block_kv + 1], table,
                                         block_kv=block_kv, num_kv_blocks=pool)
        metadata, _ = _assert_same(batch, 1 << 20)
        assert metadata.gather_slots[:block_kv].tolist() == list(range(block_kv))


def test_build_extend_plan_takes_the_host_path_and_its_plan_matches():
    dispatcher = load_dispatcher(arch="cpu")
    batch = _batch([0, 300, 12], [170, 1, 90], pool=30, seed=4)
    plan = build_extend_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn", logits_byte_budget=20_000)
    expected = build_ragged_metadata(batch, host_checked=False)
    assert plan.metadata.row_ranges is None  # the host path: absolute ks / ke wait until asked for
    for name in METADATA:
        assert torch.equal(getattr(plan.metadata, name), getattr(expected, name)), name
    for ours, theirs in zip(plan.chunks, chunk_tensors_from_ranges(expected, expected.chunks(20_000)), strict=True):
        assert ours.chunk == theirs.chunk
        for name in CHUNK:
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert plan.error_flags.tolist() == [0]
