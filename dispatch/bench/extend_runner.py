"""`bench` rows of the extend path: the ragged logits op per eligible backend, checked against
the reference and set against the fp8-compute floor, top-k alone over each row's key range, and the
whole extend step (gather + Q quant + logits + top-k per chunk) as IndexerStep.select runs it, with
its peak memory."""

from __future__ import annotations

import torch

from dispatch.bench.ceilings import Ceilings
from dispatch.bench.compare import compare_logits, compare_ragged_topk, compare_window_topk
from dispatch.bench.runner import REFERENCE, Row, eligible_candidates, floor_seconds_of
from dispatch.bench.timing import time_host, time_rotating
from dispatch.bench.workload import BenchRun, RaggedInputs, RaggedShape, ragged_floor_counts, ragged_inputs, ragged_topk_floor_bytes
from dispatch.contract.calling import call_backend
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.step.extend_plan import ExtendPlan, build_extend_plan
from dispatch.engines.indexer_step import IndexerStep
from dispatch.contract.key import DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.ops import gather_keys, ragged_mqa_logits, topk_rows
from dispatch.step.extend_batch import DEFAULT_LOGITS_BYTES
from dispatch.contract.rope import RopeSpec

# Rows of the whole step checked against the reference (evenly spaced): the reference scores them
# over every key, which at 16K x 64K would be slow and large.
STEP_CHECK_ROWS = 128
_WHOLE = 1 << 62  # a budget no batch reaches: one chunk (op-level rows run the kernel on the whole batch)


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
    for name in eligible_candidates(dispatcher, Op.RAGGED_MQA_LOGITS, key, wanted):
        row = Row(Op.RAGGED_MQA_LOGITS.value, name, "ragged", shape.label(), bytes=bytes_, flops=flops, floor_seconds=floor)
        rows.append(row)
        try:
            plan = _plan(dispatcher, inputs, fp8_dtype, name)
            out = ragged_mqa_logits(plan, *args)
        except Exception as error:  # a benchmark reports a backend that fails; it does not stop the others
            row.failed(error)
            continue
        row.error, row.check = compare_logits(out, reference, tolerance)
        del out
        if row.check == "ok":
            on_gpu = device != "cpu"
            row.seconds, row.extra["timing"] = time_rotating([lambda: ragged_mqa_logits(plan, *args)], on_gpu=on_gpu,
                                                             repeats=repeats, budget_s=budget_s)
            no_fill, _ = time_rotating([lambda: ragged_mqa_logits(plan, *args, clean_logits=False)], on_gpu=on_gpu,
                                       repeats=repeats, budget_s=budget_s)
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
        plan = _plan(dispatcher, inputs, fp8_dtype, name, op=Op.TOPK)
        row = Row(Op.TOPK.value, name, plan.topk.layout.value, f"{shape.label()} k={k}", bytes=bytes_, floor_seconds=floor)
        rows.append(row)
        try:
            out = topk_rows(plan, logits, lengths, k, starts=starts)
        except Exception as error:  # a benchmark reports a backend that fails; it does not stop the others
            row.failed(error)
            continue
        row.error, row.check = compare_window_topk(out, logits, starts, lengths, k)
        if row.check == "ok":
            call = [lambda plan=plan: topk_rows(plan, logits, lengths, k, starts=starts)]
            row.seconds, row.extra["timing"] = time_rotating(call, on_gpu=device != "cpu", repeats=repeats, budget_s=budget_s)
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


def _plan(dispatcher: Dispatcher, inputs: RaggedInputs, fp8_dtype: Fp8Dtype, backend: str,
          op: Op = Op.RAGGED_MQA_LOGITS) -> ExtendPlan:
    return build_extend_plan(
        dispatcher, inputs.batch, kv_fp8_dtype=fp8_dtype, logits_byte_budget=_WHOLE,
        pinned={op: backend}, allow_disabled=True,
    )


def _reference_logits(dispatcher: Dispatcher, key: DispatchKey, inputs: RaggedInputs, shape: RaggedShape):
    """(the reference's plan, the ragged op's arguments, the reference's logits [M, S]) for one batch."""
    reference_plan = _plan(dispatcher, inputs, key.fp8_dtype, REFERENCE)
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
    reference_plan = _plan(dispatcher, inputs, key.fp8_dtype, REFERENCE)
    k_all, scales = gather_keys(reference_plan, inputs.kv_cache)
    q_fp8, folded = _reference_quant(dispatcher, key, inputs, shape, rows)
    ks, ke = plan.metadata.ks[rows].contiguous(), plan.metadata.ke[rows].contiguous()
    logits = ragged_mqa_logits(reference_plan, q_fp8, k_all, scales, folded, ks, ke)
    return compare_ragged_topk(out[rows].cpu(), logits.cpu(), ks.cpu(), ke.cpu(), k, tolerance)


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


JOBS = {Op.RAGGED_MQA_LOGITS: _ragged_jobs}
