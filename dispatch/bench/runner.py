"""Check each available backend against the reference, then time it, at each shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dispatch.bench.ceilings import Ceilings
from dispatch.bench.compare import compare_logits, compare_q_quant, compare_topk
from dispatch.bench.timing import time_host, time_rotating
from dispatch.bench.workload import (
    BenchRun,
    LogitsShape,
    QuantShape,
    logits_floor_counts,
    logits_inputs,
    quant_floor_bytes,
    quant_inputs,
    topk_floor_bytes,
)
from dispatch.contract.calling import call_backend
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.key import DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.ops import paged_mqa_logits, topk
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.contract.rope import RopeSpec

L2_BYTES = 60 << 20  # H200; only sizes how many input sets to rotate through
REFERENCE = "torch.reference"
# A row's check when its backend refused the call (dispatch.contract.errors.UnservedCallError).
UNSERVED = "cannot serve"


@dataclass
class Row:
    op: str
    backend: str
    layout: str
    shape: str
    seconds: float | None = None
    bytes: float = 0.0
    flops: float = 0.0
    floor_seconds: float | None = None
    error: float | None = None
    check: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def failed(self, error: Exception) -> None:
        """Record a backend that raised: a benchmark reports it and goes on with the others. A kernel
        that refuses the call (UnservedCallError: its k, rows or starts) is not wrong, only unable."""
        from dispatch.contract.errors import UnservedCallError

        prefix = UNSERVED if isinstance(error, UnservedCallError) else "failed"
        self.check = f"{prefix}: {type(error).__name__}: {error}"

    def as_dict(self) -> dict[str, Any]:
        timed = self.seconds is not None
        return {
            "op": self.op,
            "backend": self.backend,
            "layout": self.layout,
            "shape": self.shape,
            "median_us": self.seconds * 1e6 if timed else None,
            "GBps": self.bytes / self.seconds / 1e9 if timed else None,
            "TFLOPs": self.flops / self.seconds / 1e12 if timed and self.flops else None,
            "floor_us": self.floor_seconds * 1e6 if self.floor_seconds else None,
            "x_floor": self.seconds / self.floor_seconds if timed and self.floor_seconds else None,
            "rel_error": self.error,
            "check": self.check,
            **self.extra,
        }


def floor_seconds_of(bytes_: float, flops: float, ceilings: Ceilings | None) -> float | None:
    if ceilings is None:
        return None
    return max(bytes_ / ceilings.copy_bytes_per_s, flops / ceilings.fp8_flops_per_s)


def eligible_candidates(dispatcher: Dispatcher, op: Op, key: DispatchKey, wanted: set[str] | None) -> list[str]:
    """The backends the dispatcher finds eligible for `key` (disabled ones included: a benchmark
    compares every path that can run), less the reference unless asked for by name."""
    names = []
    for backend in dispatcher.eligible(op, key, respect_disabled=False):
        # The reference is the yardstick, not a contender: timed only when asked for by name.
        if (wanted and backend.name not in wanted) or (not wanted and backend.name.startswith(REFERENCE)):
            continue
        names.append(backend.name)
    return names


def bench_logits(
    dispatcher: Dispatcher,
    shape: LogitsShape,
    fp8_dtype: Fp8Dtype,
    *,
    device: str,
    ceilings: Ceilings | None,
    repeats: int,
    tolerance: float,
    wanted: set[str] | None,
    budget_s: float | None = None,
) -> list[Row]:
    """Paged logits per eligible backend: checked against the reference with the -inf tail, timed
    without it (clean_logits=False), as the indexer step runs them."""
    mode = shape.forward_mode
    key = DispatchKey(dispatcher.target_arch, mode, shape.next_n, fp8_dtype)
    first = logits_inputs(shape, fp8_dtype, device, seed=0)
    data_bytes = first.kv_cache.numel()
    sets = [first] + [logits_inputs(shape, fp8_dtype, device, seed=s) for s in range(1, 3 if data_bytes < 3 * L2_BYTES else 1)]
    bytes_, flops = logits_floor_counts(shape, first.seq_lens_host)
    floor = floor_seconds_of(bytes_, flops, ceilings)
    reference = _run_logits(dispatcher, REFERENCE, mode, first, fp8_dtype)
    rows = []
    for name in eligible_candidates(dispatcher, Op.PAGED_MQA_LOGITS, key, wanted):
        layout = dispatcher.catalog.get(Op.PAGED_MQA_LOGITS, name).layout.value
        row = Row(Op.PAGED_MQA_LOGITS.value, name, layout, shape.label(), bytes=bytes_, flops=flops, floor_seconds=floor)
        rows.append(row)
        try:
            plan_of = {id(inputs): _plan(dispatcher, name, mode, inputs, fp8_dtype) for inputs in sets}
            out = paged_mqa_logits(plan_of[id(first)], first.q_tokens, first.kv_cache, first.weights)
        except Exception as error:  # a benchmark reports a backend that fails; it does not stop the others
            row.failed(error)
            continue
        row.error, row.check = compare_logits(out, reference, tolerance)
        if row.check == "ok":
            # Checked with the -inf tail, timed as IndexerStep.select calls it: without (its top-k reads
            # only visible keys), which spares DeepGEMM's backends a masking pass over the whole output.
            calls = [
                (lambda inputs=inputs: paged_mqa_logits(
                    plan_of[id(inputs)], inputs.q_tokens, inputs.kv_cache, inputs.weights, clean_logits=False
                ))
                for inputs in sets
            ]
            row.seconds, row.extra["timing"] = time_rotating(calls, on_gpu=device != "cpu", repeats=repeats, budget_s=budget_s)
    return rows


def _plan(dispatcher: Dispatcher, backend: str, mode: ForwardMode, inputs, fp8_dtype: Fp8Dtype, op: Op = Op.PAGED_MQA_LOGITS):
    batch = PagedBatch(
        seq_lens=inputs.seq_lens,
        page_table=inputs.page_table,
        max_seq_len=max(inputs.seq_lens_host),
        forward_mode=mode,
        next_n=inputs.q_tokens.shape[0] // inputs.seq_lens.shape[0],
        num_kv_blocks=inputs.kv_cache.shape[0],  # as an engine passes its pool: the page guard runs here, per batch
    )
    return build_plan(
        dispatcher, batch, kv_fp8_dtype=fp8_dtype, pinned={op: backend}, allow_disabled=True
    )


def _run_logits(dispatcher, backend, mode, inputs, fp8_dtype):
    plan = _plan(dispatcher, backend, mode, inputs, fp8_dtype)
    return paged_mqa_logits(plan, inputs.q_tokens, inputs.kv_cache, inputs.weights)


def bench_quant(
    dispatcher: Dispatcher,
    shape: QuantShape,
    fp8_dtype: Fp8Dtype,
    *,
    device: str,
    ceilings: Ceilings | None,
    repeats: int,
    wanted: set[str] | None,
    budget_s: float | None = None,
    forward_mode: ForwardMode = ForwardMode.DECODE,
) -> list[Row]:
    """Q quant alone, per backend eligible for `forward_mode`'s key, checked bit-exact against the reference."""
    key = DispatchKey(dispatcher.target_arch, forward_mode, 1, fp8_dtype)
    inputs = quant_inputs(shape, device, seed=0)
    bytes_ = quant_floor_bytes(shape)
    floor = floor_seconds_of(bytes_, 0.0, ceilings)
    settings = dict(fp8_dtype=fp8_dtype, rope=RopeSpec.neox_head(), softmax_scale=shape.head_dim**-0.5, head_scale=shape.heads**-0.5)
    reference = call_backend(dispatcher.pin(Op.INDEXER_Q_QUANT, key, REFERENCE, allow_disabled=True), **inputs, **settings)
    rows = []
    for name in eligible_candidates(dispatcher, Op.INDEXER_Q_QUANT, key, wanted):
        decision = dispatcher.pin(Op.INDEXER_Q_QUANT, key, name, allow_disabled=True)
        row = Row(Op.INDEXER_Q_QUANT.value, name, decision.layout.value, shape.label(), bytes=bytes_, floor_seconds=floor)
        rows.append(row)
        try:
            out = call_backend(decision, **inputs, **settings)
        except Exception as error:  # a benchmark reports a backend that fails; it does not stop the others
            row.failed(error)
            continue
        row.error, row.check = compare_q_quant(out, reference)
        if row.check == "ok":
            call = [lambda: call_backend(decision, **inputs, **settings)]
            row.seconds, row.extra["timing"] = time_rotating(call, on_gpu=device != "cpu", repeats=repeats, budget_s=budget_s)
    return rows


