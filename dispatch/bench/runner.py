"""Check each available backend against the reference, then time it, at each shape: every op's rows
(the paged path's and the extend path's) and the whole extend step, and the JOBS table `bench` runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dispatch.bench.ceilings import Ceilings
from dispatch.bench.compare import compare_logits, compare_q_quant, compare_ragged_topk, compare_topk, compare_window_topk
from dispatch.bench.timing import time_host, time_rotating
from dispatch.bench.workload import (
    BenchRun,
    LogitsShape,
    QuantShape,
    RaggedInputs,
    RaggedShape,
    logits_floor_counts,
    logits_inputs,
    quant_floor_bytes,
    quant_inputs,
    ragged_floor_counts,
    ragged_inputs,
    ragged_topk_floor_bytes,
    topk_floor_bytes,
)
from dispatch.contract.calling import call_backend
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.contract.key import DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.ops import gather_keys, paged_mqa_logits, ragged_mqa_logits, topk, topk_rows
from dispatch.engines.indexer_step import IndexerStep
from dispatch.step.extend_batch import DEFAULT_LOGITS_BYTES
from dispatch.step.extend_plan import ExtendPlan, build_extend_plan
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.contract.rope import RopeSpec

L2_BYTES = 60 << 20  # H200; only sizes how many input sets to rotate through
REFERENCE = "torch.reference"
# A row's check when its backend refused the call (dispatch.contract.errors.UnservedCallError).
UNSERVED = "cannot serve"
# Rows of the whole extend step checked against the reference (evenly spaced): the reference scores
# them over every key, which at 16K x 64K would be slow and large.
STEP_CHECK_ROWS = 128
_WHOLE = 1 << 62  # a budget no batch reaches: one chunk (op-level rows run the kernel on the whole batch)


# The label of an engine kernel's own call in `bench --op topk` (its engine_run, beside its backend's row).
ENGINE_CALL = "(engine's call)"


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


def check_then_time(row: Row, run, compare, *, on_gpu: bool, repeats: int, budget_s: float | None = None,
                    timed=None) -> bool:
    """One backend's row: `run()` once (a failure is written on the row, not raised: the other backends
    still run), `compare(out)` against the reference, and only if that is "ok" the timing of `timed()`
    (calls rotated over input sets; default [run]). True when the row was timed."""
    try:
        out = run()
    except Exception as error:  # a benchmark reports a backend that fails; it does not stop the others
        row.failed(error)
        return False
    row.error, row.check = compare(out)
    del out  # the output of a large shape must not stay allocated while the backend is timed
    if row.check != "ok":
        return False
    calls = timed() if timed is not None else [run]
    row.seconds, row.extra["timing"] = time_rotating(calls, on_gpu=on_gpu, repeats=repeats, budget_s=budget_s,
                                                     what=f"{row.backend} at {row.shape}")
    return True


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
    first_set = logits_inputs(shape, fp8_dtype, device, seed=0)
    data_bytes = first_set.kv_cache.numel()
    sets = [first_set] + [logits_inputs(shape, fp8_dtype, device, seed=s) for s in range(1, 3 if data_bytes < 3 * L2_BYTES else 1)]
    bytes_, flops = logits_floor_counts(shape, first_set.seq_lens_host)
    floor = floor_seconds_of(bytes_, flops, ceilings)
    reference = _run_logits(dispatcher, REFERENCE, mode, first_set, fp8_dtype)
    rows = []
    for name in eligible_candidates(dispatcher, Op.PAGED_MQA_LOGITS, key, wanted):
        layout = dispatcher.catalog.get(Op.PAGED_MQA_LOGITS, name).layout.value
        row = Row(Op.PAGED_MQA_LOGITS.value, name, layout, shape.label(), bytes=bytes_, flops=flops, floor_seconds=floor)
        rows.append(row)
        plan_of = {}

        def first(name=name):
            plan_of.update({id(inputs): _plan(dispatcher, name, mode, inputs, fp8_dtype) for inputs in sets})
            return paged_mqa_logits(plan_of[id(first_set)], first_set.q_tokens, first_set.kv_cache, first_set.weights)

        # Checked with the -inf tail, timed as IndexerStep.select calls it: without (its top-k reads
        # only visible keys), which spares DeepGEMM's backends a masking pass over the whole output.
        check_then_time(
            row, first, lambda out: compare_logits(out, reference, tolerance), on_gpu=device != "cpu",
            repeats=repeats, budget_s=budget_s,
            timed=lambda plan_of=plan_of: [
                (lambda inputs=inputs: paged_mqa_logits(
                    plan_of[id(inputs)], inputs.q_tokens, inputs.kv_cache, inputs.weights, clean_logits=False
                ))
                for inputs in sets
            ],
        )
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
        check_then_time(row, lambda decision=decision: call_backend(decision, **inputs, **settings),
                        lambda out: compare_q_quant(out, reference), on_gpu=device != "cpu", repeats=repeats,
                        budget_s=budget_s)
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
    engine_calls: bool = False,
) -> list[Row]:
    """Top-k alone, per eligible backend, on the logits the decided logits backend gives this workload,
    over the plan's per-token lengths; checked against torch.topk. With `engine_calls` (`bench`, not tune:
    these rows are no backends), each engine kernel also gets a row `NAME (engine's call)`: its
    `engine_run`, the kernel as its engine calls it, without dispatch's finish."""
    mode = shape.forward_mode
    key = DispatchKey(dispatcher.target_arch, mode, shape.next_n, fp8_dtype)
    candidates = eligible_candidates(dispatcher, Op.TOPK, key, wanted)
    if not candidates:  # a grid's worth of inputs and logits for nothing to time
        return []
    inputs = logits_inputs(shape, fp8_dtype, device, seed=0)
    logits = decided_logits(dispatcher, shape, fp8_dtype, inputs)[1]
    floor = floor_seconds_of(topk_floor_bytes(inputs.seq_lens_host, shape.next_n, k), 0.0, ceilings)
    label = f"{shape.label()} k={k}"
    rows = []
    for name in candidates:
        plan = _plan(dispatcher, name, mode, inputs, fp8_dtype, op=Op.TOPK)
        bytes_ = topk_floor_bytes(inputs.seq_lens_host, shape.next_n, k)
        row = Row(Op.TOPK.value, name, plan.topk.layout.value, label, bytes=bytes_, floor_seconds=floor)
        rows.append(row)
        check_then_time(row, lambda plan=plan: topk(plan, logits, k),
                        lambda out, plan=plan: compare_topk(out, logits, plan.token_lengths, k),
                        on_gpu=device != "cpu", repeats=repeats, budget_s=budget_s)
        if engine_calls and plan.topk.impl.engine_run is not None:
            own = Row(Op.TOPK.value, f"{name} {ENGINE_CALL}", plan.topk.layout.value, label, bytes=bytes_,
                      floor_seconds=floor)
            rows.append(own)
            check_then_time(own, lambda plan=plan: engine_topk(plan, logits, k),
                            lambda out, plan=plan: compare_topk(out, logits, plan.token_lengths, k),
                            on_gpu=device != "cpu", repeats=repeats, budget_s=budget_s)
    return rows


