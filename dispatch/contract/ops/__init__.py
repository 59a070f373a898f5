"""The ops, one file each (q_quant.py, paged_logits.py, ragged_logits.py, top_k.py): an op's call
convention, the layouts it accepts, its input and output checks and the host-side call through a
plan's decision. `Op`, OP_CONTRACTS and the indexer's step tables are built here from every file of
this package that declares a CONTRACT, so adding an op adds its file and edits nothing here."""

from __future__ import annotations

import importlib
import pkgutil

from dispatch.contract.key import ForwardMode, Op
from dispatch.contract.ops.op_contract import EXTEND_STEP, PAGED_STEP, OpContract
from dispatch.contract.ops.paged_logits import PagedMqaLogitsRun, check_logits_inputs, paged_mqa_logits
from dispatch.contract.ops.q_quant import IndexerQQuantRun, check_q_quant_inputs, indexer_q_quant
from dispatch.contract.ops.ragged_logits import (
    RaggedKeyGather,
    RaggedMqaLogitsRun,
    check_ragged_logits_inputs,
    gather_keys,
    ragged_mqa_logits,
)
from dispatch.contract.ops.top_k import TopkRun, check_topk_inputs, topk, topk_rows

# This package's own files, found by name (sorted, so every machine reads them alike); nothing is
# imported from outside it.
OP_FILES = tuple(
    module
    for module in (importlib.import_module(f"{__name__}.{info.name}") for info in sorted(pkgutil.iter_modules(__path__)))
    if hasattr(module, "CONTRACT")
)
_DECLARED = [module.CONTRACT.name for module in OP_FILES]
if _DECLARED != [op.value for op in Op]:  # Op is read from these files' source (dispatch/contract/key.py)
    raise ImportError(f"dispatch/contract/ops/ declares the ops {_DECLARED}; Op has {[op.value for op in Op]}")

OP_CONTRACTS: dict[Op, OpContract] = {module.CONTRACT.op: module.CONTRACT for module in OP_FILES}  # in Op's order


def step_ops(step: str) -> tuple[Op, ...]:
    """The ops a step runs, in stage order (Q quant, logits, top-k): what its plan decides."""
    return tuple(c.op for c in sorted(OP_CONTRACTS.values(), key=lambda c: c.stage) if step in c.steps)


PAGED_STEP_OPS: tuple[Op, ...] = step_ops(PAGED_STEP)
EXTEND_STEP_OPS: tuple[Op, ...] = step_ops(EXTEND_STEP)


def ops_for(mode: ForwardMode | str) -> tuple[Op, ...]:
    """The ops a batch of `mode` runs, so its plan decides exactly these (and explain, validate's
    callers and rank agreement ask for these): extend the ragged step, every other mode the paged one."""
    return EXTEND_STEP_OPS if ForwardMode(mode) is ForwardMode.EXTEND else PAGED_STEP_OPS


__all__ = [
    "EXTEND_STEP_OPS",
    "OP_CONTRACTS",
    "OP_FILES",
    "PAGED_STEP_OPS",
    "IndexerQQuantRun",
    "OpContract",
    "PagedMqaLogitsRun",
    "RaggedKeyGather",
    "RaggedMqaLogitsRun",
    "TopkRun",
    "check_logits_inputs",
    "check_q_quant_inputs",
    "check_ragged_logits_inputs",
    "check_topk_inputs",
    "gather_keys",
    "indexer_q_quant",
    "ops_for",
    "paged_mqa_logits",
    "ragged_mqa_logits",
    "step_ops",
    "topk",
    "topk_rows",
]
