"""The whole indexer step as an engine runs it per layer: Q quant -> paged logits -> top-k through
`IndexerStep.select`, captured in one CUDA graph, for every combination of eligible logits and top-k
backends (Q quant as decided); the combinations that are SGLang's and vLLM's own stacks on this GPU
(dispatch/bench/engine_stacks.py) are marked, where their backends are eligible. Each stage is also
timed alone on the same plan in the same run, so the step reads against its own parts and against the
sum of their floors. An engine's stack whose top-k is an engine kernel gets a second row, "... (engine's
call)": the same Q quant and logits, then the kernel as its engine calls it (its backend's `engine_run`,
without dispatch's finish), so the engines' rows are not charged for dispatch's adapter. `tune` ranks
the top-k at small batches by the step with each candidate in turn (bench_step_topk): at B=8 a top-k's
launches cost more inside the step's graph than alone."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dispatch.bench.ceilings import Ceilings
from dispatch.bench.compare import compare_topk
from dispatch.bench.engine_stacks import stack_of
from dispatch.bench.launches import gpu_launches
from dispatch.bench.runner import ENGINE_CALL, REFERENCE, Row, eligible_candidates, engine_topk, floor_seconds_of
from dispatch.bench.timing import time_rotating
from dispatch.bench.workload import (
    LogitsInputs,
    LogitsShape,
    QuantShape,
    logits_floor_counts,
    logits_inputs,
    quant_floor_bytes,
    quant_inputs,
    topk_floor_bytes,
)
from dispatch.deciding.dispatcher import Dispatcher
from dispatch.engines.indexer_step import IndexerStep
from dispatch.contract.errors import DispatchError
from dispatch.contract.key import DispatchKey, Fp8Dtype, Op
from dispatch.contract.ops import indexer_q_quant, paged_mqa_logits, topk
from dispatch.step.paged_plan import PagedBatch, build_plan
from dispatch.contract.rope import RopeSpec

STEP = "indexer_step"


@dataclass(frozen=True)
class StepInputs:
    """One paged batch's inputs for the whole step, made once and shared by every combination timed."""

    paged: LogitsInputs
    activations: dict
    settings: dict  # the Q settings IndexerStep takes (rope, softmax and head scales)
    batch: PagedBatch


def step_inputs(shape: LogitsShape, fp8_dtype: Fp8Dtype, device: str) -> StepInputs:
    paged = logits_inputs(shape, fp8_dtype, device, seed=0)
    tokens = shape.batch_size * shape.next_n
    activations = quant_inputs(QuantShape(tokens, shape.heads, shape.head_dim), device, seed=1)
    settings = dict(rope=RopeSpec.neox_head(), softmax_scale=shape.head_dim**-0.5, head_scale=shape.heads**-0.5)
    batch = PagedBatch(
        seq_lens=paged.seq_lens,
        page_table=paged.page_table,
        max_seq_len=max(paged.seq_lens_host),
        forward_mode=shape.forward_mode,
        next_n=shape.next_n,
        num_kv_blocks=paged.kv_cache.shape[0],  # as an engine passes its pool: the page guard runs per batch
    )
    return StepInputs(paged, activations, settings, batch)


def _step_call(dispatcher: Dispatcher, inputs: StepInputs, fp8_dtype: Fp8Dtype, k: int, pinned: dict[Op, str]):
    """(the plan, a call of the whole step on it) with `pinned` backends, the others as decided."""
    plan = build_plan(dispatcher, inputs.batch, kv_fp8_dtype=fp8_dtype, allow_disabled=True, pinned=pinned)
    step = IndexerStep(dispatcher, fp8_dtype, index_topk=k, **inputs.settings)
    activations, paged = inputs.activations, inputs.paged

    def run_step():
        return step.select(plan, activations["q"], activations["weights"], activations["positions"],
                           activations["cos_sin_cache"], paged.kv_cache)

    return plan, run_step