def decided_logits(dispatcher: Dispatcher, shape: LogitsShape, fp8_dtype: Fp8Dtype, inputs):
    """(the plan, its logits): `inputs` (bench's workload for `shape`) scored by the paged logits backend
    decided for this batch, the logits every top-k row is timed on."""
    key = DispatchKey(dispatcher.target_arch, shape.forward_mode, shape.next_n, fp8_dtype)
    backend = dispatcher.decide(Op.PAGED_MQA_LOGITS, key, batch_size=shape.batch_size,
                                max_seq_len=max(inputs.seq_lens_host)).backend
    plan = _plan(dispatcher, backend, shape.forward_mode, inputs, fp8_dtype)
    return plan, paged_mqa_logits(plan, inputs.q_tokens, inputs.kv_cache, inputs.weights)


def engine_topk(plan, logits: torch.Tensor, k: int) -> torch.Tensor:
    """The plan's top-k kernel called as its engine calls it: its backend's `engine_run` (no finish) over the
    plan's token lengths, with the plan's per-batch state passed as topk_rows passes it to `run`."""
    decision = plan.topk
    built = plan.state_of(Op.TOPK)
    state = {} if built is None else {"state": built}
    return call_backend(decision, logits, plan.token_lengths, k, entry=decision.impl.engine_run, **state)


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


