"""The per-layer step captured in a CUDA graph: replays with new data match eager, and a batch that
would decide differently is refused (H200 through the device; skips without a GPU)."""

import pytest
import torch

from dispatch.contract.errors import GraphMismatchError
from dispatch.engines.indexer_step import IndexerStep
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch
from dispatch.contract.rope import RopeSpec

pytestmark = pytest.mark.gpu

B, N, H, D, MAX_LEN = 8, 4, 64, 128, 4096


def _batch(generator, next_n=N, mode=ForwardMode.TARGET_VERIFY, batch_size=B):
    lens = torch.randint(next_n, MAX_LEN, (batch_size,), generator=generator, dtype=torch.int32)
    pages = torch.randperm(batch_size * (MAX_LEN // 64), generator=generator).view(batch_size, -1).to(torch.int32)
    return PagedBatch(lens.cuda(), pages.cuda(), MAX_LEN, mode, next_n)


def _fill(inputs, generator):
    inputs.q.copy_(torch.randn(inputs.q.shape, generator=generator).to(inputs.q.dtype))
    inputs.weights.copy_(torch.randn(inputs.weights.shape, generator=generator))
    inputs.positions.copy_(torch.randint(0, 1000, inputs.positions.shape, generator=generator))


@pytest.fixture
def step():
    from dispatch.deciding.runtime import load_dispatcher

    return IndexerStep(load_dispatcher(), kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=D**-0.5, head_scale=H**-0.5, index_topk=256)


def _static_inputs(generator):
    from dispatch.bench.workload import LogitsShape, logits_inputs
    from dispatch.engines.graphs import StaticInputs

    cache = logits_inputs(LogitsShape(B, 1, MAX_LEN // 2), "e4m3fn", "cuda", seed=3).kv_cache
    blocks_needed = B * (MAX_LEN // 64)
    cache = torch.cat([cache] * (blocks_needed // cache.shape[0] + 1))[:blocks_needed].contiguous()
    inputs = StaticInputs(
        q=torch.empty(B * N, H, D, dtype=torch.bfloat16, device="cuda"),
        weights=torch.empty(B * N, H, device="cuda"),
        positions=torch.empty(B * N, dtype=torch.int64, device="cuda"),
        cos_sin_cache=torch.randn(1000, 64, generator=generator).to(torch.bfloat16).cuda(),
        kv_cache=cache,
    )
    _fill(inputs, generator)
    return inputs


def _selected_values(plan, inputs, indices):
    """Each row's selected logits, sorted, with -inf for a -1 slot."""
    from dispatch.contract.ops import indexer_q_quant, paged_mqa_logits

    step_settings = dict(rope=RopeSpec.neox_head(), softmax_scale=D**-0.5, head_scale=H**-0.5)
    q_fp8, folded = indexer_q_quant(plan, inputs.q, inputs.weights, inputs.positions, inputs.cos_sin_cache,
                                    **step_settings)
    logits = paged_mqa_logits(plan, q_fp8, inputs.kv_cache, folded)
    values = torch.gather(logits, 1, indices.clamp(min=0).long()).masked_fill(indices < 0, float("-inf"))
    return values.sort(dim=1).values


def test_replay_with_new_batches_matches_eager(step):
    from dispatch.engines.graphs import CapturedIndexerStep

    generator = torch.Generator().manual_seed(0)
    inputs = _static_inputs(generator)
    captured = CapturedIndexerStep(step, _batch(generator), inputs)
    for _ in range(3):
        batch = _batch(generator)
        _fill(inputs, generator)
        captured.update(batch)
        replayed = captured.replay().clone()
        eager_plan = step.plan(batch)
        eager = step.select(eager_plan, inputs.q, inputs.weights, inputs.positions, inputs.cos_sin_cache, inputs.kv_cache)
        # The top-k contract leaves the order within a row open and, among equal logits, which index
        # is kept (this cache repeats its blocks, so equal logits are common): compare what was
        # selected by its logits, as sorted values per row.
        assert torch.equal(_selected_values(eager_plan, inputs, replayed), _selected_values(eager_plan, inputs, eager))


def test_a_batch_that_decides_differently_is_refused(step):
    from dispatch.engines.graphs import CapturedIndexerStep

    generator = torch.Generator().manual_seed(1)
    captured = CapturedIndexerStep(step, _batch(generator), _static_inputs(generator))
    with pytest.raises(GraphMismatchError, match="next_n"):
        captured.update(_batch(generator, next_n=2))
    with pytest.raises(GraphMismatchError, match="B="):
        captured.update(_batch(generator, batch_size=B // 2))
    too_long = _batch(generator)
    with pytest.raises(GraphMismatchError, match="exceeds"):
        captured.update(PagedBatch(too_long.seq_lens, too_long.page_table, MAX_LEN + 1, too_long.forward_mode, N))


def test_per_layer_call_does_no_host_device_sync(step):
    generator = torch.Generator().manual_seed(2)
    inputs = _static_inputs(generator)
    batch = _batch(generator)
    plan = step.plan(batch)
    step.select(plan, inputs.q, inputs.weights, inputs.positions, inputs.cos_sin_cache, inputs.kv_cache)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = step.plan(batch)
        step.select(plan, inputs.q, inputs.weights, inputs.positions, inputs.cos_sin_cache, inputs.kv_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
