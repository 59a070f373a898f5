"""The extend batch's ragged metadata against the rule spelled out one token at a time, the logits
chunks against their budget, and the validation of what an engine hands in."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.contract.errors import LayoutError
from dispatch.step.extend_batch import DEFAULT_LOGITS_BYTES, ExtendBatch, build_ragged_metadata

BLOCK_KV = 64


def random_table(totals, seed=0, width_extra=1):
    gen = torch.Generator().manual_seed(seed)
    pages = max([-(-t // BLOCK_KV) for t in totals] + [1]) + width_extra
    return torch.randint(0, 1000, (len(totals), pages), generator=gen, dtype=torch.int32)


def spelled_out(prefix_lens, extend_lens, table):
    """ks, ke, row_request and gather slots, one token and one key at a time."""
    ks, ke, rows, slots, offset = [], [], [], [], 0
    for request, (cached, new) in enumerate(zip(prefix_lens, extend_lens)):
        for j in range(new):
            ks.append(offset)
            ke.append(offset + cached + j + 1)
            rows.append(request)
        for position in range(cached + new):
            slots.append(int(table[request, position // BLOCK_KV]) * BLOCK_KV + position % BLOCK_KV)
        offset += cached + new
    return ks, ke, rows, slots


lengths = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 70)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths, seed=st.integers(0, 1000))
def test_metadata_matches_the_rule(lengths, seed):
    prefix, extend = [p for p, _ in lengths], [e for _, e in lengths]
    table = random_table([p + e for p, e in lengths], seed)
    m = build_ragged_metadata(ExtendBatch.from_lengths(prefix, extend, table))
    ks, ke, rows, slots = spelled_out(prefix, extend, table)
    assert m.ks.tolist() == ks and m.ke.tolist() == ke and m.row_request.tolist() == rows
    assert m.gather_slots.tolist() == slots
    assert list(m.host_ks) == ks and list(m.host_ke) == ke
    assert m.key_offsets.tolist()[-1] == sum(prefix) + sum(extend)
    assert all(t.dtype == torch.int32 for t in (m.ks, m.ke, m.gather_slots, m.row_request, m.key_offsets))


@settings(max_examples=60, deadline=None)
@given(lengths=lengths, budget_rows=st.integers(1, 40), host=st.booleans())
def test_chunks_cover_every_row_once_within_budget(lengths, budget_rows, host):
    prefix, extend = [p for p, _ in lengths], [e for _, e in lengths]
    batch = ExtendBatch.from_lengths(prefix, extend, random_table([p + e for p, e in lengths]))
    if not host:
        batch = dataclasses.replace(batch, host_prefix_lens=None, host_extend_lens=None)
    m = build_ragged_metadata(batch)
    budget = budget_rows * 4 * max(m.total_keys, 1)
    chunks = m.chunks(budget)
    assert [row for c in chunks for row in range(c.row_begin, c.row_end)] == list(range(m.total_tokens))
    for chunk in chunks:
        assert chunk.row_end > chunk.row_begin and chunk.logits_bytes <= budget
        ks, ke = m.ks[chunk.rows], m.ke[chunk.rows]
        assert (ks >= chunk.key_begin).all() and (ke <= chunk.key_end).all()
        local_ks, local_ke = m.chunk_ranges(chunk)
        assert torch.equal(local_ks, ks - chunk.key_begin) and torch.equal(local_ke, ke - chunk.key_begin)
        if host:  # tight: the window is exactly the first row's ks to the last row's ke
            assert (chunk.key_begin, chunk.key_end) == (int(ks[0]), int(ke[-1]))
        else:
            assert (chunk.key_begin, chunk.key_end) == (0, m.total_keys)


def greedy_chunks(ks, ke, budget):
    """The chunking rule one row at a time: each chunk takes rows while rows x (ke[last] - ks[first]) fp32
    logits fit the budget."""
    chunks, begin = [], 0
    while begin < len(ks):
        end = begin + 1
        while end < len(ks) and (end + 1 - begin) * (ke[end] - ks[begin]) * 4 <= budget:
            end += 1
        chunks.append((begin, end, ks[begin], ke[end - 1]))
        begin = end
    return chunks


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 90)), min_size=1, max_size=8),
       budget_cells=st.integers(1, 40000))
def test_tight_chunks_are_the_greedy_rule(lengths, budget_cells):
    prefix, extend = [p for p, _ in lengths], [e for _, e in lengths]
    m = build_ragged_metadata(ExtendBatch.from_lengths(prefix, extend, random_table([p + e for p, e in lengths])))
    ks, ke = m.ks.tolist(), m.ke.tolist()
    budget = budget_cells * 4 + budget_cells % 4  # budgets that are not a multiple of 4 bytes too
    if any((e - s) * 4 > budget for s, e in zip(ks, ke)):
        with pytest.raises(LayoutError, match="its logits alone take"):
            m.chunks(budget)
        return
    assert [(c.row_begin, c.row_end, c.key_begin, c.key_end) for c in m.chunks(budget)] == greedy_chunks(ks, ke, budget)


def test_tight_chunks_follow_requests():
    """Two requests of 1000 keys, budget 400 rows x 1000 keys: request 0's 400 rows fill one chunk
    exactly; request 1's rows see 501.. 1000 keys, so 430 x 930 fit and the last 70 x 1000."""
    m = build_ragged_metadata(ExtendBatch.from_lengths([600, 500], [400, 500], random_table([1000, 1000])))
    chunks = m.chunks(400 * 1000 * 4)
    assert [(c.row_begin, c.row_end, c.key_begin, c.key_end) for c in chunks] == [
        (0, 400, 0, 1000),
        (400, 830, 1000, 1930),
        (830, 900, 1000, 2000),
    ]


