"""The replaced Indexer._get_topk_ragged (extend batches) on SGLang 0.5.23's own extend metadata.

SGLang's own _get_topk_ragged does not run on a CPU (it asserts a CUDA device index before its
DeepGEMM fp8_mqa_logits call), so the reference here is the computation it performs, written out:
fp32 logits of each new token over its request's visible keys (read through page_table_1 from the
pool's bytes) and a top-k of those, compared tie-aware as in the paged differential test; and the
index conventions SGLang's topk_transform gives: request-relative positions unfused, and with
SGLANG_DSA_FUSE_TOPK the RAGGED transform's offset into the batch's keys (topk_indices_offset)."""

from __future__ import annotations

import pytest
import torch

from tests.support.sglang_env import sglang_env  # noqa: F401  (the fixture)
from tests.engines.test_sglang_plugin_differential import assert_same_selection, reference_logits

pytestmark = pytest.mark.engines

BATCHES = [([0, 100, 30], [50, 20, 3], [1, 0, 2]), ([2100, 0], [4, 70], [0, 2])]


def reference_topk(logits, lengths, topk):
    """Each row's top-k positions over its visible keys (torch.topk; -1 past what a row sees)."""
    out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32)
    for row in range(logits.shape[0]):
        length = int(lengths[row])
        picked = logits[row, :length].topk(min(topk, length)).indices
        out[row, : picked.numel()] = picked.to(torch.int32)
    return out


@pytest.mark.parametrize(("prefix", "extend", "requests"), BATCHES)
def test_ragged_selection_and_conventions(sglang_env, monkeypatch, prefix, extend, requests):
    from dispatch.engines.sglang.indexer import get_topk_ragged

    harness = sglang_env
    generator = torch.Generator().manual_seed(sum(prefix) + sum(extend))
    pool = harness.make_pool(150)
    harness.fill_index_k(pool, 0, generator)
    req_to_token = harness.page_aligned_req_to_token(3, 45, 150, generator)
    tokens = sum(extend)
    q, weights = harness.quantised_q(tokens, generator)
    indexer = harness.make_indexer()

    batch = harness.make_extend_batch(pool, req_to_token, prefix, extend, requests)
    with batch.context():
        positions = get_topk_ragged(indexer, False, batch.forward_batch, 0, q, weights, batch.metadata)
    lengths = batch.metadata.attn_metadata.dsa_seqlens_expanded
    rows_table = batch.metadata.attn_metadata.token_to_batch_idx
    if rows_table is None:
        rows_table = torch.repeat_interleave(torch.arange(len(extend)), torch.tensor(extend))
    logits = reference_logits(pool, batch.metadata, q, weights, lengths, rows_table)
    assert_same_selection(reference_topk(logits, lengths, harness.TOPK), positions, logits, lengths, harness.TOPK)

    ragged = harness.make_extend_batch(pool, req_to_token, prefix, extend, requests, ragged=True)
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1")
    with ragged.context():
        offsets_out = get_topk_ragged(indexer, False, ragged.forward_batch, 0, q, weights, ragged.metadata)
    offset = ragged.metadata.attn_metadata.topk_indices_offset
    expected = torch.where(positions >= 0, positions + offset[:, None].to(torch.int32), -1)
    # One plan, one selection; only the index map differs (an integer add): compare each row as a set.
    assert torch.equal(offsets_out.sort(dim=1).values, expected.sort(dim=1).values)
