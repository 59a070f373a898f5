"""The gfx942 incident (vLLM's Q quantised as e4m3fn against an e4m3fnuz indexer K cache) cannot happen
with the vLLM plugin loaded. Driven through vLLM's own call: its forward context, its metadata, and its
platform's fp8 dtype, here e4m3fnuz as vLLM's ROCm platform reports it on gfx94x (RocmPlatform.fp8_dtype):
an e4m3fn Q is refused naming both dtypes, before anything is scored; a bf16 Q is quantised into the
cache's e4m3fnuz, with its FP8_MAX of 224, and selects what vLLM's indexer would select."""

import pytest
import torch

from tests.support.vllm_engine import assert_topk_matches, import_vllm, kv_cache_and_keys, reference_logits, visible_keys, \
    vllm_metadata

pytestmark = pytest.mark.engines
PREFIX = "model.layers.1.self_attn.indexer.k_cache"
SEQ_LENS, QUERY_LENS, DECODES = [90, 20, 150], [2, 2, 40], 2
HEADS, TOPK = 8, 32


@pytest.fixture
def gfx942(monkeypatch):
    indexer = import_vllm()
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "fp8_dtype", classmethod(lambda cls: torch.float8_e4m3fnuz))
    generator = torch.Generator().manual_seed(7)
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    cache = kv_cache_and_keys(9, torch.float8_e4m3fnuz, generator)
    return indexer, vllm_metadata(indexer, SEQ_LENS, QUERY_LENS, DECODES, table), table, cache, generator


def call(metadata, q, weights, cache, buffer):
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers import sparse_attn_indexer as layer

    from dispatch import load_dispatcher
    from dispatch.engines.vllm.op import DispatchIndexer

    indexer = DispatchIndexer(layer.sparse_attn_indexer, lambda: load_dispatcher(arch="cpu"))
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={PREFIX: metadata},
                                                 slot_mapping={})):
        indexer(torch.empty(q.shape[0], 16), PREFIX, cache, q, None, None, weights, 128, "ue8m0", TOPK, 128,
                4096, 4096, buffer, True, False, False, "")
    return indexer


def test_e4m3fn_q_against_the_fnuz_cache_is_refused(gfx942):
    from dispatch.contract.errors import DtypeMismatchError

    _, metadata, _, cache, generator = gfx942
    tokens = sum(QUERY_LENS)
    q = (torch.randn(tokens, HEADS, 128, generator=generator) * 40).to(torch.float8_e4m3fn)
    buffer = torch.full((tokens, TOPK), 7, dtype=torch.int32)
    with pytest.raises(DtypeMismatchError, match=r"float8_e4m3fn.*float8_e4m3fnuz"):
        call(metadata, q, torch.randn(tokens, HEADS), cache, buffer)


def test_the_plans_are_keyed_on_the_caches_fnuz(gfx942):
    _, metadata, _, cache, generator = gfx942
    tokens = sum(QUERY_LENS)
    q = (torch.randn(tokens, HEADS, 128, generator=generator) * 40).clamp(-224, 224).to(torch.float8_e4m3fnuz)
    weights = torch.randn(tokens, HEADS, generator=generator)
    buffer = torch.full((tokens, TOPK), 7, dtype=torch.int32)
    indexer = call(metadata, q, weights, cache, buffer)
    assert {plan.key.fp8_dtype.value for plan in indexer._plans[0].plans} == {"e4m3fnuz"}
    _, _, table, _, _ = gfx942
    assert_topk_matches(buffer, reference_logits(q, weights, cache, table, visible_keys(SEQ_LENS, QUERY_LENS)), TOPK)


def test_a_bf16_q_is_quantised_into_the_caches_fnuz(gfx942):
    from backends.reference.q_quant import reference_indexer_q_quant
    from dispatch import load_dispatcher
    from dispatch.engines.vllm.forward_plan import build_forward_plans
    from dispatch.engines.vllm.topk_writer import QuantiseArgs, write_topk
    from dispatch.contract.rope import RopeSpec

    _, metadata, table, cache, generator = gfx942
    tokens = sum(QUERY_LENS)
    q = (torch.randn(tokens, HEADS, 128, generator=generator) * 300).to(torch.bfloat16)
    weights = torch.randn(tokens, HEADS, generator=generator)
    positions = torch.cat([torch.arange(L - n, L) for L, n in zip(SEQ_LENS, QUERY_LENS)])
    cos_sin = torch.randn(160, 64, generator=generator).to(torch.bfloat16)
    args = QuantiseArgs(positions, cos_sin, RopeSpec.gptj_tail(), 128 ** -0.5, HEADS ** -0.5)
    plans = build_forward_plans(load_dispatcher(arch="cpu"), metadata, kv_fp8_dtype=torch.float8_e4m3fnuz,
                                num_kv_blocks=9, block_kv=64)
    buffer = torch.full((tokens, TOPK), 7, dtype=torch.int32)
    write_topk(plans, q, weights, cache, buffer, TOPK, quantise=args)

    q_fp8, folded = reference_indexer_q_quant(q, weights, positions, cos_sin, fp8_dtype="e4m3fnuz", rope=args.rope,
                                              softmax_scale=args.softmax_scale, head_scale=args.head_scale)
    assert q_fp8.dtype == torch.float8_e4m3fnuz and float(q_fp8.float().abs().max()) <= 224
    assert_topk_matches(buffer, reference_logits(q_fp8, folded, cache, table, visible_keys(SEQ_LENS, QUERY_LENS)),
                        TOPK)
