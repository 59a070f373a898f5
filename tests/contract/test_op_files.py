"""One file per op (dispatch/contract/ops/): each declares its contract, the tables are built from the
files, and the op's input checks run once, in the host's call, before any backend sees the tensors."""

from __future__ import annotations

import pytest
import torch

from dispatch.contract import OP_CONTRACTS, LayoutError, Op
from dispatch.contract.ops import EXTEND_STEP_OPS, OP_FILES, PAGED_STEP_OPS, ops_for, topk_rows
from dispatch.contract.ops import indexer_q_quant, ragged_mqa_logits
from dispatch.contract.rope import RopeSpec
from tests.support.plans import one_op_plan


def test_every_op_has_one_file_and_the_tables_come_from_them():
    assert [module.CONTRACT.op for module in OP_FILES] != [] and sorted(m.CONTRACT.op for m in OP_FILES) == sorted(Op)
    assert list(OP_CONTRACTS) == list(Op)
    for module in OP_FILES:
        contract = module.CONTRACT
        assert contract.run.__module__ == module.__name__, f"{module.__name__} declares another file's Protocol"
        assert contract.layouts and contract.summary
    assert PAGED_STEP_OPS == (Op.INDEXER_Q_QUANT, Op.PAGED_MQA_LOGITS, Op.TOPK)
    assert EXTEND_STEP_OPS == (Op.INDEXER_Q_QUANT, Op.RAGGED_MQA_LOGITS, Op.TOPK)
    assert ops_for("decode") == PAGED_STEP_OPS and ops_for("extend") == EXTEND_STEP_OPS


def test_op_is_read_from_the_op_files(tmp_path):
    """`Op` has one member per op file, named by its CONTRACT: a new file is a new op, nothing else edited."""
    from pathlib import Path

    from dispatch.contract.key import op_names

    ops_folder = Path(OP_FILES[0].__file__).parent
    assert op_names(ops_folder) == [op.value for op in Op] == [module.CONTRACT.name for module in OP_FILES]
    for path in ops_folder.glob("*.py"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "sparse_gather.py").write_text('CONTRACT = OpContract(run=R, layouts=(), summary="s", name="sparse_gather")\n')
    assert op_names(tmp_path) == [op.value for op in Op][:2] + ["ragged_mqa_logits", "sparse_gather", "topk"]
    (tmp_path / "zz_bad.py").write_text("NAME = 'x'\nCONTRACT = OpContract(run=R, name=NAME)\n")
    with pytest.raises(ImportError, match=r"zz_bad.py:2: CONTRACT needs its op's name as a literal"):
        op_names(tmp_path)


class Recorder:
    """A backend's run that only counts its calls: the op's checks must refuse before it runs."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("the backend ran on input the op's checks refuse")


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_topk_input_is_checked_once_before_the_backend():
    run = Recorder()
    with pytest.raises(LayoutError, match="lengths int32 \\[2\\]"):
        topk_rows(one_op_plan(Op.TOPK, run), torch.zeros(2, 8), i32([1]), 4)
    assert run.calls == 0


def test_q_quant_input_is_checked_once_before_the_backend():
    run = Recorder()
    q, weights = torch.randn(3, 8, 64), torch.randn(1, 8)  # weights [1, H] would broadcast: refused
    with pytest.raises(LayoutError, match=r"weights \[3, 8\]"):
        indexer_q_quant(one_op_plan(Op.INDEXER_Q_QUANT, run), q, weights, torch.zeros(3, dtype=torch.int32),
                        torch.randn(16, 64), rope=RopeSpec(), softmax_scale=1.0, head_scale=1.0)
    assert run.calls == 0


def test_ragged_logits_input_is_checked_once_before_the_backend():
    run = Recorder()
    fp8 = torch.float8_e4m3fn
    q, k = torch.zeros(4, 2, 32).to(fp8), torch.zeros(6, 32).to(fp8)
    with pytest.raises(LayoutError, match="scales"):
        ragged_mqa_logits(one_op_plan(Op.RAGGED_MQA_LOGITS, run), q, k, torch.zeros(5), torch.zeros(4, 2),
                          i32([0] * 4), i32([6] * 4))
    assert run.calls == 0
