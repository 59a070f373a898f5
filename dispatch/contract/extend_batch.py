"""An extend batch as an engine holds it (ExtendBatch), refused where built if it cannot occur.

An extend batch is B requests; request r has prefix_lens[r] keys already cached and extend_lens[r] new
tokens, whose keys the engine has written to the paged cache before the indexer runs (as SGLang and
vLLM do). The indexer gathers every request's keys into one contiguous buffer, request after request:
request r owns keys [off_r, off_r + prefix_r + extend_r) of it. Its new token j is one query row and
sees ks = off_r, ke = off_r + prefix_r + j + 1 (its prefix and its own request's tokens 0..j).
dispatch/step/extend_batch.py builds its ragged metadata (dispatch/contract/extend_plan.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from dispatch.contract.errors import LayoutError

MAX_KEYS = 2**30  # gathered keys: int32 ks / ke, and ks + a row index, never wrap (141 GB of fp8 keys)


@dataclasses.dataclass(frozen=True)
class ExtendBatch:
    """An extend batch as an engine holds it. Tensors on the batch's device; totals on the host."""

    prefix_lens: torch.Tensor  # int32 [B]: keys already cached
    extend_lens: torch.Tensor  # int32 [B]: new tokens (their keys are cached too, before the indexer)
    page_table: torch.Tensor  # int32 [B, P]: logical page -> physical block of the cache
    total_tokens: int  # M = sum(extend_lens)
    total_keys: int  # S = sum(prefix_lens + extend_lens)
    block_kv: int = 64
    host_prefix_lens: tuple[int, ...] | None = None
    host_extend_lens: tuple[int, ...] | None = None
    # Blocks in the engine's KV pool (as PagedBatch.num_kv_blocks): given, a page entry outside it
    # becomes gather slot -1 (refused by the reference gather, poisoned and flagged BAD_PAGE on the GPU).
    num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        _check_batch(self)

    @classmethod
    def from_lengths(
        cls,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        page_table: torch.Tensor,
        *,
        block_kv: int = 64,
        num_kv_blocks: int | None = None,
    ) -> ExtendBatch:
        """A batch from host lengths (one copy to the page table's device); totals computed here."""
        prefix, extend = tuple(int(n) for n in prefix_lens), tuple(int(n) for n in extend_lens)
        device = page_table.device
        return cls(
            prefix_lens=torch.tensor(prefix, dtype=torch.int32).to(device),
            extend_lens=torch.tensor(extend, dtype=torch.int32).to(device),
            page_table=page_table,
            total_tokens=sum(extend),
            total_keys=sum(prefix) + sum(extend),
            block_kv=block_kv,
            host_prefix_lens=prefix,
            host_extend_lens=extend,
            num_kv_blocks=num_kv_blocks,
        )

    @property
    def num_requests(self) -> int:
        return self.prefix_lens.shape[0]


