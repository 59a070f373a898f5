"""A plan's per-batch DeepGEMM state: what DeepGemmPagedLogits.prepare (backends/deepgemm/adapter.py)
and the plan's one launch (backends/deepgemm/plan_tensors.py) both make, and every layer's call reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from backends.shared.page_guard import PageGuard


@dataclass(frozen=True)
class DeepGemmState:
    """A plan's per-batch DeepGEMM state."""

    schedule: torch.Tensor  # int32 [num_sms + 1, 2], built from plan.context_lens itself
    guard: PageGuard  # the batch's page guard: safe table, mask lengths and fill
