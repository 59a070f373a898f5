"""The DeepGEMM backends on a GPU against the torch reference: relative error on visible positions under
1e-3 (Hopper's fp8 accumulation is not full fp32) and the -inf pattern exact. Skips with the backend's
own availability reason where deep_gemm is missing, fails to load, or the arch differs."""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm.plugin import deepgemm_backends
from backends.shared import plan_extension
from dispatch.contract.detect import detect_arch
from dispatch.contract.ops import paged_mqa_logits
from tests.support.paged_batch import expected_logits, paged_batch
from tests.support.plans import plan_for

pytestmark = pytest.mark.gpu

# Ragged, page-crossing, none shorter than next_n (the kernels expect every token to see a key).
SEQ_LENS = [
    [1000, 64, 2049, 7, 300, 4096, 129, 65],
    [16384, 40, 9000, 513],
]
CASES = [
    ("deepgemm.sm90", 1),
    ("deepgemm.sm90", 2),
    ("deepgemm.sm90.n4", 4),
    ("deepgemm.sm90.flatten", 1),
    ("deepgemm.sm90.flatten", 3),
    ("deepgemm.sm90.flatten", 4),
    ("deepgemm.sm100", 1),
    ("deepgemm.sm100", 2),
    ("deepgemm.sm100", 3),
    ("deepgemm.sm100", 4),
]


def available(name: str):
    backend = next(b for b in deepgemm_backends() if b.name == name)
    availability = backend.availability()
    if not availability.ok:
        pytest.skip(f"{name}: {availability.reason}")
    return backend


@pytest.mark.parametrize("seq_lens", SEQ_LENS, ids=["8-requests", "4-requests"])
@pytest.mark.parametrize("name,next_n", CASES)
def test_matches_the_torch_reference(name, next_n, seq_lens):
    backend = available(name)
    batch = paged_batch(seq_lens, next_n, heads=64, head_dim=128, device="cuda", seed=next_n)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, arch=detect_arch())
    out = paged_mqa_logits(plan, batch.q_tokens, batch.kv_cache, batch.weights)
    expected = expected_logits(batch)

    assert tuple(out.shape) == tuple(expected.shape)
    hidden = expected == float("-inf")
    assert torch.equal(out == float("-inf"), hidden)
    assert not out.isnan().any()
    visible_out, visible_ref = out[~hidden].double(), expected[~hidden].double()
    error = ((visible_out - visible_ref).norm() / visible_ref.norm()).item()
    assert error < 1e-3, f"relative error {error:.2e}"


# Batches whose one-launch outputs sat at odd words before every output was aligned (B = 1 crashed
# DeepGEMM's kernel with a misaligned address on the H200), and the ragged ones above.
ONE_LAUNCH_LENS = [[2100], [2100, 70, 700], *SEQ_LENS]


@pytest.mark.parametrize("seq_lens", ONE_LAUNCH_LENS, ids=["1-request", "3-requests", "8-requests", "4-requests"])
@pytest.mark.parametrize("name,next_n", [("deepgemm.sm90", 1), ("deepgemm.sm90", 2), ("deepgemm.sm90.n4", 4)])
def test_the_plan_made_in_one_launch_scores_as_the_reference(name, next_n, seq_lens):
    """build_plan's path where backends/shared/plan_prepare.cu is built: DeepGEMM reads the one launch's
    lengths, safe table and schedule."""
    backend = available(name)
    built = plan_extension.warm()
    if not built.ok:
        pytest.skip(f"the one-launch prepare cannot be built here: {built.reason}")
    batch = paged_batch(seq_lens, next_n, heads=64, head_dim=128, device="cuda", seed=next_n)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, arch=detect_arch(), one_launch=True,
                    num_kv_blocks=batch.kv_cache.shape[0])
    out = paged_mqa_logits(plan, batch.q_tokens, batch.kv_cache, batch.weights)
    expected = expected_logits(batch)
    hidden = expected == float("-inf")
    assert torch.equal(out == float("-inf"), hidden) and not out.isnan().any()
    visible_out, visible_ref = out[~hidden].double(), expected[~hidden].double()
    error = ((visible_out - visible_ref).norm() / visible_ref.norm()).item()
    assert error < 1e-3, f"relative error {error:.2e}"
    assert int(plan.error_flags) == 0
