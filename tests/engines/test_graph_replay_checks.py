"""What a captured CUDA graph refuses to replay, checked on the CPU: the capture itself is
GPU-only (tests/engines/test_cuda_graphs.py), the decision and shape checks are not."""

import pytest
import torch

from dispatch.contract.errors import GraphMismatchError
from dispatch.engines.graphs import check_replayable
from dispatch.contract.key import ForwardMode
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.deciding.runtime import load_dispatcher

REGISTRY = """
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: verify-native
        when: {forward_mode: target_verify}
        use: torch.reference
      - id: draft-flatten
        when: {forward_mode: draft_extend}
        use: torch.reference.flatten
  indexer_q_quant:
    fallback: torch.reference
  topk:
    fallback: torch.reference
  ragged_mqa_logits:
    fallback: torch.reference
"""


@pytest.fixture
def dispatcher(tmp_path):
    path = tmp_path / "registry.yaml"
    path.write_text(REGISTRY)
    return load_dispatcher(path, arch="cpu")


def _batch(mode=ForwardMode.TARGET_VERIFY, lens=(9, 17, 30), next_n=3, max_len=64, pages=1):
    return PagedBatch(torch.tensor(lens, dtype=torch.int32), torch.zeros(len(lens), pages, dtype=torch.int32),
                        max_len, mode, next_n)


def _check(dispatcher, captured_batch, batch):
    captured = build_plan(dispatcher, captured_batch, kv_fp8_dtype="e4m3fn")
    check_replayable(captured, batch, build_plan(dispatcher, batch, kv_fp8_dtype="e4m3fn"))


def test_same_shapes_and_decision_replay(dispatcher):
    _check(dispatcher, _batch(), _batch(lens=(3, 60, 4), max_len=60))


def test_a_batch_whose_decision_differs_is_refused(dispatcher):
    with pytest.raises(GraphMismatchError, match=r"decides `torch.reference.flatten` \(flatten, draft-flatten\).*"
                                                 r"captured with `torch.reference` \(native, verify-native\)"):
        _check(dispatcher, _batch(), _batch(mode=ForwardMode.DRAFT_EXTEND))


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (_batch(lens=(9, 17)), "B=2"),
        (_batch(next_n=2), "next_n=2"),
        (_batch(max_len=65), "exceeds the captured bound 64"),
        (_batch(pages=2), "page table has 2 columns"),
    ],
)
def test_shapes_past_the_capture_are_refused(dispatcher, batch, message):
    with pytest.raises(GraphMismatchError, match=message):
        _check(dispatcher, _batch(), batch)


def test_an_extend_batch_is_not_captured():
    from dispatch.engines.graphs import CapturedIndexerStep
    from dispatch.engines.indexer_step import IndexerStep
    from dispatch.contract.rope import RopeSpec
    from tests.support.extend_batch import extend_case

    step = IndexerStep(load_dispatcher(arch="cpu"), kv_fp8_dtype=torch.float8_e4m3fn, rope=RopeSpec.neox_head(),
                       softmax_scale=1.0, head_scale=1.0)
    with pytest.raises(GraphMismatchError, match="captures paged batches.*got ExtendBatch"):
        CapturedIndexerStep(step, extend_case([3], [2]).batch, inputs=None)
