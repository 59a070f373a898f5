"""Batch-size bands of a measured preference: one backend may win at small batches and another at
large ones, so `tune` may record, beside the key's order, one order per measured batch size.

A band `{batch_size_up_to: 32, order: [...]}` serves batches of more requests than the band before it
and at most 32; the last band also serves every larger batch (nothing larger was measured, and its
order is the nearest evidence). A batch's size is what the engine declares for it (a paged batch's
seq_lens.shape[0], an extend batch's request count), never inferred from a tensor's values; where it
is not known (explain without one, anything that asks per key) the key's own order serves.

Inside a band, where the fastest backend differs between the measured lengths (a top-k that holds a row
of up to ~12K keys in registers leads at L~8K and trails at L~32K), the band may carry length sub-bands
(`lengths`): one per measured mean length L at that batch size, each bounded by `max_seq_len_up_to` =
3L/2, the longest request a shape of mean L holds (its lengths are uniform in [L/2, 3L/2]). A sub-band
serves batches whose declared `max_seq_len` (the host-side bound on the longest request, which a plan
knows without reading a tensor) is above the sub-band before it and at most its bound; the last serves
every longer batch too. The bound is the measured shape's longest possible request, so every batch of
the measured distribution lands in its own sub-band; a batch between two measured lengths goes to the
nearest longer one. Where the length is not declared, the band's own order serves.
"""

from __future__ import annotations

import bisect
import re
from typing import Annotated, Literal

from pydantic import Field

from dispatch.contract.limits import MAX_CLI_BATCH, MAX_CLI_SEQ_LEN
from dispatch.registry.models import NameList, Strict

# A shape names its batch size as tune's runners label it: `B=8 N=1 L~8K ...` (a paged batch's
# requests) or `M=4K S=4K R=4 ...` (an extend batch's requests). Q quant's `T=64 ...` names none.
_BATCH_SIZE = re.compile(r"(?:^|\s)[BR]=(\d+)(?=\s|$)")
# A paged shape names its mean length: `L~8K` (8192) or `L~3000` (dispatch.bench.workload.LogitsShape.label).
_MEAN_LEN = re.compile(r"(?:^|\s)L~(\d+)(K?)(?=\s|$)")


def mean_len_of(shape: str) -> int | None:
    """The mean length a measured paged shape's label names (`L~8K` is 8192), or None when it names none."""
    found = _MEAN_LEN.search(shape)
    return None if not found else int(found.group(1)) * (1024 if found.group(2) else 1)


def length_bound(mean_len: int) -> int:
    """The `max_seq_len_up_to` of a sub-band measured at mean length L: 3L/2, the longest request a
    batch of that shape holds (dispatch.bench.workload.ragged_lengths draws from [L/2, 3L/2))."""
    return 3 * mean_len // 2


# What a measured order is by: the op's own times (`op`), or the whole step's with each candidate in
# turn (`step`: tune's top-k at small batches, dispatch/bench/tune.py says why).
RankedBy = Literal["op", "step"]


class LengthBand(Strict):
    """Inside a batch-size band: the order for batches whose declared max_seq_len is at most
    `max_seq_len_up_to` (3L/2 of the measured mean length L it is by) and above the sub-band before it."""

    max_seq_len_up_to: Annotated[int, Field(ge=1, le=length_bound(MAX_CLI_SEQ_LEN), strict=True)]
    order: NameList  # fastest first over this batch size's shapes of that mean length
    ranked_by: RankedBy = "op"  # "step": by the step's times at those shapes (as its band)


class Band(Strict):
    batch_size_up_to: Annotated[int, Field(ge=1, le=MAX_CLI_BATCH, strict=True)]
    order: NameList  # fastest first over the shapes of this batch size; the key's backends, reordered
    ranked_by: RankedBy = "op"  # "step": by the preference's step_shapes at this batch size
    # Where the fastest differs between this batch size's measured lengths: one per length, ascending
    # (checked with the file's lines in dispatch.registry.measured._band_problems).
    lengths: Annotated[tuple[LengthBand, ...], Field(max_length=16)] = ()

    @property
    def length_bounds(self) -> tuple[int, ...]:
        return tuple(sub.max_seq_len_up_to for sub in self.lengths)


def batch_size_of(shape: str) -> int | None:
    """The batch size a measured shape's label names, or None when it names none."""
    found = _BATCH_SIZE.search(shape)
    return int(found.group(1)) if found else None


def band_index(bounds: tuple[int, ...], batch_size: int) -> int:
    """Which band (by its ascending `batch_size_up_to` bounds) serves a batch of `batch_size` requests:
    the first whose bound holds it, else the last."""
    return min(bisect.bisect_left(bounds, batch_size), len(bounds) - 1)


def band_label(bounds: tuple[int, ...], index: int) -> str:
    """The batch sizes band `index` serves, as explain and a decision name them: "B <= 8",
    "8 < B <= 32", and for the last band "B > 32" (it serves every larger batch too)."""
    return _served(bounds, index, "B", str)


def length_label(bounds: tuple[int, ...], index: int) -> str:
    """The batches length sub-band `index` serves, by their declared max_seq_len: "rows <= 12K",
    "12K < rows <= 48K", and for the last "rows > 12K" (it serves every longer batch too)."""
    return _served(bounds, index, "rows", _short)


def _served(bounds: tuple[int, ...], index: int, name: str, show) -> str:
    """What interval `index` of ascending upper `bounds` serves: up to the first, between two, and past
    the one before the last (the last serves everything beyond too)."""
    if index == len(bounds) - 1 and index > 0:
        return f"{name} > {show(bounds[index - 1])}"
    if index == 0:
        return f"{name} <= {show(bounds[0])}"
    return f"{show(bounds[index - 1])} < {name} <= {show(bounds[index])}"


def _short(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
