"""The SGLang NextN incident (reverted as #27138), driven through SGLang 0.5.23's own metadata: its
indexer picks the native DeepGEMM path by `ctx_2d.shape == (B, next_n)` on paged_mqa_ctx_lens_2d,
which its attention backend builds under another condition (`_build_paged_mqa_schedule_2d_ctx_lens`:
target_verify, next_n >= 2, SM100, no torch fallback): per request [B, next_n] of the total length,
for DeepGEMM's native kernel to apply the causal offsets itself. Nothing ties the indexer's condition
to the builder's; a tensor of that shape takes the native path whoever built it and for whatever path.

With the plugin loaded the selection cannot depend on that tensor: the plan builds its lengths from the
request lengths in the layout its decision names, and never reads paged_mqa_ctx_lens_2d. Here SGLang's
backend builds it in its SM100 branch (its platform check answered as an SM100 would), then it is
poisoned outright; the plugin's selection stays exactly the causal one in every case."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.support.sglang_env import sglang_env  # noqa: F401  (the fixture)
from tests.support.sglang_loading import plugin_loaded

pytestmark = pytest.mark.engines

NEXT_N = 4


def sm100_ctx_2d(batch, monkeypatch):
    """paged_mqa_ctx_lens_2d as SGLang's backend builds it on an SM100 with DeepGEMM."""
    import sglang.srt.layers.attention.dsa_backend as dsa_backend

    with monkeypatch.context() as patch:
        patch.setattr(dsa_backend, "get_platform", lambda: SimpleNamespace(is_sm100=True))
        patch.delenv("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH")
        attn = batch.metadata.attn_metadata
        return batch.backend._build_paged_mqa_schedule_2d_ctx_lens(
            batch.forward_batch.forward_mode, attn.cache_seqlens_int32, attn.dsa_seqlens_expanded,
            batch.forward_batch.batch_size,
        )


def test_shape_check_regression_cannot_happen_with_the_plugin(sglang_env, tmp_path, monkeypatch):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dispatch.engines.sglang import plans

    harness = sglang_env
    generator = torch.Generator().manual_seed(11)
    pool = harness.make_pool(120)
    harness.fill_index_k(pool, 0, generator)
    req_to_token = harness.page_aligned_req_to_token(3, 40, 120, generator)
    q, weights = harness.quantised_q(3 * NEXT_N, generator)
    indexer = harness.make_indexer()
    seq_lens = [40, 700, 9]  # short enough that every visible key is selected: the sets are exact

    def run(metadata, batch):
        with batch.context():
            return Indexer._get_topk_paged(indexer, batch.forward_batch, 0, q, weights, metadata)

    batch = harness.make_batch(pool, req_to_token, seq_lens, [2, 0, 1], ForwardMode.TARGET_VERIFY, NEXT_N)
    ctx_2d = sm100_ctx_2d(batch, monkeypatch)
    assert tuple(ctx_2d.shape) == (3, NEXT_N)  # the native shape: SGLang's shape check would pass
    causal = batch.metadata.attn_metadata.dsa_seqlens_expanded  # token j of L sees L - N + j + 1 keys

    poisoned = torch.full_like(ctx_2d, 1 << 20)  # lengths no request has, in the native shape
    with plugin_loaded(tmp_path, monkeypatch):
        batch = harness.make_batch(pool, req_to_token, seq_lens, [2, 0, 1], ForwardMode.TARGET_VERIFY, NEXT_N)
        results = [
            run(dataclasses.replace(batch.metadata, paged_mqa_ctx_lens_2d=lens), batch)
            for lens in (ctx_2d, poisoned, None)
        ]
        plan = plans.PLANS.get(batch.metadata.attn_metadata)
    assert plan.logits.rule  # the path is the plan's decision, by a named rule
    for plugin in results:
        assert torch.equal((plugin >= 0).sum(dim=1), causal)
        for token in range(plugin.shape[0]):
            picked = plugin[token][plugin[token] >= 0]
            # Every visible key is selected (lengths < topk): the set is exactly 0 .. causal - 1.
            assert torch.equal(picked.sort().values, torch.arange(int(causal[token]), dtype=torch.int32))