def _settings(shape: RaggedShape) -> dict:
    return dict(rope=RopeSpec.neox_head(), softmax_scale=shape.head_dim**-0.5, head_scale=shape.heads**-0.5)


def _reference_quant(dispatcher: Dispatcher, key: DispatchKey, inputs: RaggedInputs, shape: RaggedShape, rows=None):
    """(q fp8, folded weights) by the torch reference, for all rows or the `rows` given."""
    pick = slice(None) if rows is None else rows
    decision = dispatcher.pin(Op.INDEXER_Q_QUANT, key, REFERENCE, allow_disabled=True)
    return call_backend(
        decision, inputs.q[pick], inputs.weights[pick], inputs.positions[pick], inputs.cos_sin_cache,
        fp8_dtype=key.fp8_dtype, **_settings(shape),
    )


def bench_ragged(
    dispatcher: Dispatcher,
    shape: RaggedShape,
    fp8_dtype: Fp8Dtype,
    *,
    device: str,
    ceilings: Ceilings | None,
    repeats: int,
    tolerance: float,
    wanted: set[str] | None,
    budget_s: float | None = None,
) -> list[Row]:
    """The ragged logits op alone, per eligible backend, on one batch's gathered keys (the full [M, S],
    -inf filled as the contract says; `no_fill_us` times clean_logits=False, what the step asks for)."""
    key = DispatchKey(dispatcher.target_arch, ForwardMode.EXTEND, 1, fp8_dtype)
    inputs = ragged_inputs(shape, fp8_dtype, device, seed=0)
    _, args, reference = _reference_logits(dispatcher, key, inputs, shape)
    bytes_, flops = ragged_floor_counts(shape)
    floor = floor_seconds_of(bytes_, flops, ceilings)
    rows = []
    on_gpu = device != "cpu"
    for name in eligible_candidates(dispatcher, Op.RAGGED_MQA_LOGITS, key, wanted):
        row = Row(Op.RAGGED_MQA_LOGITS.value, name, "ragged", shape.label(), bytes=bytes_, flops=flops, floor_seconds=floor)
        rows.append(row)
        built = {}  # the plan, built inside the checked run: a backend whose plan fails is a failed row

        def first(name=name, built=built):
            built["plan"] = _extend_plan(dispatcher, inputs, fp8_dtype, name)
            return ragged_mqa_logits(built["plan"], *args)

        if check_then_time(row, first, lambda out: compare_logits(out, reference, tolerance), on_gpu=on_gpu,
                           repeats=repeats, budget_s=budget_s,
                           timed=lambda built=built: [lambda: ragged_mqa_logits(built["plan"], *args)]):
            no_fill, _ = time_rotating([lambda built=built: ragged_mqa_logits(built["plan"], *args, clean_logits=False)],
                                       on_gpu=on_gpu, repeats=repeats, budget_s=budget_s)
            row.extra["no_fill_us"] = no_fill * 1e6
    deepgemm = next((r for r in rows if r.backend.startswith("deepgemm") and r.seconds), None)
    for row in rows:
        if deepgemm is not None and row.seconds:
            row.extra["x_deepgemm"] = row.seconds / deepgemm.seconds
    return rows


