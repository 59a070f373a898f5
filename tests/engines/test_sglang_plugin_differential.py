"""SGLang 0.5.23's own Indexer._get_topk_paged against the plugin's, on identical bytes: the same
SGLang-built DSAMetadata, the same per-layer index-K buffer of SGLang's own pool, the same fp8 Q.

SGLang runs on the CPU through its torch paged-logits fallback (SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1),
which computes in bf16, and its torch top-k (SGLANG_DSA_FUSE_TOPK=0); dispatch's backends compute in
fp32. Near the k-th value the two may pick different keys, so selections are compared tie-aware: the
same number of keys per token, every key visible and distinct, and the selected keys' fp32 logits (a
torch formula over the same bytes), sorted, equal within TOLERANCE of the row's largest |logit|."""

from __future__ import annotations

import pytest
import torch

from tests.support.sglang_env import sglang_env  # noqa: F401  (the fixture)

pytestmark = pytest.mark.engines

# bf16 has 8 mantissa bits: SGLang's logits carry about 2^-8 of relative error per term; over a
# 64-head sum, 2% of the row's largest |logit| bounds the difference of two near-tied selections.
TOLERANCE = 2e-2


def reference_logits(pool, metadata, q, weights, lengths, rows_table):
    """fp32 logits [T, max_len] over each token's visible keys, from page_table_1 (per token: its
    request's slots), the pool's bytes and q; -inf past a token's length."""
    from dispatch.contract.kv_cache import split_kv_cache

    buffer = pool.get_index_k_with_scale_buffer(layer_id=0)
    keys, scales = split_kv_cache(buffer.view(buffer.shape[0], 64, 1, 132), "e4m3fn")
    keys, scales = keys.reshape(-1, 128).float(), scales.reshape(-1)
    table = metadata.attn_metadata.page_table_1
    width = int(lengths.max())
    out = torch.full((q.shape[0], width), float("-inf"))
    for token in range(q.shape[0]):
        length = int(lengths[token])
        slots = table[rows_table[token], :length].long()
        scores = torch.relu(q[token].float() @ keys[slots].T) * scales[slots]
        out[token, :length] = (weights[token, :, 0].float()[:, None] * scores).sum(0)
    return out


def assert_same_selection(sglang_out, plugin_out, logits, lengths, topk):
    assert plugin_out.shape == sglang_out.shape and plugin_out.dtype == sglang_out.dtype == torch.int32
    for token in range(logits.shape[0]):
        ours, theirs = plugin_out[token], sglang_out[token]
        expected = min(int(lengths[token]), topk)
        assert int((ours >= 0).sum()) == int((theirs >= 0).sum()) == expected, token
        assert bool((ours[expected:] == -1).all())
        picked = ours[ours >= 0].long()
        assert picked.unique().numel() == expected and int(picked.max()) < int(lengths[token])
        scale = logits[token, : int(lengths[token])].abs().max()
        mine = logits[token, picked].sort().values
        reference = logits[token, theirs[theirs >= 0].long()].sort().values
        error = float((mine - reference).abs().max() / scale)
        assert error <= TOLERANCE, f"token {token}: selected logits differ by {error:.2e} of the row's max"


BATCHES = [
    # (mode, lengths per request as SGLang's batch holds them, request slots in req_to_token, next_n)
    ("DECODE", [100, 2100, 65, 3000], [2, 0, 3, 1], 1),
    ("DECODE", [1, 64, 4097], [1, 2, 0], 1),
    ("TARGET_VERIFY", [2200, 130, 700], [0, 3, 1], 2),
    ("TARGET_VERIFY", [90, 2500], [3, 2], 3),
    ("TARGET_VERIFY", [2049, 5, 1500, 64], [1, 0, 2, 3], 4),
    ("DRAFT_EXTEND_V2", [2300, 40, 600], [2, 1, 0], 3),
]


@pytest.mark.parametrize(("mode_name", "seq_lens", "requests", "next_n"), BATCHES)
def test_plugin_returns_what_sglang_returns(sglang_env, mode_name, seq_lens, requests, next_n):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dispatch.engines.sglang.indexer import get_topk_paged

    harness = sglang_env
    generator = torch.Generator().manual_seed(sum(seq_lens) + next_n)
    pool = harness.make_pool(400)
    harness.fill_index_k(pool, 0, generator)
    req_to_token = harness.page_aligned_req_to_token(4, 90, 400, generator)
    mode = ForwardMode[mode_name]
    batch = harness.make_batch(pool, req_to_token, seq_lens, requests, mode, next_n)
    tokens = len(seq_lens) * next_n
    q, weights = harness.quantised_q(tokens + 3, generator)  # 3 padded rows past the real tokens
    indexer = harness.make_indexer()
    with batch.context():
        theirs = Indexer._get_topk_paged(indexer, batch.forward_batch, 0, q, weights, batch.metadata)
        ours = get_topk_paged(indexer, batch.forward_batch, 0, q, weights, batch.metadata)
    lengths = batch.metadata.attn_metadata.dsa_seqlens_expanded
    rows_table = torch.arange(tokens)  # page_table_1 has a row per token (SGLang repeats it per draft)
    logits = reference_logits(pool, batch.metadata, q[:tokens], weights[:tokens], lengths, rows_table)
    assert_same_selection(theirs[:tokens], ours[:tokens], logits, lengths, harness.TOPK)
    assert theirs.shape == ours.shape == (tokens + 3, harness.TOPK)
    assert bool((ours[tokens:] == -1).all()) and bool((theirs[tokens:] == -1).all())


def test_fused_convention_is_page_table_1_slots(sglang_env, monkeypatch):
    """With SGLANG_DSA_FUSE_TOPK on, SGLang's topk_transform returns page_table_1's physical slots of
    the selected positions (fast_topk_transform_fused; its CUDA kernel does not run here): the plugin's
    fused output is exactly page_table_1 gathered at its own unfused positions (both are integer maps of one selection)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dispatch.engines.sglang.indexer import get_topk_paged

    harness = sglang_env
    generator = torch.Generator().manual_seed(7)
    pool = harness.make_pool(200)
    harness.fill_index_k(pool, 0, generator)
    req_to_token = harness.page_aligned_req_to_token(4, 45, 200, generator)
    batch = harness.make_batch(pool, req_to_token, [300, 2500, 77], [1, 3, 0], ForwardMode.TARGET_VERIFY, 2, fused_topk=True)
    q, weights = harness.quantised_q(6, generator)
    indexer = harness.make_indexer()
    with batch.context():
        positions = get_topk_paged(indexer, batch.forward_batch, 0, q, weights, batch.metadata)  # FUSE_TOPK=0
        monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1")
        slots = get_topk_paged(indexer, batch.forward_batch, 0, q, weights, batch.metadata)
    table = batch.metadata.attn_metadata.page_table_1
    expected = torch.where(positions >= 0, table.gather(1, positions.clamp(min=0).long()).to(torch.int32), -1)
    # The order within a row is unspecified (as SGLang's): compare each row's slots as a set.
    assert torch.equal(slots.sort(dim=1).values, expected.sort(dim=1).values)
    assert bool((slots >= 0).sum() == (positions >= 0).sum())
