"""On a GPU: SGLang 0.5.23's own Indexer._get_topk_paged on its SM90 serving path (DeepGEMM's paged
logits, the sgl-kernel top-k backend whose fused PAGED transform is the top-k v2 JIT kernel) against
the same call with dispatch's plugin loaded through SGLang's load_plugins(), on the same batch: the
same pool bytes, the same requests and lengths, the same fp8 Q. Both return physical KV slots; both are
mapped back to positions and checked tie-aware against an fp32 reference (tests/support/sglang_selection.py).

Skips without a GPU (the `gpu` marker), without sglang (the engine fixture), without DeepGEMM, or
where SGLang cannot load its top-k v2 kernel (its JIT build needs nvcc)."""

from __future__ import annotations

import pytest
import torch

from tests.support.numerics import GPU_LOGITS_TOLERANCE
from tests.support.sglang_env import sglang_env  # noqa: F401  (the fixture)
from tests.support.sglang_loading import plugin_loaded
from tests.support.sglang_selection import compare_selections, positions_from_slots, reference_logits

pytestmark = pytest.mark.engines

# Both sides' logits come from fp8 tensor cores (~2.5e-4 relative, tests/support/numerics.py): two selections
# that differ among near-ties at the k-th value differ by about that much of the row's largest logit.
TOLERANCE = 2 * GPU_LOGITS_TOLERANCE

SHAPES = [
    # (requests, next_n, mean committed length): decode, target_verify; lengths straddle the top-k width
    (8, 1, 1500),
    (5, 1, 6000),
    (6, 2, 2000),
    (4, 4, 5000),
]


@pytest.fixture
def sm90_path(sglang_env, monkeypatch):
    """SGLang's GPU serving switches (the engine fixture sets its CPU fallbacks), or a skip naming
    what is missing."""
    pytest.importorskip("deep_gemm", reason="DeepGEMM (sgl-deep-gemm) is not installed")
    monkeypatch.setenv("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", "0")
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1")
    from sglang.kernels.ops.attention.dsv4 import topk

    try:
        topk._jit_topk_v2_module()
    except Exception as exc:  # SGLang's JIT build: nvcc, ninja and tvm-ffi's headers must be there
        pytest.skip(f"SGLang cannot load its top-k v2 kernel here ({type(exc).__name__}: {exc})")
    return sglang_env


@pytest.mark.gpu
@pytest.mark.parametrize(("batch_size", "next_n", "mean_len"), SHAPES)
def test_plugin_selects_what_sglang_selects_on_gpu(sm90_path, tmp_path, monkeypatch, batch_size, next_n, mean_len):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    harness = sm90_path
    pool, req_to_token, lengths, requests, mode, batch = harness.serving_batch(
        batch_size, next_n, mean_len, device="cuda", seed=batch_size * 100 + next_n, fused_topk=True
    )
    tokens = batch_size * next_n
    q, weights = harness.quantised_q(tokens + 2, torch.Generator(device="cuda").manual_seed(mean_len))  # 2 padded rows
    indexer = harness.make_indexer(torch.cuda.get_device_properties(0).multi_processor_count)
    original = Indexer._get_topk_paged
    with batch.context():
        theirs = original(indexer, batch.forward_batch, 0, q, weights, batch.metadata)
    with plugin_loaded(tmp_path, monkeypatch):
        assert Indexer._get_topk_paged is not original
        ours_batch = harness.make_batch(pool, req_to_token, lengths, requests, mode, next_n, fused_topk=True)
        with ours_batch.context():
            ours = Indexer._get_topk_paged(indexer, ours_batch.forward_batch, 0, q, weights, ours_batch.metadata)
    assert theirs.shape == ours.shape == (tokens + 2, harness.TOPK) and ours.dtype == theirs.dtype == torch.int32
    assert bool((theirs[tokens:] == -1).all()) and bool((ours[tokens:] == -1).all())
    row_request = torch.tensor(requests, device="cuda").repeat_interleave(next_n)
    visible = batch.metadata.attn_metadata.dsa_seqlens_expanded.long()
    logits = reference_logits(
        pool.get_index_k_with_scale_buffer(layer_id=0), req_to_token, row_request, visible, q[:tokens], weights[:tokens]
    )
    report = compare_selections(
        positions_from_slots(theirs[:tokens], req_to_token, row_request),
        positions_from_slots(ours[:tokens], req_to_token, row_request),
        logits, visible, harness.TOPK, tolerance=TOLERANCE,
    )
    assert report.rows == tokens


