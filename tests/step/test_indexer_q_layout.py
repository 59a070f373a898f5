"""A q handed to IndexerStep.select in the wrong layout ([B, N, H, D], the shape engines keep it in
before flattening) is a LayoutError naming q, its shape and the expected [tokens, H, D], raised before
any backend runs (it used to surface as an opaque torch error inside a BackendError)."""

from __future__ import annotations

import pytest
import torch

from dispatch import load_dispatcher
from dispatch.contract.errors import LayoutError
from dispatch.engines.indexer_step import IndexerStep
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch
from dispatch.contract.rope import RopeSpec

B, N, H, D = 2, 3, 8, 128


def step_and_inputs():
    step = IndexerStep(load_dispatcher(arch="cpu"), kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=D**-0.5, head_scale=H**-0.5, index_topk=16)
    seq_lens = torch.tensor([70, 9], dtype=torch.int32)
    plan = step.plan(PagedBatch(seq_lens, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), max_seq_len=128,
                                  forward_mode=ForwardMode.TARGET_VERIFY, next_n=N))
    weights = torch.randn(B * N, H)
    positions = torch.cat([torch.arange(L - N, L) for L in seq_lens.tolist()])
    cos_sin = torch.randn(256, 64, dtype=torch.bfloat16)
    kv_cache = torch.zeros(4, 64, 1, D + 4, dtype=torch.uint8)
    return step, plan, weights, positions, cos_sin, kv_cache


@pytest.mark.parametrize("shape", [(B, N, H, D), (B * N + 1, H, D), (B * N * H, D)], ids=["BNHD", "tokens+1", "2d"])
def test_a_q_in_another_layout_is_a_located_layout_error(shape):
    step, plan, weights, positions, cos_sin, kv_cache = step_and_inputs()
    q = torch.randn(*shape, dtype=torch.bfloat16)
    with pytest.raises(LayoutError) as error:
        step.select(plan, q, weights, positions, cos_sin, kv_cache)
    message = str(error.value)
    assert message.startswith(f"q has shape {list(shape)}; IndexerStep.select expects q [tokens, H, D]"), message
    assert f"B*N = {B}*{N} = {B * N}" in message


def test_the_flattened_q_is_accepted():
    step, plan, weights, positions, cos_sin, kv_cache = step_and_inputs()
    q = torch.randn(B, N, H, D, dtype=torch.bfloat16)
    topk = step.select(plan, q.flatten(0, 1), weights, positions, cos_sin, kv_cache)
    assert topk.shape == (B * N, 16) and topk.dtype == torch.int32
