"""The plugin as SGLang loads it: through its own load_plugins(), only when SGLANG_PLUGINS names it,
with a start-up log line naming the plugin, the registry and the cluster; then SGLang's own
init_forward_metadata and Indexer._get_topk_paged run dispatch's plan and selection."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tests.support.sglang_env import sglang_env  # noqa: F401  (the fixture)
from tests.support.sglang_loading import plugin_loaded

pytestmark = pytest.mark.engines


def test_loaded_when_sglang_plugins_names_it(sglang_env, tmp_path, monkeypatch, caplog):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dispatch.engines.sglang import indexer as replacement
    from dispatch.engines.sglang import plans

    harness = sglang_env
    generator = torch.Generator().manual_seed(3)
    pool = harness.make_pool(100)
    harness.fill_index_k(pool, 0, generator)
    req_to_token = harness.page_aligned_req_to_token(2, 40, 100, generator)
    original = Indexer._get_topk_paged
    with caplog.at_level(logging.INFO, logger="dispatch.engines.sglang"):
        with plugin_loaded(tmp_path, monkeypatch):
            assert Indexer._get_topk_paged.__wrapped__ is original  # SGLang's REPLACE wrapper around ours
            batch = harness.make_batch(pool, req_to_token, [500, 2300], [1, 0], ForwardMode.TARGET_VERIFY, 2)
            plan = plans.PLANS.get(batch.metadata.attn_metadata)
            assert plan is not None and plan.next_n == 2  # built by the hook on init_forward_metadata
            q, weights = harness.quantised_q(4, generator)
            with batch.context():
                loaded = Indexer._get_topk_paged(harness.make_indexer(), batch.forward_batch, 0, q, weights, batch.metadata)
                direct = replacement.get_topk_paged(harness.make_indexer(), batch.forward_batch, 0, q, weights, batch.metadata)
            assert plans.PLANS.get(batch.metadata.attn_metadata) is plan  # once per batch, not per layer
    assert Indexer._get_topk_paged is original
    # The same plan, backends and bytes: the same integer selection, in the same order.
    assert torch.equal(loaded, direct)
    lines = [r.getMessage() for r in caplog.records if "dispatch SGLang plugin (sglang 0.5.23)" in r.getMessage()]
    assert len(lines) == 1 and "registry " in lines[0] and "cluster " in lines[0], lines


@pytest.mark.parametrize("allowlist", [None, "", "some-other-plugin"])
def test_inert_unless_named(sglang_env, tmp_path, monkeypatch, allowlist):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    original = Indexer._get_topk_paged
    with plugin_loaded(tmp_path, monkeypatch, allowlist=allowlist):
        assert Indexer._get_topk_paged is original


def test_unknown_release_is_refused(sglang_env):
    from dispatch.engines.sglang.release import check_release
    from dispatch.contract.errors import EngineVersionError

    assert check_release() == "0.5.23"
    with pytest.raises(EngineVersionError, match=r"sglang 0\.5\.24 is not a release the dispatch plugin knows"):
        check_release("0.5.24")


def test_metadata_refilled_in_place_refills_its_plan_in_place(sglang_env):
    """A CUDA graph's static DSAMetadata is refilled in place on each replay (SGLang's
    _apply_cuda_graph_metadata); the plan captured with it is refilled in place too, so the tensors
    the captured kernels read hold the new batch, and a batch that cannot replay is refused."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dispatch.engines.sglang import plans
    from dispatch.engines.sglang.session import session
    from dispatch.contract.errors import GraphMismatchError, LayoutError

    def fresh_at(attn):
        return plans.paged_batch(attn, plans.ForwardMode.TARGET_VERIFY, 3)

    harness = sglang_env
    generator = torch.Generator().manual_seed(5)
    pool = harness.make_pool(100)
    req_to_token = harness.page_aligned_req_to_token(3, 30, 100, generator)
    batch = harness.make_batch(pool, req_to_token, [500, 900, 70], [0, 1, 2], ForwardMode.TARGET_VERIFY, 3)
    attn = batch.metadata.attn_metadata
    step = session().step(harness.TOPK, to_slots=False)
    captured = plans.plan_paged(step, attn, ForwardMode.TARGET_VERIFY, 3)
    context_lens = captured.context_lens
    attn.cache_seqlens_int32.copy_(torch.tensor([100, 800, 80], dtype=torch.int32))  # the replay's refill
    assert plans.plan_paged(step, attn, ForwardMode.TARGET_VERIFY, 3) is captured
    assert captured.context_lens is context_lens
    fresh = plans.paged_batch(attn, plans.ForwardMode.TARGET_VERIFY, 3)
    assert torch.equal(captured.token_lengths, step.plan(fresh).token_lengths)
    assert captured.token_lengths.tolist()[:3] == [98, 99, 100]  # L - N + j + 1
    with pytest.raises(LayoutError, match="at next_n 2"):
        plans.plan_paged(step, attn, ForwardMode.TARGET_VERIFY, 2)  # not what SGLang's metadata holds
    attn.cache_seqlens_int32.copy_(torch.tensor([100, 960, 80], dtype=torch.int32))
    with pytest.raises(GraphMismatchError):  # longer than a (narrower) captured logits width
        captured_bound = dataclasses.replace(captured, max_context_len=900)
        plans.refresh_captured_plan(captured_bound, fresh_at(attn), step.plan(fresh_at(attn)))