cpu_harness_only = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU harness runs SGLang's Triton seqlens kernel under the interpreter, which tests/conftest.py "
    "turns on only where no GPU is visible; on a GPU the test above runs these steps itself",
)


@cpu_harness_only
def test_slots_map_back_to_positions(sglang_env, monkeypatch):
    """The comparison's own step, on the CPU: the plugin's fused output (physical slots through SGLang's
    page table) mapped back through req_to_token is exactly its unfused output (positions)."""
    from dispatch.engines.sglang.indexer import get_topk_paged

    harness = sglang_env
    pool, req_to_token, lengths, requests, mode, batch = harness.serving_batch(3, 2, 1800, device="cpu", seed=5, fused_topk=True)
    q, weights = harness.quantised_q(6, torch.Generator().manual_seed(5))
    indexer = harness.make_indexer()
    with batch.context():
        positions = get_topk_paged(indexer, batch.forward_batch, 0, q, weights, batch.metadata)  # FUSE_TOPK=0
        monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1")
        slots = get_topk_paged(indexer, batch.forward_batch, 0, q, weights, batch.metadata)
    row_request = torch.tensor(requests).repeat_interleave(2)
    assert not torch.equal(slots, positions)  # the shuffled pages make slots and positions differ
    assert torch.equal(positions_from_slots(slots, req_to_token, row_request), positions)
    # A slot of another request is not a position of this one: rejected (-2), never mapped.
    foreign = slots.clone()
    foreign[0, 0] = req_to_token[row_request[2], 0]
    assert int(positions_from_slots(foreign, req_to_token, row_request)[0, 0]) == -2


@cpu_harness_only
def test_comparison_rejects_a_worse_selection(sglang_env):
    """The comparison's check can fail: a selection with one top key swapped for the row's weakest
    visible key is refused, one that repeats a key too, while the plugin's own passes."""
    from dispatch.engines.sglang.indexer import get_topk_paged

    harness = sglang_env
    pool, req_to_token, lengths, requests, mode, batch = harness.serving_batch(2, 1, 3000, device="cpu", seed=9)
    q, weights = harness.quantised_q(2, torch.Generator().manual_seed(9))
    with batch.context():
        positions = get_topk_paged(harness.make_indexer(), batch.forward_batch, 0, q, weights, batch.metadata)
    row_request = torch.tensor(requests)
    visible = batch.metadata.attn_metadata.dsa_seqlens_expanded.long()
    logits = reference_logits(pool.get_index_k_with_scale_buffer(layer_id=0), req_to_token, row_request, visible, q, weights)
    report = compare_selections(positions, positions, logits, visible, harness.TOPK, tolerance=TOLERANCE)
    assert report.identical_rows == report.rows == 2 and report.worst < 1e-6
    row = int(visible.argmax())
    assert int(visible[row]) > harness.TOPK  # longer than k, so its weakest key is not among the selected
    weaker = positions.clone()
    best = int(logits[row].gather(0, positions[row].long()).argmax())
    weaker[row, best] = int(logits[row, : int(visible[row])].argmin())
    with pytest.raises(AssertionError, match="selected values"):
        compare_selections(positions, weaker, logits, visible, harness.TOPK, tolerance=TOLERANCE)
    repeated = positions.clone()
    repeated[row, 1] = repeated[row, 0]
    with pytest.raises(AssertionError, match="repeated position"):
        compare_selections(positions, repeated, logits, visible, harness.TOPK, tolerance=TOLERANCE)