def bench_topk(
    dispatcher: Dispatcher,
    shape: LogitsShape,
    fp8_dtype: Fp8Dtype,
    *,
    k: int,
    device: str,
    ceilings: Ceilings | None,
    repeats: int,
    wanted: set[str] | None,
    budget_s: float | None = None,
) -> list[Row]:
    """Top-k alone, per eligible backend, on the logits the decided logits backend gives this workload,
    over the plan's per-token lengths; checked against torch.topk."""
    mode = shape.forward_mode
    key = DispatchKey(dispatcher.target_arch, mode, shape.next_n, fp8_dtype)
    candidates = eligible_candidates(dispatcher, Op.TOPK, key, wanted)
    if not candidates:  # a grid's worth of inputs and logits for nothing to time
        return []
    inputs = logits_inputs(shape, fp8_dtype, device, seed=0)
    decided = _plan(dispatcher, dispatcher.decide(Op.PAGED_MQA_LOGITS, key).backend, mode, inputs, fp8_dtype)
    logits = paged_mqa_logits(decided, inputs.q_tokens, inputs.kv_cache, inputs.weights)
    floor = floor_seconds_of(topk_floor_bytes(inputs.seq_lens_host, shape.next_n, k), 0.0, ceilings)
    label = f"{shape.label()} k={k}"
    rows = []
    for name in candidates:
        plan = _plan(dispatcher, name, mode, inputs, fp8_dtype, op=Op.TOPK)
        bytes_ = topk_floor_bytes(inputs.seq_lens_host, shape.next_n, k)
        row = Row(Op.TOPK.value, name, plan.topk.layout.value, label, bytes=bytes_, floor_seconds=floor)
        rows.append(row)
        try:
            out = topk(plan, logits, k)
        except Exception as error:  # a benchmark reports a backend that fails; it does not stop the others
            row.failed(error)
            continue
        row.error, row.check = compare_topk(out, logits, plan.token_lengths, k)
        if row.check == "ok":
            call = [lambda plan=plan: topk(plan, logits, k)]
            row.seconds, row.extra["timing"] = time_rotating(call, on_gpu=device != "cpu", repeats=repeats, budget_s=budget_s)
    return rows