def bench_step(
    dispatcher: Dispatcher,
    shape: LogitsShape,
    fp8_dtype: Fp8Dtype,
    *,
    k: int,
    device: str,
    ceilings: Ceilings | None,
    repeats: int,
    wanted: set[str] | None,
) -> list[Row]:
    """One row per (logits backend, top-k backend): the step's median time, with each stage's own time
    (`quant_us`, `logits_us`, `topk_us`), the step over the logits alone (`x_logits`) and, on a GPU, the
    device operations one step issues (`launches`) in the row."""
    key = DispatchKey(dispatcher.target_arch, shape.forward_mode, shape.next_n, fp8_dtype)
    inputs = step_inputs(shape, fp8_dtype, device)
    paged, activations, step_settings = inputs.paged, inputs.activations, inputs.settings
    tokens = shape.batch_size * shape.next_n
    logits_bytes, logits_flops = logits_floor_counts(shape, paged.seq_lens_host)
    bytes_ = quant_floor_bytes(QuantShape(tokens, shape.heads, shape.head_dim)) + logits_bytes
    bytes_ += topk_floor_bytes(paged.seq_lens_host, shape.next_n, k)
    floor = floor_seconds_of(bytes_, logits_flops, ceilings)
    combinations = itertools.product(
        _step_candidates(dispatcher, Op.PAGED_MQA_LOGITS, key, wanted), _step_candidates(dispatcher, Op.TOPK, key, wanted)
    )
    decided = _decided_pair(dispatcher, key, shape.batch_size, max(paged.seq_lens_host))
    rows = []
    for logits_backend, topk_backend in combinations:
        row = Row(STEP, f"{logits_backend} + {topk_backend}", "-", f"{shape.label()} k={k}", bytes=bytes_,
                  flops=logits_flops, floor_seconds=floor)
        stack = stack_of(key, logits_backend, topk_backend)
        if stack:  # what an engine itself runs here: the rows dispatch's decided step is read against
            row.extra["engine"] = stack
        if (logits_backend, topk_backend) == decided:
            row.extra["decided"] = f"dispatch's decision at B={shape.batch_size}"
        rows.append(row)
        try:
            plan, run_step = _step_call(dispatcher, inputs, fp8_dtype, k,
                                        {Op.PAGED_MQA_LOGITS: logits_backend, Op.TOPK: topk_backend})
            stages, scored = _stages(plan, paged, activations, step_settings, k)
        except Exception as error:  # a benchmark reports a combination that fails; it does not stop the others
            row.failed(error)
            continue
        _check_then_time_step(row, run_step, stages, scored, plan, k, device=device, repeats=repeats)
        if stack and plan.topk.impl.engine_run is not None:
            row.extra["engine"] = f"{stack}, its top-k through dispatch's adapter"
            own = Row(STEP, f"{row.backend} {ENGINE_CALL}", "-", row.shape, bytes=bytes_, flops=logits_flops,
                      floor_seconds=floor, extra={"engine": f"{stack}, its top-k as the engine calls it"})
            rows.append(own)
            _check_then_time_step(own, _engine_step(plan, paged, stages, k),
                                  {**stages, "topk": lambda: engine_topk(plan, scored, k)}, scored, plan, k,
                                  device=device, repeats=repeats)
    return rows


def bench_step_topk(
    dispatcher: Dispatcher,
    shape: LogitsShape,
    fp8_dtype: Fp8Dtype,
    *,
    k: int,
    candidates: list[str],
    stages: dict[Op, str],
    device: str,
    repeats: int,
    budget_s: float | None = None,
) -> list[Row]:
    """The whole step with each top-k candidate in turn, for tune: one row per candidate (op STEP,
    backend the top-k's name, the op's shape label), Q quant and logits pinned to `stages` for all of
    them, the same inputs, each step checked exact on the logits it scores, then timed as one captured
    graph (dispatch.bench.timing.time_rotating; eagerly where it cannot be captured)."""
    inputs = step_inputs(shape, fp8_dtype, device)
    label = f"{shape.label()} k={k}"
    scored = None
    rows = []
    for name in candidates:
        row = Row(STEP, name, "-", label, extra={"stages": {op.value: backend for op, backend in stages.items()}})
        rows.append(row)
        try:
            plan, run_step = _step_call(dispatcher, inputs, fp8_dtype, k, {**stages, Op.TOPK: name})
            if scored is None:  # the stages before the top-k are the same for every candidate
                scored = _stages(plan, inputs.paged, inputs.activations, inputs.settings, k)[1]
            row.error, row.check = compare_topk(run_step(), scored, plan.token_lengths, k)
        except Exception as error:  # one candidate that fails does not stop the others
            row.failed(error)
            continue
        if row.check == "ok":
            row.seconds, row.extra["timing"] = time_rotating([run_step], on_gpu=device != "cpu", repeats=repeats,
                                                             budget_s=budget_s, what=f"the step with {name} at {row.shape}")
    return rows


