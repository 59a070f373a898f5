"""Named tensor layouts. A backend declares the one it consumes; the plan builds tensors in it;
the backend checks what it is handed against the tag. Nothing infers a layout from a shape."""

from __future__ import annotations

import enum

# Logits rows a logits backend hands the top-k are readable up to their width rounded up to this many
# floats (16 bytes): every row starts 16-byte aligned and the buffer's storage holds the last row's
# rounded tail. The engines' top-k kernels load 16 bytes at a time (SGLang's v2, vLLM's TMA loads of
# round_up(length, 4)); a tensor that stops at the width makes their adapters copy the whole logits
# (19 us at B=128 L~32K on the H200, the kernel itself 17.7) to keep them inside it.
ROW_UNIT_FLOATS = 4


def readable_width(width: int) -> int:
    """`width` floats rounded up to whole ROW_UNIT_FLOATS: what a logits buffer's rows must hold."""
    return -(-width // ROW_UNIT_FLOATS) * ROW_UNIT_FLOATS


class Layout(str, enum.Enum):
    # q [B, N, H, D], context lens [B, N], block table [B, M]: each KV page is read once for all N.
    NATIVE = "native"
    # q [B*N, 1, H, D], context lens [B*N, 1], block table repeated per token [B*N, M].
    FLATTEN = "flatten"
    # indexer Q quantisation works token by token: q [T, H, D], weights [T, H].
    TOKENS = "tokens"
    # top-k works on logits rows: logits [rows, W], visible lengths [rows] (request-major tokens).
    ROWS = "rows"
    # ragged (extend) logits: q [M, H, D] against one contiguous k [S, D], row m seeing keys [ks[m], ke[m]).
    RAGGED = "ragged"

    def describe(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Layout.NATIVE: "q [B, N, H, D], context lens [B, N], block table [B, M]",
    Layout.FLATTEN: "q [B*N, 1, H, D], context lens [B*N, 1], block table [B*N, M] (repeated per token)",
    Layout.TOKENS: "q [T, H, D], weights [T, H]",
    Layout.ROWS: "logits [rows, W], lengths [rows], starts [rows] or none",
    Layout.RAGGED: "q [M, H, D], k [S, D] + scales [S], weights [M, H], ks / ke [M]",
}


def rows_and_tokens(layout: Layout, batch_size: int, next_n: int) -> tuple[int, int]:
    """The (leading, token) extents of q and context lens that `layout` gives a batch of B x N tokens."""
    if layout is Layout.NATIVE:
        return batch_size, next_n
    if layout is Layout.FLATTEN:
        return batch_size * next_n, 1
    raise ValueError(f"layout `{layout.value}` has no paged-logits shape")
