"""Indices an engine hands dispatch (page-table entries, Q positions, context lengths) against the
tensors they index, and the plan's error flags that carry a fault to the engine.

On the device a backend never dereferences a bad index: it poisons the rows that would have used it
with NaN and ORs one of the bits below into the plan's int32 `error_flags` tensor, which the engine
reads at a sync it makes anyway (`PagedPlan.check_errors`). Pages and lengths are per batch, so their
device check runs once per batch, in the logits backend's prepare (backends/shared/page_guard.py),
against the pool size the engine gives the plan (PagedBatch.num_kv_blocks) or, failing that, the
first layer's cache; positions are checked by each Q-quant call. Where a check is free (the torch
references, or DISPATCH_DEBUG_BOUNDS=1, which syncs), the same fault raises IndexBoundsError at once,
naming the row, token, index and bound.

Which pages a token needs: token j of row r sees keys [0, ctx[r, j]), so it reads logical pages
[0, ceil(ctx[r, j] / block_kv)) of row r's table; entries past that are padding and may hold anything.
"""

from __future__ import annotations

import functools
import os

import torch

from dispatch.contract.errors import IndexBoundsError

BAD_PAGE = 1  # a page-table entry a visible key needs is outside [0, num_blocks)
BAD_POSITION = 2  # a Q position is outside [0, rows of the cos/sin cache)
LENGTH_PAST_BOUND = 4  # a visible length is longer than max_context_len (the logits' width)
BAD_LENGTH = 8  # an extend batch's lengths on the device are negative or disagree with its host totals

_MEANINGS = {
    BAD_PAGE: "a page-table entry outside [0, num_blocks) that a visible key needs (that token's logits row is NaN)",
    BAD_POSITION: "a Q position outside the cos/sin cache (that token's folded weights, so its logits row, are NaN)",
    LENGTH_PAST_BOUND: "a context length past max_context_len (that token's logits row is NaN)",
    BAD_LENGTH: "an extend batch's lengths are negative or disagree with total_tokens / total_keys (every key "
    "is poisoned: no row selects any)",
}


def debug_bounds_on() -> bool:
    """DISPATCH_DEBUG_BOUNDS=1: GPU backends also check indices on the host (one sync per call) and raise."""
    return os.environ.get("DISPATCH_DEBUG_BOUNDS") == "1"


def new_error_flags(device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 [1] flag word on `device`."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def scratch_error_flags(device: torch.device) -> torch.Tensor:
    """A per-device flag word for kernels called without a plan (tuners, direct calls): allocated once,
    so a call costs no allocation or memset; nothing reads it."""
    return new_error_flags(device)


def describe(bits: int) -> list[str]:
    """One line per bit set in `bits`; bits this version does not know are named too."""
    lines = [meaning for bit, meaning in _MEANINGS.items() if bits & bit]
    unknown = bits & ~sum(_MEANINGS)
    if unknown:
        lines.append(f"unknown bits {unknown:#x}")
    return lines


def raise_for_flags(bits: int, where: str) -> None:
    """Raise IndexBoundsError listing what `bits` say; return if none is set."""
    if bits:
        found = "; ".join(describe(bits))
        raise IndexBoundsError(f"{where}: a backend saw out-of-range input (flags {bits:#x}): {found}")


def token_faults(
    context_lens: torch.Tensor, block_table: torch.Tensor, num_blocks: int, max_context_len: int, block_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bad_page [R, N] bool, past_bound [R, N] bool), with torch ops only: no host-device sync.

    bad_page: a page the token needs (within the logits' width) names a block outside [0, num_blocks).
    past_bound: the token's length exceeds max_context_len."""
    pages = min(-(-max_context_len // block_kv), block_table.shape[1])
    table = block_table[:, :pages]
    out_of_range = (table < 0) | (table >= num_blocks)  # [R, pages]
    # The first bad page of each row; a token is hit when it needs that page.
    page_index = torch.arange(pages, device=table.device, dtype=torch.int32)
    first_bad = torch.where(out_of_range, page_index, pages).amin(dim=1, keepdim=True) if pages else None
    needed = torch.clamp((context_lens + (block_kv - 1)) // block_kv, max=pages)  # [R, N]
    bad_page = needed > first_bad if first_bad is not None else torch.zeros_like(context_lens, dtype=torch.bool)
    return bad_page, context_lens > max_context_len


def check_pages(
    context_lens: torch.Tensor, block_table: torch.Tensor, num_blocks: int, max_context_len: int, block_kv: int
) -> None:
    """Raise IndexBoundsError for the first token whose length or needed page is out of range (syncs)."""
    past_bound = context_lens > max_context_len
    if bool(past_bound.any()):
        row, token = (int(i) for i in past_bound.nonzero()[0])
        raise IndexBoundsError(
            f"row {row} token {token}: context length {int(context_lens[row, token])} is past "
            f"max_context_len={max_context_len}; the engine's max_seq_len must cover every length"
        )
    bad_page, _ = token_faults(context_lens, block_table, num_blocks, max_context_len, block_kv)
    if bool(bad_page.any()):
        row, token = (int(i) for i in bad_page.nonzero()[0])
        needed = -(-int(context_lens[row, token]) // block_kv)
        entries = block_table[row, :needed]
        page = int(((entries < 0) | (entries >= num_blocks)).nonzero()[0])
        raise IndexBoundsError(
            f"row {row} token {token}: page-table entry [{row}, {page}] = {int(entries[page])} is outside the "
            f"KV cache's [0, {num_blocks}) blocks, and the token's length {int(context_lens[row, token])} needs it"
        )


def check_positions(positions: torch.Tensor, max_pos: int) -> None:
    """Raise IndexBoundsError for the first Q position outside [0, max_pos) (syncs)."""
    bad = (positions < 0) | (positions >= max_pos)
    if bool(bad.any()):
        token = int(bad.nonzero()[0])
        raise IndexBoundsError(
            f"token {token}: position {int(positions[token])} is outside the cos/sin cache's [0, {max_pos}) rows"
        )
