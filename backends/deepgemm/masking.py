"""The project's -inf past each token's length, on top of deep_gemm, which leaves those positions unspecified.

What it costs: one extra pass over the logits per layer, in place. For every position of the
[B*N, max_context_len] output: a 1-byte mask written and read back, and the logits read and written
(4 + 4 bytes), in three small launches (positions, compare, fill). That is one more read+write of the
logits the kernel has just written: at next_n = 4 the kernel moves about 148 B per cached token, the pass
about 40 B, more where lengths are ragged, since it covers max_context_len in every row.

The mask is built on each call from the plan's lens rather than once per batch: under CUDA graphs the
plan's lens are refreshed in place between replays, and the mask must follow them. deep_gemm's own
clean_logits would make the pass inside the extension but takes only 1-D lens, and plans hold 2-D
ones; a top-k that takes the lengths could skip the pass altogether.
"""

from __future__ import annotations

import torch


def mask_past_lengths(logits: torch.Tensor, context_lens: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Write -inf in row r at every position >= context_lens.flatten()[r], in place; returns `logits`.

    `fill` (fp32, one value per row) replaces -inf: the page guard gives a poisoned row length 0 and
    fill NaN, so the same single pass makes that whole row NaN."""
    positions = torch.arange(logits.shape[1], device=logits.device, dtype=context_lens.dtype)
    visible = positions[None, :] < context_lens.reshape(-1, 1)
    if fill is None:
        return logits.masked_fill_(~visible, float("-inf"))
    return torch.where(visible, logits, fill.reshape(-1, 1), out=logits)