def bench_ragged_topk(
    dispatcher: Dispatcher,
    shape: RaggedShape,
    fp8_dtype: Fp8Dtype,
    *,
    k: int,
    device: str,
    ceilings: Ceilings | None,
    repeats: int,
    wanted: set[str] | None,
    budget_s: float | None = None,
) -> list[Row]:
    """Top-k alone, per backend eligible for the extend key, as the extend step calls it: each query row
    over its own key range [ks, ke) of the batch's reference logits (the whole batch as one chunk),
    positions relative to ks; every row checked exactly against torch.topk over its range."""
    key = DispatchKey(dispatcher.target_arch, ForwardMode.EXTEND, 1, fp8_dtype)
    candidates = eligible_candidates(dispatcher, Op.TOPK, key, wanted)
    if not candidates:  # a batch's reference logits for nothing to time
        return []
    inputs = ragged_inputs(shape, fp8_dtype, device, seed=0)
    reference_plan, _, logits = _reference_logits(dispatcher, key, inputs, shape)
    starts = reference_plan.metadata.ks
    lengths = (reference_plan.metadata.ke - starts).contiguous()
    bytes_ = ragged_topk_floor_bytes(shape, k)
    floor = floor_seconds_of(bytes_, 0.0, ceilings)
    rows = []
    for name in candidates:
        plan = _extend_plan(dispatcher, inputs, fp8_dtype, name, op=Op.TOPK)
        row = Row(Op.TOPK.value, name, plan.topk.layout.value, f"{shape.label()} k={k}", bytes=bytes_, floor_seconds=floor)
        rows.append(row)
        check_then_time(row, lambda plan=plan: topk_rows(plan, logits, lengths, k, starts=starts),
                        lambda out: compare_window_topk(out, logits, starts, lengths, k), on_gpu=device != "cpu",
                        repeats=repeats, budget_s=budget_s)
    return rows


def bench_extend_step(
    dispatcher: Dispatcher,
    shape: RaggedShape,
    fp8_dtype: Fp8Dtype,
    *,
    k: int,
    device: str,
    ceilings: Ceilings | None,
    repeats: int,
    tolerance: float,
    logits_byte_budget: int = DEFAULT_LOGITS_BYTES,
) -> list[Row]:
    """The whole extend step through the decided backends (IndexerStep.select on an extend plan): its
    time, its peak memory above what was allocated before it (torch.cuda.max_memory_allocated), the
    plan's host time, and STEP_CHECK_ROWS of its rows checked against torch.topk on reference logits."""
    key = DispatchKey(dispatcher.target_arch, ForwardMode.EXTEND, 1, fp8_dtype)
    inputs = ragged_inputs(shape, fp8_dtype, device, seed=1)
    step = IndexerStep(dispatcher, kv_fp8_dtype=fp8_dtype, index_topk=k, logits_byte_budget=logits_byte_budget,
                       **_settings(shape))
    _, flops = ragged_floor_counts(shape)
    row = Row("extend_step", "", "ragged", f"{shape.label()} k={k}", flops=flops, floor_seconds=floor_seconds_of(0.0, flops, ceilings))
    try:
        plan = step.plan(inputs.batch)
        row.backend = plan.ragged_logits.backend
        row.extra["step"] = f"q quant {plan.indexer_q_quant.backend}, top-k {plan.topk.backend}"
        row.extra["chunks"] = len(plan.chunks)
        row.extra["plan_us"] = time_host(lambda: step.plan(inputs.batch), repeats=5) * 1e6

        def run() -> torch.Tensor:
            return step.select(plan, inputs.q, inputs.weights, inputs.positions, inputs.cos_sin_cache, inputs.kv_cache)

        out, peak = _with_peak_memory(run, device)
    except Exception as error:  # reported, not raised: the other rows still run
        row.failed(error)
        return [row]
    row.extra["peak_MiB"] = peak / (1 << 20) if peak is not None else None
    row.error, row.check = _check_step(dispatcher, key, inputs, shape, plan, out, k, tolerance)
    if row.check == "ok":
        row.seconds, row.extra["timing"] = time_rotating([run], on_gpu=device != "cpu", repeats=repeats)
    return [row]


