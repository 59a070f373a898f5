"""The extend plan's per-chunk tensors in their two forms: the host's (numpy, from the host lengths) and
the devices' (splits of the metadata's rows' ks / ke, one subtraction a chunk past key 0), equal, exactly,
at ragged lengths, prefixes and logits budgets that cut the rows into one chunk or many, some past key 0."""

from __future__ import annotations

import pytest
import torch

from dispatch.step.extend_batch import ExtendBatch, build_ragged_metadata
from dispatch.step.extend_plan import chunk_tensors, chunk_tensors_from_ranges

CASES = [([0], [5], 1 << 20), ([0, 300], [17, 1], 4096), ([12, 0, 700], [40, 3, 90], 20000), ([0] * 4, [256] * 4, 1 << 14)]


@pytest.mark.parametrize("prefixes,extends,budget", CASES)
def test_the_device_form_equals_the_host_form(prefixes, extends, budget):
    pages = -(-max(p + e for p, e in zip(prefixes, extends)) // 64)
    table = torch.arange(len(prefixes) * pages, dtype=torch.int32).view(len(prefixes), pages)
    metadata = build_ragged_metadata(ExtendBatch.from_lengths(prefixes, extends, table, num_kv_blocks=table.numel()))
    chunks = metadata.chunks(budget)
    host, device = chunk_tensors(metadata, chunks), chunk_tensors_from_ranges(metadata, chunks)
    assert len(host) == len(device) == len(chunks)
    if budget < 1 << 20:
        assert any(c.key_begin for c in chunks), "a case meant to cut past key 0 did not"
    for ours, theirs in zip(device, host):
        assert ours.chunk == theirs.chunk
        for field in ("ks", "ke", "lengths", "page_rows"):
            assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