def dispatch_overhead(dispatcher: Dispatcher, *, device: str, batch_size: int = 128, next_n: int = 4) -> dict[str, float]:
    """Host cost of a cached decide, and of building a B=128 plan, in microseconds."""
    from dispatch.contract.detect import platform_fp8_dtype

    fp8 = platform_fp8_dtype(dispatcher.target_arch)
    key = DispatchKey(dispatcher.target_arch, ForwardMode.TARGET_VERIFY, next_n, fp8)
    dispatcher.decide(Op.PAGED_MQA_LOGITS, key)
    loops = 10000
    decide_s = time_host(lambda: [dispatcher.decide(Op.PAGED_MQA_LOGITS, key) for _ in range(loops)], repeats=5) / loops
    batch = PagedBatch(
        seq_lens=torch.full((batch_size,), 4096, dtype=torch.int32, device=device),
        page_table=torch.zeros(batch_size, 64, dtype=torch.int32, device=device),
        max_seq_len=4096,
        forward_mode=ForwardMode.TARGET_VERIFY,
        next_n=next_n,
    )
    plan_s = time_host(lambda: build_plan(dispatcher, batch, kv_fp8_dtype=fp8), repeats=200, warmup=20)
    return {"decide_cached_us": decide_s * 1e6, "build_plan_B128_us": plan_s * 1e6}


# --- the jobs of this module's ops: (label, job) per shape, for `bench` (dispatch/bench/command.py) ---


def _quant_jobs(run: BenchRun):
    return [(shape.label(), lambda shape=shape: bench_quant(run.dispatcher, shape, run.fp8, **run.common))
            for shape in run.quant_shapes]


def _logits_jobs(run: BenchRun):
    return [(shape.label(), lambda shape=shape: bench_logits(run.dispatcher, shape, run.fp8, tolerance=run.tolerance,
                                                            **run.common))
            for shape in run.logits_shapes]


def _topk_jobs(run: BenchRun):
    return [(f"{shape.label()} k={k}", lambda shape=shape, k=k: bench_topk(run.dispatcher, shape, run.fp8, k=k, **run.common))
            for shape in run.logits_shapes for k in run.ks]


JOBS = {Op.INDEXER_Q_QUANT: _quant_jobs, Op.PAGED_MQA_LOGITS: _logits_jobs, Op.TOPK: _topk_jobs}