def _extend_plan(dispatcher: Dispatcher, inputs: RaggedInputs, fp8_dtype: Fp8Dtype, backend: str,
          op: Op = Op.RAGGED_MQA_LOGITS) -> ExtendPlan:
    return build_extend_plan(
        dispatcher, inputs.batch, kv_fp8_dtype=fp8_dtype, logits_byte_budget=_WHOLE,
        pinned={op: backend}, allow_disabled=True,
    )


def _reference_logits(dispatcher: Dispatcher, key: DispatchKey, inputs: RaggedInputs, shape: RaggedShape):
    """(the reference's plan, the ragged op's arguments, the reference's logits [M, S]) for one batch."""
    reference_plan = _extend_plan(dispatcher, inputs, key.fp8_dtype, REFERENCE)
    k, scales = gather_keys(reference_plan, inputs.kv_cache)
    q_fp8, folded = _reference_quant(dispatcher, key, inputs, shape)
    args = (q_fp8, k, scales, folded, reference_plan.metadata.ks, reference_plan.metadata.ke)
    return reference_plan, args, ragged_mqa_logits(reference_plan, *args)


def _with_peak_memory(fn, device: str):
    """(fn(), bytes allocated at its peak above what was allocated before it; None on a CPU)."""
    if device == "cpu":
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def _check_step(dispatcher, key, inputs, shape, plan, out, k, tolerance):
    rows = torch.linspace(0, shape.rows - 1, min(STEP_CHECK_ROWS, shape.rows), device=out.device).long().unique()
    reference_plan = _extend_plan(dispatcher, inputs, key.fp8_dtype, REFERENCE)
    k_all, scales = gather_keys(reference_plan, inputs.kv_cache)
    q_fp8, folded = _reference_quant(dispatcher, key, inputs, shape, rows)
    ks, ke = plan.metadata.ks[rows].contiguous(), plan.metadata.ke[rows].contiguous()
    logits = ragged_mqa_logits(reference_plan, q_fp8, k_all, scales, folded, ks, ke)
    return compare_ragged_topk(out[rows].cpu(), logits.cpu(), ks.cpu(), ke.cpu(), k, tolerance)


# --- the jobs of every op: (label, job) per shape, for `bench` (dispatch/bench/command.py) ---


def _quant_jobs(run: BenchRun):
    return [(shape.label(), lambda shape=shape: bench_quant(run.dispatcher, shape, run.fp8, **run.common))
            for shape in run.quant_shapes]


def _logits_jobs(run: BenchRun):
    return [(shape.label(), lambda shape=shape: bench_logits(run.dispatcher, shape, run.fp8, tolerance=run.tolerance,
                                                            **run.common))
            for shape in run.logits_shapes]


def _topk_jobs(run: BenchRun):
    return [(f"{shape.label()} k={k}", lambda shape=shape, k=k: bench_topk(run.dispatcher, shape, run.fp8, k=k,
                                                                          engine_calls=True, **run.common))
            for shape in run.logits_shapes for k in run.ks]


def _ragged_jobs(run: BenchRun):
    """The op per eligible backend, then the whole extend step per shape and k (gather + quant + logits
    + top-k through the decided backends, with its peak memory)."""
    return [
        (shape.label(), lambda shape=shape: bench_ragged(run.dispatcher, shape, run.fp8, tolerance=run.tolerance,
                                                         **run.common))
        for shape in run.ragged_shapes
    ] + [
        (f"{shape.label()} k={k} step", lambda shape=shape, k=k: bench_extend_step(
            run.dispatcher, shape, run.fp8, k=k, device=run.device, ceilings=run.ceilings, repeats=run.repeats,
            tolerance=run.tolerance, logits_byte_budget=run.logits_budget))
        for shape in run.ragged_shapes
        for k in run.ks
    ]


JOBS = {Op.INDEXER_Q_QUANT: _quant_jobs, Op.PAGED_MQA_LOGITS: _logits_jobs, Op.TOPK: _topk_jobs,
        Op.RAGGED_MQA_LOGITS: _ragged_jobs}