def _check_batch(batch: ExtendBatch) -> None:
    """Shapes, dtypes, devices and (where the host has them) lengths; the error names the request."""
    prefix, extend, table = batch.prefix_lens, batch.extend_lens, batch.page_table
    for name, lens in (("prefix_lens", prefix), ("extend_lens", extend)):
        if lens.dtype != torch.int32 or lens.dim() != 1:
            raise LayoutError(f"{name} must be int32 [B]; got {lens.dtype} {list(lens.shape)}")
    requests = prefix.shape[0]
    if extend.shape[0] != requests:
        raise LayoutError(f"extend_lens has {extend.shape[0]} requests, prefix_lens {requests}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != requests:
        raise LayoutError(f"page_table must be int32 [B={requests}, P]; got {table.dtype} {list(table.shape)}")
    if len({prefix.device, extend.device, table.device}) != 1:
        raise LayoutError(f"prefix_lens, extend_lens and page_table must be on one device; got "
                          f"{prefix.device}, {extend.device}, {table.device}")
    if not (isinstance(batch.block_kv, int) and batch.block_kv > 0 and batch.block_kv & (batch.block_kv - 1) == 0):
        raise LayoutError(f"block_kv must be a power of two; got {batch.block_kv!r}")
    host_prefix, host_extend = batch.host_prefix_lens, batch.host_extend_lens
    if (host_prefix is None) != (host_extend is None):
        raise LayoutError("host_prefix_lens and host_extend_lens come together or not at all")
    if host_prefix is not None and (len(host_prefix) != requests or len(host_extend) != requests):
        raise LayoutError(f"host lengths have {len(host_prefix)} / {len(host_extend)} requests; the tensors {requests}")
    capacity = table.shape[1] * batch.block_kv
    for request, (cached, new) in enumerate(zip(host_prefix or (), host_extend or ())):
        if cached < 0 or new < 0:
            raise LayoutError(f"request {request}: prefix_len={cached}, extend_len={new}; lengths must be >= 0")
        if cached + new > capacity:
            raise LayoutError(f"request {request}: {cached} + {new} keys need more than the page table's "
                              f"{table.shape[1]} pages of {batch.block_kv}")
    for name in ("total_tokens", "total_keys"):
        value = getattr(batch, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LayoutError(f"{name} must be a host int >= 0; got {value!r}")
    if batch.total_keys > MAX_KEYS:
        raise LayoutError(f"total_keys={batch.total_keys} is past {MAX_KEYS}: a row's ks / ke and a key's index "
                          "are int32, with room for a row's offset added")
    if batch.total_keys < batch.total_tokens:
        raise LayoutError(f"total_keys={batch.total_keys} < total_tokens={batch.total_tokens}: every new token "
                          f"is a key too")
    if requests == 0 and batch.total_keys:
        raise LayoutError(f"a batch of no requests has no keys; got total_keys={batch.total_keys}")
    blocks = batch.num_kv_blocks
    # The same bound as PagedBatch's: page entries are int32, so a larger pool cannot be indexed.
    if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 <= blocks < 2**31):
        raise LayoutError(f"num_kv_blocks must be a host int >= 0 and at most {2**31 - 1} (the pool's block "
                          f"count; page entries are int32); got {blocks!r}")
    if host_prefix is not None and (sum(host_extend) != batch.total_tokens
                                    or sum(host_prefix) + sum(host_extend) != batch.total_keys):
        raise LayoutError(f"totals disagree with the lengths: total_tokens={batch.total_tokens} (lengths say "
                          f"{sum(host_extend)}), total_keys={batch.total_keys} (lengths say "
                          f"{sum(host_prefix) + sum(host_extend)})")
    if prefix.device.type == "cpu":  # reading them costs no sync: check what the device path could only flag
        _check_host_tensors(batch, prefix.tolist(), extend.tolist())


def _check_host_tensors(batch: ExtendBatch, prefix: list[int], extend: list[int]) -> None:
    """The CPU tensors' lengths: non-negative, equal to the host lengths when given, summing to the totals."""
    for request, (cached, new) in enumerate(zip(prefix, extend)):
        if cached < 0 or new < 0:
            raise LayoutError(f"request {request}: prefix_lens[{request}]={cached}, extend_lens[{request}]={new}; "
                              "lengths must be >= 0")
    if batch.host_prefix_lens is not None and (
        tuple(prefix) != tuple(batch.host_prefix_lens) or tuple(extend) != tuple(batch.host_extend_lens)
    ):
        raise LayoutError("the prefix_lens / extend_lens tensors disagree with host_prefix_lens / host_extend_lens")
    if sum(extend) != batch.total_tokens or sum(prefix) + sum(extend) != batch.total_keys:
        raise LayoutError(f"totals disagree with the length tensors: total_tokens={batch.total_tokens} (extend_lens "
                          f"sum to {sum(extend)}), total_keys={batch.total_keys} (prefix_lens + extend_lens sum to "
                          f"{sum(prefix) + sum(extend)})")