def _check_then_time_step(row: Row, run_step, stages: dict, scored, plan, k: int, *, device: str, repeats: int) -> None:
    """A step row: checked exact on the logits it scores (a failure is written on the row), then timed as
    one captured graph, each stage alone, the step over the logits alone and, on a GPU, its launches."""
    try:
        row.error, row.check = compare_topk(run_step(), scored, plan.token_lengths, k)
    except Exception as error:  # a benchmark reports a combination that fails; it does not stop the others
        row.failed(error)
        return
    if row.check != "ok":
        return
    on_gpu = device != "cpu"
    row.seconds, row.extra["timing"] = time_rotating([run_step], on_gpu=on_gpu, repeats=repeats,
                                                     what=f"the step with {row.backend} at {row.shape}")
    for name, stage in stages.items():
        row.extra[f"{name}_us"] = time_rotating([stage], on_gpu=on_gpu, repeats=repeats)[0] * 1e6
    row.extra["x_logits"] = row.seconds * 1e6 / row.extra["logits_us"]
    if on_gpu:
        row.extra["launches"] = gpu_launches(run_step)


def _engine_step(plan, paged, stages: dict, k: int):
    """The step with the plan's top-k kernel called as its engine calls it: the plan's Q quant (its stage),
    its logits, then runner.engine_topk."""

    def engine_step():
        q_fp8, folded = stages["quant"]()
        return engine_topk(plan, paged_mqa_logits(plan, q_fp8, paged.kv_cache, folded, clean_logits=False), k)

    return engine_step


def _decided_pair(dispatcher: Dispatcher, key: DispatchKey, batch_size: int, max_seq_len: int) -> tuple[str, str] | None:
    """(logits, top-k) as a plan of this batch (its size and longest request) decides them, to mark that
    row; None where one cannot be decided here (the row is then simply not marked)."""
    try:
        return tuple(dispatcher.decide(op, key, batch_size=batch_size, max_seq_len=max_seq_len).backend
                     for op in (Op.PAGED_MQA_LOGITS, Op.TOPK))
    except DispatchError:  # nothing decidable here (no eligible backend): every combination is still timed
        return None


def _step_candidates(dispatcher: Dispatcher, op: Op, key: DispatchKey, wanted: set[str] | None) -> list[str]:
    """The op's eligible backends; where none but the reference is eligible, the reference (a step
    needs every op)."""
    names = eligible_candidates(dispatcher, op, key, wanted)
    return names or [REFERENCE]


def _stages(plan, paged, activations, settings, k):
    """(each stage alone on the plan's decisions, the logits the step scores): every stage's inputs are
    made once, outside the timed calls."""

    def quant():
        return indexer_q_quant(plan, activations["q"], activations["weights"], activations["positions"],
                               activations["cos_sin_cache"], **settings)

    q_fp8, folded = quant()
    # As the step runs them: the top-k reads only visible keys, so the logits skip the -inf tail.
    logits = paged_mqa_logits(plan, q_fp8, paged.kv_cache, folded, clean_logits=False)
    stages = {
        "quant": quant,
        "logits": lambda: paged_mqa_logits(plan, q_fp8, paged.kv_cache, folded, clean_logits=False),
        "topk": lambda: topk(plan, logits, k),
    }
    return stages, logits
