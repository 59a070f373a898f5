"""The per-layer indexer step under CUDA graphs. The decision is fixed when the graph is captured;
each new batch is written into the plan's static tensors in place, and a batch that would decide
differently (or no longer fits the captured shapes) is refused rather than replayed wrongly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.errors import GraphMismatchError
from dispatch.indexer import IndexerStep
from dispatch.key import Op
from dispatch.plan import ForwardBatch, IndexerPlan, build_plan, layout_tensors


@dataclass
class StaticInputs:
    """Per-layer inputs the engine refills in place before each replay."""

    q: torch.Tensor
    weights: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_cache: torch.Tensor


class CapturedIndexerStep:
    def __init__(self, step: IndexerStep, batch: ForwardBatch, inputs: StaticInputs, *, warmup: int = 2) -> None:
        """Capture step.select for this batch's shape. batch.max_seq_len is the bound every replayed
        batch must stay within (the logits width is part of the graph)."""
        self.step = step
        self.plan: IndexerPlan = step.plan(batch)
        self.inputs = inputs
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

    def update(self, batch: ForwardBatch) -> None:
        """Write a new batch's lengths and pages into the captured plan's tensors, in place."""
        plan = self.plan
        if batch.seq_lens.shape[0] != plan.batch_size or batch.next_n != plan.next_n:
            raise GraphMismatchError(
                f"graph captured for B={plan.batch_size}, next_n={plan.next_n}; "
                f"batch has B={batch.seq_lens.shape[0]}, next_n={batch.next_n}"
            )
        if batch.max_seq_len > plan.max_context_len:
            raise GraphMismatchError(
                f"batch max_seq_len {batch.max_seq_len} exceeds the captured bound {plan.max_context_len}"
            )
        fresh = build_plan(self.step.dispatcher, batch, kv_fp8_dtype=plan.fp8_dtype, arch=plan.key.arch)
        for op, captured, now in ((Op.PAGED_MQA_LOGITS, plan.logits, fresh.logits), (Op.INDEXER_Q_QUANT, plan.q_quant, fresh.q_quant)):
            if (now.backend, now.layout) != (captured.backend, captured.layout):
                raise GraphMismatchError(
                    f"{op.value}: this batch ({fresh.key}) decides `{now.backend}` ({now.layout.value}, "
                    f"{now.rule}); the graph was captured with `{captured.backend}` ({captured.layout.value}, "
                    f"{captured.rule})"
                )
        lens, table = layout_tensors(plan.layout, batch.seq_lens, batch.page_table, batch.next_n)
        if table.shape[1] > plan.block_table.shape[1]:
            raise GraphMismatchError(
                f"page table has {table.shape[1]} columns; the graph was captured with {plan.block_table.shape[1]}"
            )
        # Columns past a request's pages are never read (lengths bound every read), so stale ones stay.
        plan.context_lens.copy_(lens)
        plan.block_table[:, : table.shape[1]].copy_(table)
        if isinstance(plan.state, torch.Tensor):
            plan.state.copy_(fresh.state)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output
