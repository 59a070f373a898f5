"""`tune`'s top-k at small batches, ranked by the whole step: the step's rows (dispatch.bench.step's
bench_step_topk with each candidate in turn, Q quant and logits fixed to what the overlay being written
decides), and how every row of a key was timed, for the overlay's `timing` and `timed_eagerly`."""

from __future__ import annotations

from dispatch.contract.key import DispatchKey, Op

# The top-k at batches of up to this many requests is ranked by the whole step (Q quant and logits as
# decided for the key, then each top-k candidate in turn, one captured graph, the same plan and inputs),
# not by the op alone. There a top-k is a few microseconds of work behind several launches, and what
# its launches cost depends on what runs around them: on the H200 (2026-12-01, B=8 next_n 4 L~8K) the
# Triton top-k, 13% the fastest alone, made the step 29.2 us against 23.1 with cuda.radix and 21.6 with
# SGLang's v2. At larger batches the top-k's own work dominates and the logits (hundreds of
# microseconds at B=128) would bury its differences in the step's noise, so the op alone, timed with
# less noise, ranks it. Above 32 that is reasoning, not a measurement on the H200 (docs/tune.md says how
# to measure it: `--step-up-to 128` times the step at every batch size beside the op alone).
STEP_RANKED_UP_TO = 32


def step_rows(tuner, next_n: int, passed: list[str]) -> list:
    """The whole step with each top-k candidate that passed alone, at the tuner's batch sizes up to
    its step_up_to (`tuner` is dispatch.bench.tune.Tuner)."""
    from dispatch.bench.step import bench_step_topk
    from dispatch.bench.workload import paged_shapes

    candidates = sorted(set(passed))
    # The op's own shapes (the grid's and the named ones) within the limit, so a band and its length
    # sub-bands ranked by the step have the step's time at every shape they are by.
    shapes = [shape for shape in paged_shapes(tuner.workload, next_n) if shape.batch_size <= tuner.step_up_to]
    if len(candidates) < 2 or not shapes:
        return []
    rows = []
    for shape in shapes:
        stages = stage_backends(tuner, shape)
        for k in tuner.workload.k:
            rows += tuner.report(bench_step_topk(tuner.dispatcher, shape, tuner.fp8, k=k, candidates=candidates,
                                                stages=stages, device=tuner.device, repeats=tuner.repeats,
                                                budget_s=tuner.common["budget_s"]))
        tuner.free()
    return rows


def stage_backends(tuner, shape) -> dict[Op, str]:
    """Q quant and logits for a step at `shape`: what the overlay being written will decide there,
    so the top-k is ranked beside the stages it will run with. The cluster's prefer list (or a pin)
    comes first, as the dispatcher's decision says; else this run's measured order (its band for
    the batch size); else what the dispatcher decides now."""
    from dispatch.registry.measured_bands import band_index, length_bound

    key = DispatchKey(tuner.dispatcher.target_arch, shape.forward_mode, shape.next_n, tuner.fp8)
    longest = length_bound(shape.mean_len)  # the batch's declared max_seq_len: its sub-band's bound
    stages = {}
    for op in (Op.INDEXER_Q_QUANT, Op.PAGED_MQA_LOGITS):
        decision = tuner.dispatcher.decide(op, key, batch_size=shape.batch_size, max_seq_len=longest)
        fresh = tuner.fresh.get((op, shape.next_n))
        if fresh is None or decision.source in ("cluster-prefer", "pinned"):
            stages[op] = decision.backend
            continue
        stages[op] = fresh_order(fresh, shape.batch_size, longest)[0]
    return stages


def fresh_order(preference: dict, batch_size: int, max_seq_len: int) -> list[str]:
    """The order a preference tune has just written (as a dict) gives a batch of that size and declared
    max_seq_len: its length sub-band's, else its band's, else the key's (what the dispatcher will decide)."""
    from dispatch.registry.measured_bands import band_index

    bands = preference.get("bands", [])
    if not bands:
        return preference["order"]
    band = bands[band_index(tuple(b["batch_size_up_to"] for b in bands), batch_size)]
    lengths = band.get("lengths", [])
    if not lengths:
        return band["order"]
    return lengths[band_index(tuple(sub["max_seq_len_up_to"] for sub in lengths), max_seq_len)]["order"]


def stages_of(rows: list, shape: str) -> dict[str, str]:
    """The step's other ops' backends at `shape`, as its rows recorded them."""
    from dispatch.bench.step import STEP

    return next((dict(row.extra["stages"]) for row in rows
                 if getattr(row, "op", None) == STEP and row.shape == shape and "stages" in row.extra), {})


def timing_of(rows: list, names: set[str]) -> dict:
    """{"timing": ...} as the rows were timed: "graph" where any was replayed from a CUDA graph, with
    `timed_eagerly` naming each backend of `names` timed eagerly somewhere and where; "eager" where
    none was (a CPU); {} where the rows do not say."""
    from dispatch.bench.step import STEP
    from dispatch.bench.timing import EAGER, GRAPH

    methods = [(row, getattr(row, "extra", {}).get("timing")) for row in rows if row.backend in names]
    said = {method for _, method in methods if method}
    if not said:
        return {}
    if GRAPH not in said:
        return {"timing": EAGER}
    eager: dict[str, str] = {}
    for row, method in methods:
        if method == EAGER:
            eager.setdefault(row.backend, f"at {row.shape}" + (" in the step" if getattr(row, "op", None) == STEP else ""))
    return {"timing": GRAPH, **({"timed_eagerly": eager} if eager else {})}