def test_default_budget_is_vllms():
    assert DEFAULT_LOGITS_BYTES == 512 << 20
    m = build_ragged_metadata(ExtendBatch.from_lengths([60000], [8192], random_table([68192])))
    chunks = m.chunks()
    assert len(chunks) > 1 and all(c.logits_bytes <= 512 << 20 for c in chunks)


def test_one_row_that_cannot_fit_is_an_error():
    m = build_ragged_metadata(ExtendBatch.from_lengths([1000], [2], random_table([1002])))
    with pytest.raises(LayoutError, match="query row 0 sees 1001 keys"):
        m.chunks(1000 * 4)
    assert len(m.chunks(1002 * 4)) == 2
    no_host = build_ragged_metadata(dataclasses.replace(m_batch := ExtendBatch.from_lengths(
        [1000], [2], random_table([1002])), host_prefix_lens=None, host_extend_lens=None))
    assert m_batch.total_keys == 1002
    with pytest.raises(LayoutError, match="all 1002 gathered keys take 4008 bytes"):
        no_host.chunks(4000)
    with pytest.raises(LayoutError, match="byte_budget"):
        m.chunks(0)


def test_empty_batch():
    m = build_ragged_metadata(ExtendBatch.from_lengths([], [], torch.zeros(0, 1, dtype=torch.int32)))
    assert m.ks.shape == (0,) and m.gather_slots.shape == (0,) and m.chunks() == []


@pytest.mark.parametrize(
    "prefix,extend,match",
    [
        ([5, -1], [1, 1], "request 1: prefix_len=-1"),
        ([5, 1], [1, -3], "request 1: prefix_len=1, extend_len=-3"),
        ([5, 200], [1, 1], "request 1: 200 \\+ 1 keys need more than the page table's 2 pages"),
    ],
)
def test_bad_lengths_name_the_request(prefix, extend, match):
    with pytest.raises(LayoutError, match=match):
        ExtendBatch.from_lengths(prefix, extend, torch.zeros(2, 2, dtype=torch.int32))


def test_bad_tensors_and_totals():
    table = torch.zeros(2, 2, dtype=torch.int32)
    good = dict(prefix_lens=torch.tensor([1, 2], dtype=torch.int32), extend_lens=torch.tensor([3, 4], dtype=torch.int32),
                page_table=table, total_tokens=7, total_keys=10)
    ExtendBatch(**good)
    for change, match in [
        (dict(prefix_lens=torch.tensor([1, 2])), "prefix_lens must be int32"),
        (dict(extend_lens=torch.tensor([3], dtype=torch.int32)), "extend_lens has 1 requests"),
        (dict(page_table=table.long()), "page_table must be int32"),
        (dict(total_tokens=-1), "total_tokens must be a host int"),
        (dict(total_keys=torch.tensor(10)), "total_keys must be a host int"),
        (dict(total_keys=5), "total_keys=5 < total_tokens=7"),
        (dict(block_kv=48), "block_kv must be a power of two"),
        (dict(host_prefix_lens=(1, 2)), "come together"),
        (dict(host_prefix_lens=(1, 2), host_extend_lens=(3, 5)), "totals disagree"),
    ]:
        with pytest.raises(LayoutError, match=match):
            ExtendBatch(**{**good, **change})


@pytest.mark.gpu
def test_metadata_never_syncs_on_gpu():
    table = random_table([5000, 70, 9000], width_extra=3).cuda()
    batch = ExtendBatch.from_lengths([4000, 0, 8000], [1000, 70, 1000], table)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m = build_ragged_metadata(batch)
        m.chunk_ranges(m.chunks()[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ks, ke, rows, slots = spelled_out([4000, 0, 8000], [1000, 70, 1000], table.cpu())
    assert m.ks.tolist() == ks and m.gather_slots.tolist() == slots
