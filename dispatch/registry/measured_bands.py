"""Batch-size bands of a measured preference: one backend may win at small batches and another at
large ones, so `tune` may record, beside the key's order, one order per measured batch size.

A band `{batch_size_up_to: 32, order: [...]}` serves batches of more requests than the band before it
and at most 32; the last band also serves every larger batch (nothing larger was measured, and its
order is the nearest evidence). A batch's size is what the engine declares for it (a paged batch's
seq_lens.shape[0], an extend batch's request count), never inferred from a tensor's values; where it
is not known (explain without one, anything that asks per key) the key's own order serves.
"""

from __future__ import annotations

import bisect
import re
from typing import Annotated, Literal

from pydantic import Field

from dispatch.contract.limits import MAX_CLI_BATCH
from dispatch.registry.models import NameList, Strict

# A shape names its batch size as tune's runners label it: `B=8 N=1 L~8K ...` (a paged batch's
# requests) or `M=4K S=4K R=4 ...` (an extend batch's requests). Q quant's `T=64 ...` names none.
_BATCH_SIZE = re.compile(r"(?:^|\s)[BR]=(\d+)(?=\s|$)")


# What a measured order is by: the op's own times (`op`), or the whole step's with each candidate in
# turn (`step`: tune's top-k at small batches, dispatch/bench/tune.py says why).
RankedBy = Literal["op", "step"]


class Band(Strict):
    batch_size_up_to: Annotated[int, Field(ge=1, le=MAX_CLI_BATCH, strict=True)]
    order: NameList  # fastest first over the shapes of this batch size; the key's backends, reordered
    ranked_by: RankedBy = "op"  # "step": by the preference's step_shapes at this batch size


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
    if index == len(bounds) - 1 and index > 0:
        return f"B > {bounds[index - 1]}"
    if index == 0:
        return f"B <= {bounds[0]}"
    return f"{bounds[index - 1]} < B <= {bounds[index]}"
