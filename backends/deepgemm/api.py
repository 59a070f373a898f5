"""The deep_gemm paged MQA logits API, tolerant of the generations in the field.

- `fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule, max_context_len,
  clean_logits)`: the first generation; q is the fp8 tensor.
- `fp8_fp4_paged_mqa_logits(...)`, same arguments, q a (values, scales) pair: fp8 q goes as `(q, None)`
  because some builds read a bare tensor as packed FP4. Builds that have it keep the first name as a
  legacy alias, so the newer name is tried first.
- Newer builds accept only 2-D context lens; plans always hold 2-D lens (native [B, N], flatten
  [B*N, 1]), which every generation that has a 2-D path reads the same way.
- `get_num_sms()` is what the kernel launches with, so the schedule must use it; builds without it fall
  back to the device's SM count.

Every function takes the module as its first argument, so tests can hand in a recording stand-in.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only; the availability probe imports this module, and registering must not import torch
    import torch

# Page size the SM90 and SM100 kernels are scheduled for (SM100 also takes 32; the plans use 64).
BLOCK_KV = 64
SCHEDULE = "get_paged_mqa_logits_metadata"
LOGITS_FP8_FP4 = "fp8_fp4_paged_mqa_logits"
LOGITS_FP8 = "fp8_paged_mqa_logits"


def missing_symbols(module: ModuleType) -> list[str]:
    """The API names this adapter needs and `module` lacks, as they would read in a message."""
    missing = [] if hasattr(module, SCHEDULE) else [f"`{SCHEDULE}`"]
    if not (hasattr(module, LOGITS_FP8_FP4) or hasattr(module, LOGITS_FP8)):
        missing.append(f"`{LOGITS_FP8_FP4}` or `{LOGITS_FP8}`")
    return missing


def num_sms(module: ModuleType, device: torch.device) -> int:
    if hasattr(module, "get_num_sms"):
        return int(module.get_num_sms())
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def build_schedule(module: ModuleType, context_lens: torch.Tensor, sms: int) -> torch.Tensor:
    """int32 [sms + 1, 2]: the split of the batch's KV pages over the SMs, for exactly these lens."""
    return getattr(module, SCHEDULE)(context_lens, BLOCK_KV, sms)


def paged_mqa_logits(
    module: ModuleType,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule: torch.Tensor,
    max_context_len: int,
) -> torch.Tensor:
    """fp32 [rows * next_n, max_context_len]; positions past a token's length hold garbage.

    clean_logits stays off: it accepts only 1-D lens, and plans hold 2-D lens.
    """
    if hasattr(module, LOGITS_FP8_FP4):
        kernel, q_arg = getattr(module, LOGITS_FP8_FP4), (q, None)
    else:
        kernel, q_arg = getattr(module, LOGITS_FP8), q
    # Positional: the eight leading parameters sit in the same places in every generation and binding.
    return kernel(q_arg, kv_cache, weights, context_lens, block_table, schedule, max_context_len, False)
