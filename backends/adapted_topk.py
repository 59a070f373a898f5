"""An engine's top-k kernel behind dispatch's top-k contract (dispatch.contract.TopkRun): what every
adapter of one (FlashInfer, SGLang, vLLM) shares.

- `CallLimits`: the facts of one call a kernel accepts beyond the dispatch key (k, row starts, rows,
  row width), checked on the host before the launch, so a call it cannot serve raises
  UnservedCallError (a LayoutError) naming the backend and the reason instead of giving a wrong answer.
- `clamped_lengths`: lengths cut to what each row's window holds, so a kernel that trusts its lengths
  (they all do) never reads past the logits it was handed.
- `aligned_rows`: the logits copied to a row stride the kernel accepts, where it demands one.
- `finish`: the contract's -1s, NaN rule, order and page transform applied to a kernel's raw [rows, k]
  (on a GPU one Triton launch in place, backends/triton/selection_finish.py; sorted=True and the CPU
  take the torch ops).
  The engines' radix selects rank a NaN as a number (above +inf), so a selected NaN becomes -1: a
  poisoned (all-NaN) row gives all -1, as on every backend; a row mixing NaN with numbers may keep
  fewer than k keys where the contract keeps k (the one documented difference).

torch is imported where these run: registering a backend must not import it (`validate` runs without it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dispatch.contract import UnservedCallError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallLimits:
    """What one kernel accepts of a call. `k_values` None: any k up to `k_max` (None: unbounded)."""

    backend: str
    k_values: frozenset[int] | None = None
    k_max: int | None = None
    row_starts: bool = False
    rows_max: int | None = None
    width_max: int | None = None
    width_reason: str = ""

    def why_not(self, rows: int, k: int, *, starts: bool, width: int = 0) -> str | None:
        """None when the kernel serves a call of `rows` rows keeping `k`, else why not."""
        if self.k_values is not None and k not in self.k_values:
            return f"k {k} is not one it is built for ({', '.join(map(str, sorted(self.k_values)))})"
        if self.k_max is not None and k > self.k_max:
            return f"k {k} is past its {self.k_max}"
        if starts and not self.row_starts:
            return "it reads every row from column 0; ragged rows (starts) need another top-k backend"
        if self.rows_max is not None and rows > self.rows_max:
            return f"{rows} rows is past its {self.rows_max} (one cluster wave)"
        if self.width_max is not None and width > self.width_max:
            return f"rows {width} wide are past its {self.width_max}: {self.width_reason}"
        return None

    def check(self, rows: int, k: int, *, starts: bool, width: int = 0) -> None:
        reason = self.why_not(rows, k, starts=starts, width=width)
        if reason is not None:
            raise UnservedCallError(f"top-k backend `{self.backend}` cannot serve this call: {reason}")


def clamped_lengths(logits: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """int32 [rows]: lengths[r] cut to [0, W - starts[r]] (one small launch, no sync), so a kernel that
    reads starts[r] .. starts[r] + lengths[r] - 1 stays inside the row."""
    import torch

    width = logits.shape[1]
    if starts is None:  # scalar bounds: no host tensor to copy, so it also runs inside a CUDA graph capture
        return lengths.clamp(0, width).to(torch.int32)
    return torch.minimum(lengths.clamp(min=0), (width - starts).clamp(min=0)).to(torch.int32)


def aligned_rows(logits: torch.Tensor, multiple: int) -> torch.Tensor:
    """`logits` itself when its row stride is a multiple of `multiple` floats, its base 16-byte aligned
    and its storage holds the last row rounded up to `multiple` floats, else a copy with the width padded
    up to one (one extra read and write of the logits). A kernel that demands the stride loads whole
    units of `multiple` floats: it reads each row up to its length rounded up (vLLM's cooperative_topk
    TMA-loads round_up(length, 4) floats), which stays inside the row's stride, but past the tensor's
    end on a last row whose storage stops at the width."""
    import torch

    if multiple == 1 or (logits.stride(0) % multiple == 0 and logits.data_ptr() % 16 == 0
                         and _holds_rounded_last_row(logits, multiple)):
        return logits
    rows, width = logits.shape
    _say_copied(logits, multiple)
    padded = torch.empty(rows, -(-width // multiple) * multiple, dtype=logits.dtype, device=logits.device)
    padded[:, :width].copy_(logits)
    return padded[:, :width]


_COPY_REASONS_SAID: set[tuple[int, bool, bool]] = set()


def _say_copied(logits: torch.Tensor, multiple: int) -> None:
    """Log, once per kind of layout, that the logits were copied: the copy is a full read and write of
    them (19 us at 128 x 48.6K on the H200), so a caller handing such logits every layer should hear why
    (dispatch's own logits backends hand rows readable in ROW_UNIT_FLOATS units and are never copied)."""
    reason = (multiple, logits.stride(0) % multiple == 0, logits.data_ptr() % 16 == 0)
    if reason in _COPY_REASONS_SAID:
        return
    _COPY_REASONS_SAID.add(reason)
    why = ("its row stride is not a multiple of it" if not reason[1] else
           "its base is not 16-byte aligned" if not reason[2] else
           "its storage ends before the last row's width rounded up to it")
    logger.warning("top-k: logits %s copied to rows of a multiple of %d floats: %s", list(logits.shape), multiple, why)


def _holds_rounded_last_row(logits: torch.Tensor, multiple: int) -> bool:
    rows, width = logits.shape
    if rows == 0:
        return True
    last_end = logits.storage_offset() + (rows - 1) * logits.stride(0) + -(-width // multiple) * multiple
    return last_end * logits.element_size() <= logits.untyped_storage().nbytes()


def finish(logits, lengths, positions, *, page_table, page_rows, block_size, sorted, starts=None):
    """The contract's -1s, NaN rule, order and page transform, applied to a kernel's raw [rows, k]
    positions (relative to starts[r]; -1 where the kernel selected nothing)."""
    import torch

    if logits.is_cuda and not sorted and positions.dtype == torch.int32 and positions.stride(1) == 1:
        from backends.triton.selection_finish import finish_in_place  # one launch instead of the ops below

        return finish_in_place(positions, logits, lengths, starts=starts, page_table=page_table,
                               page_rows=page_rows, block_size=block_size)
    return finish_with_torch_ops(logits, lengths, positions, page_table=page_table, page_rows=page_rows,
                                 block_size=block_size, sorted=sorted, starts=starts)


def finish_with_torch_ops(logits, lengths, positions, *, page_table, page_rows, block_size, sorted, starts=None):
    """`finish` as torch ops, each a pass over [rows, k]: the CPU's and sorted=True's path, and the
    reference the one-launch finish is tested against."""
    import torch

    positions = positions.to(torch.int32)
    valid = (positions >= 0) & (positions < lengths[:, None])
    columns = positions.clamp(min=0).long()
    if starts is not None:
        columns = (columns + starts.long()[:, None]).clamp(max=max(logits.shape[1] - 1, 0))
    values = torch.gather(logits, 1, columns)
    valid &= ~torch.isnan(values)
    positions = positions.masked_fill(~valid, -1)
    if sorted:
        positions = torch.gather(positions, 1, _valid_first(values, valid))
    if page_table is None:
        return positions
    return page_slots(positions, page_table, page_rows, block_size)


def page_slots(positions: torch.Tensor, page_table: torch.Tensor, page_rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """page_table[page_rows[r], p // block_size] * block_size + p % block_size; -1 stays -1."""
    import torch

    table_rows = page_table.index_select(0, page_rows.long())
    page = (positions.clamp(min=0) // block_size).clamp(max=page_table.shape[1] - 1)  # never past the table
    pages = torch.gather(table_rows, 1, page.long())
    return torch.where(positions >= 0, pages * block_size + positions.clamp(min=0) % block_size, -1).to(torch.int32)


def _valid_first(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # Descending by value with every -1 slot after every selected one: sort by value, then stably by validity.
    import torch

    by_value = values.masked_fill(~valid, float("-inf")).argsort(dim=1, descending=True, stable=True)
    by_validity = torch.gather(valid, 1, by_value).to(torch.int8).argsort(dim=1, descending=True, stable=True)
    return torch.gather(by_value, 1, by_validity)
