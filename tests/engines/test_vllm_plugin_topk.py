"""The plugin's top-k, written into vLLM's topk_indices_buffer through vLLM's own call signature and
forward context, against a torch reference of what vLLM's indexer computes from the same metadata
(vLLM's op needs vllm._C and does not run on a CPU). Ragged batches: decode, target_verify (native
next_n 2 and 4), vLLM's prefill chunks, a request vLLM splits over query chunks, and mixed forwards."""

import pytest
import torch

from tests.support.vllm_engine import (BLOCK, assert_topk_matches, import_vllm, kv_cache_and_keys, reference_logits,
                               visible_keys, vllm_metadata)

pytestmark = pytest.mark.engines
PREFIX = "model.layers.0.self_attn.indexer.k_cache"
TOPK = 64
HEADS = 8


@pytest.fixture(scope="module")
def vllm_indexer():
    return import_vllm()


def run_plugin(vllm_indexer, metadata, q, weights, cache, buffer):
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers import sparse_attn_indexer as layer

    from dispatch import load_dispatcher
    from dispatch.engines.vllm.op import DispatchIndexer

    indexer = DispatchIndexer(layer.sparse_attn_indexer, load_dispatcher)
    context = ForwardContext(no_compile_layers={}, attn_metadata={PREFIX: metadata}, slot_mapping={})
    with override_forward_context(context):
        for _ in range(2):  # two layers of one forward: the second reuses the first's plans
            indexer(torch.empty(q.shape[0], 16), PREFIX, cache, q, None, None, weights, 128, "ue8m0", TOPK, 128,
                    4096, 4096, buffer, True, False, False, "", skip_topk_buffer_clear=False)
    assert len(indexer._plans) == 1
    return indexer


CASES = {
    "decode": ([130, 64, 7, 300], [1, 1, 1, 1], 4),
    "target_verify next_n 2": ([130, 65, 9], [2, 2, 2], 3),
    "target_verify next_n 4": ([200, 70, 4], [4, 4, 4], 3),
    "prefill": ([100, 30, 257], [100, 12, 57], 0),
    "mixed": ([90, 20, 150, 33], [1, 1, 150, 5], 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_topk_buffer_matches_vllm_semantics(vllm_indexer, case):
    seq_lens, query_lens, num_decodes = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    pages = max(-(-length // BLOCK) for length in seq_lens)
    num_blocks = pages * len(seq_lens) + 3
    table = torch.randperm(num_blocks, generator=generator)[: pages * len(seq_lens)].view(len(seq_lens), pages)
    table = table.to(torch.int32)
    cache = kv_cache_and_keys(num_blocks, torch.float8_e4m3fn, generator)
    tokens = sum(query_lens)
    q = (torch.randn(tokens, HEADS, 128, generator=generator) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights = torch.randn(tokens, HEADS, generator=generator)
    metadata = vllm_metadata(vllm_indexer, seq_lens, query_lens, num_decodes, table)
    buffer = torch.full((tokens + 5, 2 * TOPK), 7, dtype=torch.int32)  # wider and longer than T x topk, as vLLM's

    run_plugin(vllm_indexer, metadata, q, weights, cache, buffer)

    rows = visible_keys(seq_lens, query_lens)
    assert_topk_matches(buffer, reference_logits(q, weights, cache, table, rows), TOPK)
    assert (buffer[:tokens, TOPK:] == -1).all(), "vLLM clears each token's whole row before the top-k"
    assert (buffer[tokens:] == 7).all(), "rows past the forward's tokens are not written"


def test_a_request_split_over_query_chunks(vllm_indexer):
    """vLLM splits one request's query rows when its logits pass the byte budget (later chunks skip the
    K gather); the plugin plans the request whole and re-chunks it by dispatch's own budget."""
    seq_lens, query_lens = [40, 300], [40, 260]
    generator = torch.Generator().manual_seed(3)
    table = torch.arange(10, dtype=torch.int32).view(2, 5)
    cache = kv_cache_and_keys(10, torch.float8_e4m3fn, generator)
    q = (torch.randn(300, HEADS, 128, generator=generator) * 40).to(torch.float8_e4m3fn)
    weights = torch.randn(300, HEADS, generator=generator)
    metadata = vllm_metadata(vllm_indexer, seq_lens, query_lens, 0, table, max_logits_bytes=300 * 100 * 4)
    assert sum(c.skip_kv_gather for c in metadata.prefill.chunks) >= 1, "the budget must split the request"
    buffer = torch.full((300, TOPK), 7, dtype=torch.int32)

    run_plugin(vllm_indexer, metadata, q, weights, cache, buffer)

    rows = visible_keys(seq_lens, query_lens)
    assert_topk_matches(buffer, reference_logits(q, weights, cache, table, rows), TOPK)


@pytest.mark.parametrize("static", [
    {"use_fp4_cache": True}, {"dcp_world_size": 2}, {"candidate_blocks": torch.zeros(1, 1, dtype=torch.int32)},
])
def test_what_dispatch_does_not_serve_goes_to_vllms_own_function_whole(vllm_indexer, static, caplog):
    from vllm.forward_context import ForwardContext, override_forward_context

    from dispatch import load_dispatcher
    from dispatch.engines.vllm.op import DispatchIndexer

    calls = []
    indexer = DispatchIndexer(lambda *args, **kwargs: calls.append((args, kwargs)) or args[13], load_dispatcher)
    buffer = torch.full((2, TOPK), 7, dtype=torch.int32)
    metadata = vllm_metadata(vllm_indexer, [70, 80], [1, 1], 2, torch.zeros(2, 2, dtype=torch.int32))
    q = torch.zeros(2, HEADS, 128).to(torch.float8_e4m3fn)
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={PREFIX: metadata},
                                                 slot_mapping={})), caplog.at_level("INFO", "vllm.plugins.dispatch"):
        for _ in range(2):
            result = indexer(torch.empty(2, 16), PREFIX, kv_cache_and_keys(2, torch.float8_e4m3fn, torch.Generator()),
                             q, None, None, torch.zeros(2, HEADS), 128, "ue8m0", TOPK, 128, 4096, 4096, buffer, True,
                             False, False, "", **static)
    assert len(calls) == 2 and result is buffer and (buffer == 7).all() and not indexer._plans
    assert calls[0][1] | static == calls[0][1], "vLLM's function gets the call as it came"
    assert sum("hands vLLM's own" in r.getMessage() for r in caplog.records) == 1, "logged once per reason"


def test_a_profiling_run_goes_to_vllm(vllm_indexer):
    from vllm.forward_context import ForwardContext, override_forward_context

    from dispatch.engines.vllm.op import DispatchIndexer

    calls = []
    indexer = DispatchIndexer(lambda *args, **kwargs: calls.append(args) or args[13], lambda: pytest.fail("loaded"))
    buffer = torch.zeros(1, TOPK, dtype=torch.int32)
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata=None, slot_mapping={})):
        indexer(torch.empty(1, 16), PREFIX, torch.zeros(1, 64, 132, dtype=torch.uint8), torch.zeros(1, 8, 128),
                None, None, torch.zeros(1, 8), 128, "ue8m0", TOPK, 128, 4096, 4096, buffer, True, False, False, "")
    assert len(calls) == 1
