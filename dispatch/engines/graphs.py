"""The per-layer indexer step under CUDA graphs. The decision is fixed when the graph is captured;
each new batch is written into the plan's static tensors in place, and a batch that would decide
differently (or no longer fits the captured shapes) is refused rather than replayed wrongly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.contract.errors import GraphMismatchError
from dispatch.engines.indexer_step import IndexerStep
from dispatch.step.paged_plan import PagedBatch, PagedPlan, build_plan


@dataclass
class StaticInputs:
    """Per-layer inputs the engine refills in place before each replay."""

    q: torch.Tensor
    weights: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_cache: torch.Tensor


class CapturedIndexerStep:
    def __init__(self, step: IndexerStep, batch: PagedBatch, inputs: StaticInputs, *, warmup: int = 2) -> None:
        """Capture step.select for this batch's shape. batch.max_seq_len is the bound every replayed
        batch must stay within (the logits width is part of the graph)."""
        if not isinstance(batch, PagedBatch):
            raise GraphMismatchError(
                f"CapturedIndexerStep captures paged batches (PagedBatch); got {type(batch).__name__}: extend "
                "(extend) batches change shape every batch and run eagerly"
            )
        self.step = step
        self.plan: PagedPlan = step.plan(batch)
        self.inputs = inputs
        step.warm()  # builds that must not run inside the capture (or the first eager call)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):  # compile and autotune outside the capture
                self._select()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = self._select()

    def _select(self) -> torch.Tensor:
        i = self.inputs
        return self.step.select(self.plan, i.q, i.weights, i.positions, i.cos_sin_cache, i.kv_cache)

    def update(self, batch: PagedBatch) -> None:
        """Write a new batch's lengths and pages into the captured plan's tensors, in place; all or
        nothing: a refused batch (GraphMismatchError, or any error of a backend's refresh) leaves the
        captured plan as it was, so the next replay answers for the previous batch, not a mix."""
        plan = self.plan
        # Shapes first: a batch past the captured bounds is a graph mismatch, whatever planning it
        # afresh would say about it.
        check_fits_capture(plan, batch)
        # Decided at the captured bound: a batch within it replays the capture's length sub-band, not the
        # one its own (shorter) max_seq_len would pick.
        fresh = build_plan(self.step.dispatcher, batch, kv_fp8_dtype=plan.fp8_dtype, arch=plan.key.arch,
                           band_seq_len=plan.max_context_len)
        refresh_captured_plan(plan, batch, fresh)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def refresh_captured_plan(captured: PagedPlan, batch: PagedBatch, fresh: PagedPlan) -> None:
    """Write `fresh` (the plan `batch` gets afresh) into a captured plan's tensors in place, so a graph
    that reads them replays the new batch. All or nothing: GraphMismatchError before anything is
    written, and a backend's refresh that raises puts the previous batch back."""
    check_replayable(captured, batch, fresh)
    width = fresh.block_table.shape[1]
    before = captured.context_lens.clone(), captured.block_table[:, :width].clone()
    try:
        _write(captured, fresh, width)
    except BaseException:
        # A backend refused while refreshing (its pool check comes before it writes anything): put the
        # old batch back and rebuild every state from it, so guard and schedule match it again.
        captured.context_lens.copy_(before[0])
        captured.block_table[:, :width].copy_(before[1])
        if captured.readable_lengths is not None:  # cut from the lengths put back (no copy kept on the way in)
            captured.readable_lengths.copy_(captured.cut_token_lengths())
        for op, state in captured.states.items():
            captured.decision(op).impl.refresh_state(state, state)
        raise


def _write(captured: PagedPlan, fresh: PagedPlan, width: int) -> None:
    # Columns past a request's pages are never read (lengths bound every read), so stale ones stay.
    captured.context_lens.copy_(fresh.context_lens)
    captured.block_table[:, :width].copy_(fresh.block_table)
    if captured.readable_lengths is not None:  # (the one launch's, at capture: kept equal to the lengths')
        captured.readable_lengths.copy_(fresh.readable_token_lengths())
    # Each backend with per-batch state rewrites its captured state in place (check_replayable has
    # refused a backend that has state but no way to refresh it).
    for op, state in captured.states.items():
        captured.decision(op).impl.refresh_state(state, fresh.state_of(op))


def check_replayable(captured: PagedPlan, batch: PagedBatch, fresh: PagedPlan) -> None:
    """Raise GraphMismatchError unless `batch` (planned afresh as `fresh`) can replay a graph captured
    with `captured`: same shapes, within the captured bounds, and the same decision for every op."""
    check_fits_capture(captured, batch)
    _check_same_decisions(captured, fresh)


def check_fits_capture(captured: PagedPlan, batch: PagedBatch) -> None:
    """Raise GraphMismatchError unless `batch` has the captured shapes and stays within its bounds."""
    if batch.seq_lens.shape[0] != captured.batch_size or batch.next_n != captured.next_n:
        raise GraphMismatchError(
            f"graph captured for B={captured.batch_size}, next_n={captured.next_n}; "
            f"batch has B={batch.seq_lens.shape[0]}, next_n={batch.next_n}"
        )
    if batch.max_seq_len > captured.max_context_len:
        raise GraphMismatchError(
            f"batch max_seq_len {batch.max_seq_len} exceeds the captured bound {captured.max_context_len}"
        )
    if batch.num_kv_blocks is not None and captured.num_kv_blocks not in (None, batch.num_kv_blocks):
        raise GraphMismatchError(
            f"the batch's pool has num_kv_blocks={batch.num_kv_blocks}; the graph's cache was checked against "
            f"{captured.num_kv_blocks}"
        )
    if batch.page_table.shape[1] > captured.block_table.shape[1]:
        raise GraphMismatchError(
            f"page table has {batch.page_table.shape[1]} columns; the graph was captured with "
            f"{captured.block_table.shape[1]}"
        )


def _check_same_decisions(captured: PagedPlan, fresh: PagedPlan) -> None:
    for op, then in captured.decisions.items():
        now = fresh.decision(op)
        if (now.backend, now.layout) != (then.backend, then.layout):
            raise GraphMismatchError(
                f"{op.value}: this batch ({fresh.key}) decides `{now.backend}` ({now.layout.value}, {now.rule}); "
                f"the graph was captured with `{then.backend}` ({then.layout.value}, {then.rule})"
            )
        if op in captured.states and then.impl.refresh_state is None:
            raise GraphMismatchError(
                f"{op.value}: backend `{then.backend}` keeps per-batch state but has no refresh_state, so a "
                "captured graph cannot follow a new batch"
            )
