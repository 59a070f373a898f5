"""The plans a backend reads: what every plan kind shares (DecidedPlan) and the paged batch's plan
(PagedPlan). Frozen values; dispatch/step/ builds them (build_plan, build_extend_plan), and a backend's
`prepare` and `run` receive them. The extend plan and its ragged metadata: dispatch/contract/extend_plan.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dispatch.contract.bounds import new_error_flags, raise_for_flags
from dispatch.contract.decision import Decision
from dispatch.contract.errors import LayoutError
from dispatch.contract.key import DispatchKey, Fp8Dtype, Op
from dispatch.contract.layout import Layout, rows_and_tokens


class DecidedPlan:
    """What every plan kind shares (PagedPlan for paged batches, dispatch.step.extend_plan.ExtendPlan for
    extend batches): its decisions and per-op states, read by op, and its error flags. A subclass is a
    frozen dataclass with `key`, `decisions`, `states` and `error_flags` fields."""

    key: DispatchKey
    decisions: Mapping[Op, Decision]
    states: Mapping[Op, Any]
    error_flags: torch.Tensor | None

    # --- Error flags (dispatch/contract/bounds.py): the device-side record of out-of-range input. ---

    def check_errors(self) -> None:
        """Sync, read and clear the error flags; raise IndexBoundsError naming what a backend saw.

        Call it where the engine syncs anyway (the step's end), or after each select in debug runs:
        a set flag means some rows of this plan's logits are NaN and their top-k is meaningless."""
        bits = int(self.error_flags.item())
        if bits:
            self.error_flags.zero_()
            raise_for_flags(bits, f"{self.kind} for {self.key}")

    def reset_errors(self) -> None:
        """Zero the flags in place, with no sync (a captured graph's plan is reused across batches)."""
        self.error_flags.zero_()

    kind = "plan"  # how check_errors names the plan

    def decision(self, op: Op) -> Decision:
        if op not in self.decisions:
            raise LayoutError(f"the plan decided {', '.join(o.value for o in self.decisions)}; not {Op(op).value}")
        return self.decisions[op]

    def state_of(self, op: Op) -> Any:
        return self.states.get(op)

    @property
    def indexer_q_quant(self) -> Decision:
        return self.decision(Op.INDEXER_Q_QUANT)

    @property
    def topk(self) -> Decision:
        return self.decision(Op.TOPK)

    @property
    def fp8_dtype(self) -> Fp8Dtype:
        return self.key.fp8_dtype


@dataclass(frozen=True)
class PlanTensors:
    """What a paged logits backend's `plan_tensors` makes in one host call (one launch): the plan's
    visible lengths (native [B, N]), its zeroed error flags and the backend's per-batch state, the same
    tensors its `prepare` and the plan's own torch ops would make. One call instead of about ten,
    because a GPU host pays 3-30 us for each torch op and each Triton launch, every batch."""

    context_lens: torch.Tensor
    error_flags: torch.Tensor
    state: Any
    # int32 [B*N]: each token's visible length cut to max_context_len (PagedPlan.readable_lengths), where
    # the one call writes it beside the lengths; None: a top-k that needs it clamps the lengths itself.
    readable_lengths: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class PagedPlan(DecidedPlan):
    """Decisions plus layout tensors. Backends read only this; nothing re-derives the path."""

    key: DispatchKey
    decisions: Mapping[Op, Decision]  # one per op of ops_for(key.forward_mode)
    batch_size: int
    next_n: int
    context_lens: torch.Tensor  # native [B, N]; flatten [B*N, 1]
    block_table: torch.Tensor  # native [B, M]; flatten [B*N, M]
    max_context_len: int
    page_rows: torch.Tensor | None = None  # int32 [B*N]: the block_table row that serves each token
    states: Mapping[Op, Any] = field(default_factory=dict)  # per op, its backend's prepare(plan), if any
    # int32 [1] on the plan's device, zeroed here, ORed into by backends (dispatch/contract/bounds.py bits).
    error_flags: torch.Tensor | None = None
    num_kv_blocks: int | None = None  # PagedBatch.num_kv_blocks: the pool the page table must index
    # int32 [B*N] or None: token_lengths cut to max_context_len, where the logits backend's one launch
    # wrote them (PlanTensors); read through readable_token_lengths(), which clamps where it did not.
    readable_lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.error_flags is None:
            object.__setattr__(self, "error_flags", new_error_flags(self.context_lens.device))

    @property
    def logits(self) -> Decision:
        return self.decision(Op.PAGED_MQA_LOGITS)

    @property
    def state(self) -> Any:
        """The logits backend's per-batch state (e.g. a DeepGEMM schedule)."""
        return self.state_of(Op.PAGED_MQA_LOGITS)

    @property
    def layout(self) -> Layout:
        return self.logits.layout

    @property
    def token_lengths(self) -> torch.Tensor:
        """int32 [B*N]: each token's visible length, request-major (the logits' row order); a view."""
        return self.context_lens.reshape(-1)

    def readable_token_lengths(self) -> torch.Tensor:
        """int32 [B*N]: token_lengths cut to max_context_len, the logits rows' width, so a kernel that
        trusts its lengths never reads past a row (a longer length is the engine's error, flagged by the
        guard). Written by the plan's one launch where it ran; else one clamp, here."""
        return self.readable_lengths if self.readable_lengths is not None else self.cut_token_lengths()

    def cut_token_lengths(self) -> torch.Tensor:
        """token_lengths cut to max_context_len, computed now (one clamp): what readable_lengths holds."""
        return self.token_lengths.clamp(0, self.max_context_len).to(torch.int32)

    def q_in_layout(self, q_tokens: torch.Tensor) -> torch.Tensor:
        """View per-token q [B*N, H, D] (request-major) as the decided layout's q."""
        rows, tokens = rows_and_tokens(self.layout, self.batch_size, self.next_n)
        expected = self.batch_size * self.next_n
        if q_tokens.dim() != 3 or q_tokens.shape[0] != expected:
            raise LayoutError(
                f"q has shape {list(q_tokens.shape)}; the plan expects per-token q [B*N={expected}, H, D]"
            )
        return q_tokens.view(rows, tokens, *q_tokens.shape[1:])

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key.as_dict(),
            "batch_size": self.batch_size,
            "next_n": self.next_n,
            "max_context_len": self.max_context_len,
            "num_kv_blocks": self.num_kv_blocks,
            "context_lens_shape": list(self.context_lens.shape),
            "block_table_shape": list(self.block_table.shape),
            "decisions": {op.value: decision.as_dict() for op, decision in self.decisions.items()},
        }
