"""build_ragged_metadata's path for checked CPU lengths (dispatch/step/ragged_on_host.py) against its general
torch path (host_checked=False, the ops the GPU fallback runs): every field equal, exactly (both sides
compute the same integers), on ragged batches, skewed and many-request ones, wide tables, page sizes,
pools that cut entries, tables narrower than unchecked lengths, and batches without host lengths."""

from __future__ import annotations

import pytest
import torch

import dispatch.step.ragged_on_host as on_host
from dispatch.step.extend_batch import ExtendBatch, build_ragged_metadata

FIELDS = ("ks", "ke", "gather_slots", "row_request", "key_offsets", "ranges")


def _assert_same(batch: ExtendBatch) -> None:
    got = build_ragged_metadata(batch)
    expected = build_ragged_metadata(batch, host_checked=False)
    for name in FIELDS:
        want, have = getattr(expected, name), getattr(got, name)
        assert have.dtype == want.dtype == torch.int32 and have.shape == want.shape, name
        assert torch.equal(have, want), name
    assert got.length_flags is None and expected.length_flags.item() == 0
    assert got.host_ranges == expected.host_ranges
    assert got.ks.is_contiguous() and got.ke.is_contiguous()


def _batch(prefix, extend, *, block_kv=64, extra_pages=1, pool=None, seed=0, host_lengths=True):
    gen = torch.Generator().manual_seed(seed)
    pages = -(-max((p + e for p, e in zip(prefix, extend)), default=0) // block_kv) + extra_pages
    table = torch.randint(-3, 4 * len(prefix) * pages + 5, (len(prefix), pages), generator=gen, dtype=torch.int32)
    batch = ExtendBatch.from_lengths(prefix, extend, table, block_kv=block_kv, num_kv_blocks=pool)
    if host_lengths:
        return batch
    return ExtendBatch(prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens, page_table=table,
                       total_tokens=batch.total_tokens, total_keys=batch.total_keys, block_kv=block_kv,
                       num_kv_blocks=pool)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("host_lengths", [True, False])
def test_ragged_batches_match(seed, host_lengths):
    gen = torch.Generator().manual_seed(seed)
    requests = int(torch.randint(1, 9, (1,), generator=gen))
    prefix = (torch.randint(150, 400, (requests,), generator=gen)).tolist()
    extend = (torch.randint(0, 200, (requests,), generator=gen)).tolist()
    _assert_same(_batch(prefix, extend, pool=60, seed=seed, host_lengths=host_lengths))


@pytest.mark.parametrize("host_lengths", [True, False])
def test_skewed_and_many_request_batches_match(host_lengths):
    _assert_same(_batch([2000] + [3] * 7, [5] * 8, pool=90, host_lengths=host_lengths))
    _assert_same(_batch([10] * 67, [2] * 67, pool=200, seed=1, host_lengths=host_lengths))
    _assert_same(_batch([0, 64, 0, 1, 127], [0, 0, 3, 63, 1], pool=12, seed=2, host_lengths=host_lengths))


def test_lengths_past_an_unchecked_table_are_slot_minus_one():
    # Tensor-only lengths are checked for sign and totals, not against the table's width: keys past it
    # have no page (slot -1), as on the general path.
    table = torch.tensor([[3], [1]], dtype=torch.int32)
    batch = ExtendBatch(prefix_lens=torch.tensor([100, 0], dtype=torch.int32),
                        extend_lens=torch.tensor([2, 5], dtype=torch.int32), page_table=table,
                        total_tokens=7, total_keys=107)
    _assert_same(batch)
    slots = build_ragged_metadata(batch).gather_slots.tolist()
    assert slots[:64] == list(range(192, 256)) and slots[64:102] == [-1] * 38 and slots[102:] == list(range(64, 69))


@pytest.mark.parametrize("block_kv", [1, 16, 128])
def test_other_page_sizes_and_wide_tables_match(block_kv):
    _assert_same(_batch([70, 0, 33], [5, 40, 0], block_kv=block_kv, extra_pages=3, pool=25, seed=block_kv))


def test_entries_outside_the_pool_and_past_int32_are_slot_minus_one_in_both_forms():
    table = torch.tensor([[0, 2**26 + 1], [2**25 + 3, -1]], dtype=torch.int32)
    for pool in (4, 2**30, None):
        batch = ExtendBatch.from_lengths([64, 60], [10, 4], table, num_kv_blocks=pool)
        _assert_same(batch)
        slots = build_ragged_metadata(batch).gather_slots
        assert (slots[64:74] == -1).all() and (slots[74:] == -1).all() and slots[:64].tolist() == list(range(64))


def test_batches_without_keys_or_new_tokens_match():
    _assert_same(ExtendBatch.from_lengths([], [], torch.zeros(0, 2, dtype=torch.int32)))
    _assert_same(ExtendBatch.from_lengths([0, 0], [0, 0], torch.zeros(2, 1, dtype=torch.int32)))
    _assert_same(_batch([100, 30], [0, 0]))


def test_the_cached_arange_is_never_handed_out_or_written():
    batch = _batch([100, 30], [7, 9], pool=40)
    before = on_host.arange_on_host(4096).copy()
    metadata = build_ragged_metadata(batch)
    metadata.ke.add_(1)  # a caller writing its own result leaves the cache alone
    metadata.gather_slots.add_(1)
    assert (on_host.arange_on_host(4096) == before).all()
    with pytest.raises(ValueError, match="read-only"):
        on_host.arange_on_host(8)[0] = 1


@pytest.mark.parametrize("block_kv", [1, 16, 64])
def test_batches_whose_requests_fill_their_pages_match(block_kv):
    # Every request but the last a whole number of pages: the slots are written by one broadcast add.
    _assert_same(_batch([3 * block_kv - 1, block_kv - 1, 0, 5], [1, 1, 0, 7], block_kv=block_kv, pool=9, seed=block_kv))
    table = torch.tensor([[0, 2**26 + 1, -1], [2**31 - 1, 3, 1]], dtype=torch.int32)
    for pool in (4, None):
        batch = ExtendBatch.from_lengths([2 * block_kv, block_kv], [block_kv, block_kv + 1], table,
                                         block_kv=block_kv, num_kv_blocks=pool)
        _assert_same(batch)
        slots = build_ragged_metadata(batch).gather_slots.tolist()
        assert slots[:block_kv] == list(range(block_kv))
        if pool == 4:  # 2^26 + 1 and -1 are no block of it (without a pool 2^26 + 1 is, below 2^31 / block_kv)
            assert slots[block_kv:3 * block_kv] == [-1] * (2 * block_kv)
