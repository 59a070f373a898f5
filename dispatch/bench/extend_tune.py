"""`tune` for the extend key: every op the extend step runs (dispatch.step.paged_plan.EXTEND_STEP_OPS)
with more than one eligible backend, over the workload's extend batches (every combination of
`extend_requests`, `extend_lens` and `prefix_lens`, then the named `extend_batches`, whose requests'
prefixes differ), each backend checked against the reference first.

Each op is timed as the extend step calls it: Q quant at the batches' query-row counts M; the ragged
logits over the whole batch without the -inf fill (clean_logits=False: the step's top-k reads only each
row's [ks, ke)), after the filled output passed the check; top-k over each row's [ks, ke) of the
batch's logits, positions relative to ks.
"""

from __future__ import annotations

import dataclasses

from dispatch.bench.workload import QuantShape, RaggedShape
from dispatch.contract.key import DispatchKey, ForwardMode, Op
from dispatch.step.paged_plan import EXTEND_STEP_OPS


def measure_extend(tuner) -> None:
    """Record the extend key's preference for each op of the extend step that has a choice (`tuner` is
    dispatch.bench.tune.Tuner)."""
    key = DispatchKey(tuner.dispatcher.target_arch, ForwardMode.EXTEND, 1, tuner.fp8)
    shapes = extend_shapes(tuner.workload)
    for op in EXTEND_STEP_OPS:
        names = tuner.choosable(op, key)
        if names:
            tuner.record(op, [ForwardMode.EXTEND], 1, names, _RUNS[op](tuner, shapes, set(names)))


def extend_shapes(workload) -> list[RaggedShape]:
    """The grid's batches (every combination), then the named ones whose prefixes spread."""
    grid = [
        RaggedShape(requests, extend, prefix)
        for requests in workload.extend_requests
        for extend in workload.extend_lens
        for prefix in workload.prefix_lens
    ]
    return grid + [RaggedShape(b.requests, b.extend, prefix_up_to=b.prefix_up_to) for b in workload.extend_batches]


def _quant(tuner, shapes: list[RaggedShape], names: set[str]) -> list:
    from dispatch.bench.runner import bench_quant

    rows = []
    for tokens in sorted({shape.rows for shape in shapes}):
        measured = bench_quant(tuner.dispatcher, QuantShape(tokens), tuner.fp8, wanted=names,
                               forward_mode=ForwardMode.EXTEND, **tuner.common)
        rows += tuner.report(measured)
    return rows


def _ragged(tuner, shapes: list[RaggedShape], names: set[str]) -> list:
    from dispatch.bench.runner import bench_ragged

    rows = []
    for shape in shapes:
        measured = bench_ragged(tuner.dispatcher, shape, tuner.fp8, tolerance=tuner.tolerance, wanted=names,
                                **tuner.common)
        rows += tuner.report([_as_the_step_calls(row) for row in measured])
        tuner.free()
    return rows


def _as_the_step_calls(row):
    """The row with the time of clean_logits=False, the call the extend step makes."""
    if row.check != "ok":
        return row
    return dataclasses.replace(row, seconds=row.extra["no_fill_us"] / 1e6)


def _topk(tuner, shapes: list[RaggedShape], names: set[str]) -> list:
    from dispatch.bench.runner import bench_ragged_topk

    rows = []
    for shape in shapes:
        for k in tuner.workload.k:
            rows += tuner.report(bench_ragged_topk(tuner.dispatcher, shape, tuner.fp8, k=k, wanted=names, **tuner.common))
        tuner.free()
    return rows


_RUNS = {Op.INDEXER_Q_QUANT: _quant, Op.RAGGED_MQA_LOGITS: _ragged, Op.TOPK: _topk}
assert set(_RUNS) == set(EXTEND_STEP_OPS), "every op of the extend step needs a way to be measured"
