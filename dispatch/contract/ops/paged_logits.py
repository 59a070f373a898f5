"""The op `paged_mqa_logits`: fp32 logits of every visible cached key, read from the paged fp8 K cache
in place (decode, target_verify, draft_extend). Everything the op is: its call convention, its
layouts, its input and output checks, and the host-side call through a plan's decision."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dispatch.contract.calling import call_backend
from dispatch.contract.key import Op
from dispatch.contract.layout import Layout
from dispatch.contract.ops.op_contract import PAGED_STEP, OpContract
from dispatch.contract.output_checks import check_output

if TYPE_CHECKING:  # torch is imported where it is used: the contract (and `validate`) loads without it
    import torch


class PagedMqaLogitsRun(Protocol):
    """run(plan, q, kv_cache, weights, *, clean_logits=True) -> fp32 logits [B*N, plan.max_context_len].

    q is fp8 in plan.layout (native [B, N, H, D]; flatten [B*N, 1, H, D]), kv_cache uint8
    [num_blocks, block_kv, 1, D + 4], weights fp32 [B*N, H]. The run is handed inputs that passed
    check_logits_inputs against its decision's layout and, with clean_logits, writes -inf at every
    position past a token's length; without it those positions are unspecified (a backend may still
    write -inf there): the indexer step asks for that, because its top-k never reads past a length.
    Bounds and NaN (dispatch/contract/bounds.py): it never follows a page-table entry outside
    [0, num_blocks) that a visible key needs; that token's row, like the row of a token whose length
    passes max_context_len, is NaN in every column, and the bit is ORed into plan.error_flags (a torch
    reference raises IndexBoundsError instead). A NaN q element or weight, a NaN key byte or a
    non-finite key scale makes the logits it touches NaN."""

    def __call__(
        self,
        plan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        *,
        clean_logits: bool = True,
    ) -> torch.Tensor: ...


CONTRACT = OpContract(
    run=PagedMqaLogitsRun,
    layouts=(Layout.NATIVE, Layout.FLATTEN),
    summary="fp32 logits of every visible cached key",
    op=Op.PAGED_MQA_LOGITS,
    steps=(PAGED_STEP,),
    stage=1,
)


def paged_mqa_logits(plan, q_tokens: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, *,
                     clean_logits: bool = True) -> torch.Tensor:
    """Paged MQA logits through the plan's decided backend; q_tokens is per-token fp8 [B*N, H, D].
    Without clean_logits the positions past a token's length are unspecified (a reader of only the
    visible keys, as the top-k op is, saves the backend the -inf fill)."""
    import torch

    from dispatch.contract.input_checks import check_logits_inputs

    decision = plan.decision(Op.PAGED_MQA_LOGITS)
    q = plan.q_in_layout(q_tokens)
    check_logits_inputs(plan, q, kv_cache, weights, consumes=decision.layout)
    out = call_backend(decision, plan, q, kv_cache, weights, clean_logits=clean_logits)
    rows = plan.batch_size * plan.next_n
    check_output(decision, "logits", out, (rows, plan.max_context_len), torch.float32, q_tokens.device,
                 min_columns=True)
    return out
