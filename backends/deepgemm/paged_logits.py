"""prepare and run of the DeepGEMM paged MQA logits backends, for one layout each.

prepare builds deep_gemm's schedule once per batch, from the very plan.context_lens tensor every layer's
kernel call then receives, and the plan keeps it as its state: a plain tensor, so a CUDA-graph replay
can refresh it in place with the lens. run checks its inputs against the plan's tag, launches, and writes
-inf past each token's length (masking.py says what that costs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from backends.deepgemm import api
from backends.deepgemm.inputs import check_kernel_inputs
from backends.deepgemm.masking import mask_past_lengths
from dispatch.checks import check_logits_inputs
from dispatch.errors import LayoutError
from dispatch.layout import Layout
from dispatch.plan import IndexerPlan


@dataclass(frozen=True)
class DeepGemmPagedLogits:
    """The paged logits op through deep_gemm, for plans tagged with `layout`."""

    layout: Layout
    load: Callable[[], ModuleType]

    def prepare(self, plan: IndexerPlan) -> torch.Tensor:
        """The batch's schedule, int32 [num_sms + 1, 2], built from plan.context_lens itself."""
        module = self.load()
        lens = plan.context_lens
        return api.build_schedule(module, lens, api.num_sms(module, lens.device))

    def run(self, plan: IndexerPlan, q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        check_logits_inputs(plan, q, kv_cache, weights, consumes=self.layout)
        self._check_schedule(plan)
        check_kernel_inputs(q, kv_cache, weights, plan.context_lens, plan.block_table)
        logits = api.paged_mqa_logits(
            self.load(), q, kv_cache, weights, plan.context_lens, plan.block_table, plan.state, plan.max_context_len
        )
        return mask_past_lengths(logits, plan.context_lens)

    def _check_schedule(self, plan: IndexerPlan) -> None:
        state = plan.state
        if not isinstance(state, torch.Tensor) or state.dim() != 2 or state.dtype != torch.int32:
            raise LayoutError(
                f"the plan holds no DeepGEMM schedule (state is {type(state).__name__}); build it with build_plan"
            )
