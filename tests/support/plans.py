"""Test helpers: a plan tagged with one given backend, so kernel tests need no registry."""

from __future__ import annotations

import dataclasses
import torch

from dispatch.contract.backend import Backend
from dispatch.contract.decision import Decision
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.step.paged_plan import PagedPlan, layout_tensors, page_rows


def decision_for(backend: Backend, key: DispatchKey) -> Decision:
    return Decision(
        op=backend.op,
        key=key,
        backend=backend.name,
        layout=backend.layout,
        rule="test",
        source="rule",
        cluster=None,
        plugin=backend.plugin or "test",
        rejected=(),
        registry_fingerprint="test",
        impl=backend,
    )


def plan_for(
    backend: Backend,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    next_n: int,
    *,
    fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
    forward_mode: ForwardMode | None = None,
    arch: Arch = Arch.CPU,
    max_seq_len: int | None = None,
    num_kv_blocks: int | None = None,
    one_launch: bool = False,
) -> PagedPlan:
    """A plan deciding `backend` for every op, its state made by its prepare, or (one_launch) its lengths,
    flags and state made by its plan_tensors, as build_plan takes them (AssertionError where it declines)."""
    mode = forward_mode or (ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY)
    key = DispatchKey(arch=arch, forward_mode=mode, next_n=next_n, fp8_dtype=fp8_dtype)
    decision = decision_for(backend, key)
    context_lens, block_table = layout_tensors(backend.layout, seq_lens, page_table, next_n)
    plan = PagedPlan(
        key=key,
        decisions={op: decision for op in Op},
        batch_size=seq_lens.shape[0],
        next_n=next_n,
        context_lens=context_lens,
        block_table=block_table,
        max_context_len=int(seq_lens.max()) if max_seq_len is None else max_seq_len,
        page_rows=page_rows(backend.layout, seq_lens.shape[0], next_n, seq_lens.device),
        num_kv_blocks=num_kv_blocks,
    )
    if one_launch:
        made = backend.plan_tensors(seq_lens=seq_lens, page_table=page_table, next_n=next_n,
                                    max_context_len=plan.max_context_len, num_kv_blocks=num_kv_blocks)
        assert made is not None, f"{backend.name}'s one launch declined this batch"
        return dataclasses.replace(plan, context_lens=made.context_lens, error_flags=made.error_flags,
                                   states={backend.op: made.state})
    if backend.prepare is None:
        return plan
    return dataclasses.replace(plan, states={backend.op: backend.prepare(plan)})


@dataclasses.dataclass(frozen=True)
class OneOpPlan:
    """A plan that decides one backend for one op and holds nothing else: the op's host-side call (its
    input checks, the backend, its output check; dispatch/contract/ops/) on explicit tensors, as the
    step runs it, without a batch. How kernel tests meet the checks the host runs before a backend."""

    decisions: dict
    states: dict = dataclasses.field(default_factory=dict)
    error_flags: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1, dtype=torch.int32))

    def decision(self, op: Op) -> Decision:
        return self.decisions[op]

    def state_of(self, op: Op):
        return self.states.get(op)


def one_op_plan(op: Op, run, *, layout=None, fp8_dtype: Fp8Dtype = Fp8Dtype.E4M3FN, arch: Arch = Arch.CPU,
                device="cpu") -> OneOpPlan:
    """A OneOpPlan whose decision for `op` runs `run` (a kernel entry point, or a backend's run), its error
    flags on `device` (the op's checks want them beside the tensors: pass the test's device on a GPU)."""
    from dispatch.contract.backend import ALL_ARCHS, ALL_MODES, Support
    from dispatch.contract.ops import OP_CONTRACTS

    backend = Backend(name="under-test", op=op, layout=layout or OP_CONTRACTS[op].layouts[0],
                      supports=Support(archs=ALL_ARCHS, forward_modes=ALL_MODES), run=run)
    mode = ForwardMode.EXTEND if op is Op.RAGGED_MQA_LOGITS else ForwardMode.DECODE
    decision = decision_for(backend, DispatchKey(arch=arch, forward_mode=mode, next_n=1, fp8_dtype=fp8_dtype))
    return OneOpPlan({op: decision}, error_flags=torch.zeros(1, dtype=torch.int32, device=device))
