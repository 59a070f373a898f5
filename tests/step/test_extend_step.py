"""The extend step through IndexerStep: plan(ExtendBatch) then select, against a torch
reference of the whole step written from the formula (Q quant, every request's keys read through its
page table, the weighted relu scores, torch.topk), over ragged batches; chunking equivalence; the
byte budget's error; no host-device sync on a GPU."""

from __future__ import annotations

import pytest
import torch

from backends.reference.q_quant import reference_indexer_q_quant
from dispatch import load_dispatcher
from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.step.extend_plan import ExtendPlan, build_extend_plan
from dispatch.engines.indexer_step import IndexerStep
from dispatch.contract.key import Fp8Dtype, Op
from dispatch.contract.kv_cache import split_kv_cache
from dispatch.contract.ops import gather_keys, ragged_mqa_logits
from dispatch.step.paged_plan import EXTEND_STEP_OPS, ops_for
from dispatch.step.extend_batch import ExtendBatch
from dispatch.contract.rope import RopeSpec
from tests.support.numerics import logits_tolerance
from tests.support.extend_batch import extend_case

H, D, ROT = 16, 64, 32
# The Triton paths run compiled on a GPU, interpreted on the CPU; the reference of the whole step runs
# on the CPU either way.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = dict(rope=RopeSpec.neox_head(), softmax_scale=D**-0.5, head_scale=H**-0.5)
# Tight for the interpreter and the reference (fp32 sums in another order); the GPU's fp8 dot: 1e-3
# (tests/support/numerics.py says why).
TOLERANCE = logits_tolerance(DEVICE)

# (prefix_lens, extend_lens): prefix 0, prefix > 0, one-token extends, very different lengths.
BATCHES = [
    ([0], [37]),
    ([0, 0, 0], [5, 64, 130]),
    ([70, 0, 5], [6, 40, 1]),
    ([200, 3, 0, 1], [1, 1, 1, 1]),
    ([0, 300, 1], [1, 2, 150]),
]
# Every ragged and top-k path this machine can run: the reference everywhere, the Triton kernels
# (under the interpreter on a CPU), fnuz native where the hardware has it, emulated elsewhere.
PATHS = [
    ("torch.reference", Fp8Dtype.E4M3FN),
    ("triton", Fp8Dtype.E4M3FN),
    ("torch.reference", Fp8Dtype.E4M3FNUZ),
    ("rocm.fnuz", Fp8Dtype.E4M3FNUZ),
]


def step_for(dispatcher, fp8: Fp8Dtype, *, k: int = 48, budget: int | None = None, slots: bool = False) -> IndexerStep:
    extra = {} if budget is None else {"logits_byte_budget": budget}
    return IndexerStep(dispatcher, kv_fp8_dtype=fp8, index_topk=k, transform_to_slots=slots, **SETTINGS, **extra)


def layer_inputs(case, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = case.batch.total_tokens
    positions = [p + j for p, e in zip(case.batch.host_prefix_lens, case.batch.host_extend_lens) for j in range(e)]
    inputs = dict(
        q=(torch.randn(rows, H, D, generator=gen) * 4).to(torch.bfloat16),
        weights=torch.randn(rows, H, generator=gen),
        positions=torch.tensor(positions, dtype=torch.long),
        cos_sin_cache=torch.randn(1024, ROT, generator=gen).to(torch.bfloat16),
    )
    return {name: value.to(case.kv_cache.device) for name, value in inputs.items()}


def reference_step(case, inputs, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per query row: (its logits over every key of its request it sees, torch.topk's values of them).

    Written from the formula: Q quantised by the op's reference; request r's key p read from the paged
    cache at page_table[r, p // 64] * 64 + p % 64; logit = sum_h w[h] * relu(q[h] . k) * scale; new
    token j of a request with prefix P sees its keys 0 .. P + j. Runs on the CPU."""
    inputs = {name: value.cpu() for name, value in inputs.items()}
    q_fp8, folded = reference_indexer_q_quant(**inputs, fp8_dtype=case.fp8_dtype, **SETTINGS)
    values, scales = split_kv_cache(case.kv_cache.cpu(), case.fp8_dtype)
    table = case.batch.page_table.cpu()
    out, row = [], 0
    for request, (prefix, extend) in enumerate(zip(case.batch.host_prefix_lens, case.batch.host_extend_lens)):
        for j in range(extend):
            seen = torch.arange(prefix + j + 1)
            blocks = table[request, seen // 64].long()
            keys = values[blocks, seen % 64].float()
            scores = (q_fp8[row].float() @ keys.T).relu()  # [H, seen]
            logits = (scores * folded[row][:, None]).sum(0) * scales[blocks, seen % 64]
            out.append((logits, torch.topk(logits, min(k, len(seen))).values))
            row += 1
    return out


def assert_selects_the_reference_top_k(indices: torch.Tensor, reference, k: int) -> None:
    """Each row: exactly min(k, visible) distinct visible positions then -1s, whose reference logits
    are, as a sorted list, torch.topk's (one relative error over the batch, near-ties allowed)."""
    indices = indices.cpu()
    assert indices.dtype == torch.int32 and indices.shape == (len(reference), k)
    picked_all, wanted_all = [], []
    for row, (logits, wanted) in enumerate(reference):
        chosen = indices[row]
        count = len(wanted)
        assert (chosen[count:] == -1).all(), f"row {row}: {chosen.tolist()}"
        chosen = chosen[:count].long()
        assert (chosen >= 0).all() and (chosen < len(logits)).all(), f"row {row}: {chosen.tolist()}"
        assert chosen.unique().numel() == count, f"row {row}: repeated positions"
        picked_all.append(logits[chosen].sort(descending=True).values)
        wanted_all.append(wanted)
    picked, wanted = torch.cat(picked_all), torch.cat(wanted_all)
    error = float((picked - wanted).norm() / wanted.norm().clamp(min=1e-30))
    assert error <= TOLERANCE, f"relative error {error:.2e} > {TOLERANCE:.0e}"


def pinned_plan(dispatcher, case, backend: str, *, budget: int | None = None) -> ExtendPlan:
    extra = {} if budget is None else {"logits_byte_budget": budget}
    return build_extend_plan(
        dispatcher, case.batch, kv_fp8_dtype=case.fp8_dtype, pinned={Op.RAGGED_MQA_LOGITS: backend}, **extra
    )


@pytest.mark.parametrize("backend, fp8", PATHS, ids=lambda v: getattr(v, "value", v))
@pytest.mark.parametrize("lengths", BATCHES, ids=lambda b: f"{b[0]}+{b[1]}")
def test_extend_step_matches_the_formula(backend, fp8, lengths):
    dispatcher = load_dispatcher(arch="cpu")
    case = extend_case(*lengths, heads=H, head_dim=D, fp8_dtype=fp8, seed=len(lengths[0]), device=DEVICE)
    step = step_for(dispatcher, fp8)
    plan = pinned_plan(dispatcher, case, backend)
    assert tuple(plan.decisions) == EXTEND_STEP_OPS and plan.ragged_logits.backend == backend
    inputs = layer_inputs(case, seed=1)
    indices = step.select(plan, **inputs, kv_cache=case.kv_cache)
    assert_selects_the_reference_top_k(indices, reference_step(case, inputs, 48), 48)


def test_the_step_runs_every_layer_from_one_plan_with_its_own_cache():
    """The gather runs per layer: a second layer's cache gives that layer's selection."""
    dispatcher = load_dispatcher(arch="cpu")
    first = extend_case([30, 0], [10, 50], heads=H, head_dim=D, seed=5, device=DEVICE)
    second = extend_case([30, 0], [10, 50], heads=H, head_dim=D, seed=6, device=DEVICE)  # same lengths, other keys
    step = step_for(dispatcher, Fp8Dtype.E4M3FN, k=16)
    plan = step.plan(first.batch)
    inputs = layer_inputs(first, seed=2)
    # The two cases place their pages differently; the second layer's cache is read through the plan's
    # table, so lay its keys out the way the first case's table says.
    values2, scales2 = split_kv_cache(second.kv_cache, second.fp8_dtype)
    layer2 = first.kv_cache.clone()
    values, scales = split_kv_cache(layer2, first.fp8_dtype)
    for request in range(2):
        pages = -(-(first.batch.host_prefix_lens[request] + first.batch.host_extend_lens[request]) // 64)
        for page in range(pages):
            source, target = int(second.batch.page_table[request, page]), int(first.batch.page_table[request, page])
            values[target], scales[target] = values2[source], scales2[source]
    for cache, case in ((first.kv_cache, first), (layer2, second)):
        indices = step.select(plan, **inputs, kv_cache=cache)
        assert_selects_the_reference_top_k(indices, reference_step(case, inputs, 16), 16)


@pytest.mark.parametrize("backend", ["torch.reference", "triton"])
def test_a_tiny_budget_and_a_huge_one_select_the_same(backend):
    dispatcher = load_dispatcher(arch="cpu")
    case = extend_case([90, 0, 7], [20, 70, 3], heads=H, head_dim=D, seed=7, device=DEVICE)
    step = step_for(dispatcher, Fp8Dtype.E4M3FN, k=24)
    inputs = layer_inputs(case, seed=3)
    huge = pinned_plan(dispatcher, case, backend, budget=1 << 40)
    tiny = pinned_plan(dispatcher, case, backend, budget=4 * 110)  # the longest row (110 keys) alone
    assert len(huge.chunks) == 1 and len(tiny.chunks) > case.batch.total_tokens // 2
    assert tiny.peak_logits_bytes <= 4 * 110
    whole = step.select(huge, **inputs, kv_cache=case.kv_cache)
    chunked = step.select(tiny, **inputs, kv_cache=case.kv_cache)
    # Each chunk's logits are sums over its own key range, so the two may differ in the last bits and
    # pick other positions among near-ties: both are held to the formula's top-k, tie-aware.
    reference = reference_step(case, inputs, 24)
    assert_selects_the_reference_top_k(whole, reference, 24)
    assert_selects_the_reference_top_k(chunked, reference, 24)


def test_chunks_without_host_lengths_span_every_key_and_agree():
    dispatcher = load_dispatcher(arch="cpu")
    case = extend_case([40, 0], [9, 30], heads=H, head_dim=D, seed=8, device=DEVICE)
    batch = case.batch
    untight = ExtendBatch(batch.prefix_lens, batch.extend_lens, batch.page_table, batch.total_tokens, batch.total_keys)
    step = step_for(dispatcher, Fp8Dtype.E4M3FN, k=20, budget=4 * 79 * 10)  # 10 rows of all 79 keys
    plan = step.plan(untight)
    assert [c.chunk.key_end - c.chunk.key_begin for c in plan.chunks] == [79] * 4
    inputs = layer_inputs(case, seed=4)
    assert_selects_the_reference_top_k(step.select(plan, **inputs, kv_cache=case.kv_cache),
                                       reference_step(case, inputs, 20), 20)


def test_a_batch_whose_one_row_passes_the_budget_is_refused_at_plan_time():
    dispatcher = load_dispatcher(arch="cpu")
    case = extend_case([100, 0], [3, 8], heads=H, head_dim=D, seed=9, device=DEVICE)
    step = step_for(dispatcher, Fp8Dtype.E4M3FN, budget=4 * 102)  # row 2 of request 0 sees 103 keys
    with pytest.raises(LayoutError, match=r"query row 2 sees 103 keys.*412 bytes, more than the budget of 408"):
        step.plan(case.batch)


@pytest.mark.parametrize("backend", ["torch.reference", "triton"])
def test_transform_to_slots_gives_each_position_its_physical_slot(backend):
    dispatcher = load_dispatcher(arch="cpu")
    case = extend_case([70, 0, 5], [6, 40, 1], heads=H, head_dim=D, seed=10, device=DEVICE)
    inputs = layer_inputs(case, seed=5)
    plan = pinned_plan(dispatcher, case, backend, budget=4 * 200)
    positions = step_for(dispatcher, Fp8Dtype.E4M3FN, k=32).select(plan, **inputs, kv_cache=case.kv_cache)
    slots = step_for(dispatcher, Fp8Dtype.E4M3FN, k=32, slots=True).select(plan, **inputs, kv_cache=case.kv_cache)
    request = plan.metadata.row_request.long()
    table = case.batch.page_table
    p = positions.long().clamp(min=0)
    expected = torch.where(positions >= 0, table[request[:, None], p // 64] * 64 + p % 64, -1)
    # Exact: both selects run the same kernels on the same inputs; slots are a lookup of those positions.
    assert torch.equal(slots.sort(dim=1).values, expected.to(torch.int32).sort(dim=1).values)


def test_the_extend_plan_decides_the_ragged_step_and_the_paged_plan_the_paged_one():
    assert ops_for("extend") == (Op.INDEXER_Q_QUANT, Op.RAGGED_MQA_LOGITS, Op.TOPK)
    for mode in ("decode", "target_verify", "draft_extend"):
        assert Op.PAGED_MQA_LOGITS in ops_for(mode) and Op.RAGGED_MQA_LOGITS not in ops_for(mode)
    for arch, expected in (("sm100", "deepgemm.sm100"), ("sm90", "deepgemm.sm90"), ("gfx942", "rocm.fnuz"), ("sm89", "triton"),
                           ("gfx950", "triton"), ("sm120", "triton"), ("cpu", "torch.reference")):
        dispatcher = load_dispatcher(arch=arch, check_availability=False)  # the rules' choice, on any host
        fp8 = Fp8Dtype.E4M3FNUZ if arch == "gfx942" else Fp8Dtype.E4M3FN
        case = extend_case([10], [5], heads=H, head_dim=D, fp8_dtype=fp8, device=DEVICE)
        plan = build_extend_plan(dispatcher, case.batch, kv_fp8_dtype=fp8)
        assert plan.ragged_logits.backend == expected, arch
        assert plan.ragged_logits.source == "rule" and plan.ragged_logits.rule_at


def test_wrong_inputs_are_named():
    dispatcher = load_dispatcher(arch="cpu")
    case = extend_case([10, 4], [5, 2], heads=H, head_dim=D, seed=11, device=DEVICE)
    step = step_for(dispatcher, Fp8Dtype.E4M3FN)
    plan = step.plan(case.batch)
    inputs = layer_inputs(case, seed=6)
    with pytest.raises(LayoutError, match=r"expects \[M=7, H, D\]"):
        step.select(plan, **{**inputs, "q": inputs["q"][:5]}, kv_cache=case.kv_cache)
    with pytest.raises(LayoutError, match="block_kv=64"):
        step.select(plan, **inputs, kv_cache=case.kv_cache.view(-1, 32, 1, D + 4))
    k, scales = gather_keys(plan, case.kv_cache)
    q = case.q[:, :H, :D].contiguous()
    with pytest.raises(LayoutError, match=r"weights \[M=7, H=16\]"):
        ragged_mqa_logits(plan, q, k, scales, case.weights[:, :8], plan.metadata.ks, plan.metadata.ke)
    with pytest.raises(DtypeMismatchError, match=r"q has dtype torch.float8_e4m3fnuz.*e4m3fn"):
        ragged_mqa_logits(plan, q.float().to(torch.float8_e4m3fnuz), k, scales, case.weights[:, :H].contiguous(),
                          plan.metadata.ks, plan.metadata.ke)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "deepgemm.sm90"])
def test_the_step_never_waits_on_the_device(backend):
    dispatcher = load_dispatcher()
    if backend not in {b.name for b in dispatcher.eligible(Op.RAGGED_MQA_LOGITS, _extend_key(dispatcher))}:
        pytest.skip(f"{backend} cannot run here")
    case = extend_case([300, 0, 64], [40, 200, 1], heads=64, head_dim=128, device="cuda", seed=12)
    step = IndexerStep(dispatcher, kv_fp8_dtype=case.fp8_dtype, index_topk=64, **SETTINGS)
    inputs = {name: value.cuda() for name, value in layer_inputs_at(case, 64, 128).items()}
    build_extend_plan(dispatcher, case.batch, kv_fp8_dtype=case.fp8_dtype, pinned={Op.RAGGED_MQA_LOGITS: backend},
                      logits_byte_budget=4 * 400 * 64)  # warm-up: compile the kernels outside the check
    warm = build_extend_plan(dispatcher, case.batch, kv_fp8_dtype=case.fp8_dtype,
                             pinned={Op.RAGGED_MQA_LOGITS: backend}, logits_byte_budget=4 * 400 * 64)
    step.select(warm, **inputs, kv_cache=case.kv_cache)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = build_extend_plan(dispatcher, case.batch, kv_fp8_dtype=case.fp8_dtype,
                                 pinned={Op.RAGGED_MQA_LOGITS: backend}, logits_byte_budget=4 * 400 * 64)
        indices = step.select(plan, **inputs, kv_cache=case.kv_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(plan.chunks) > 1
    assert int(plan.error_flags.item()) == 0
    reference = reference_step(_on_cpu(case), {n: v.cpu() for n, v in inputs.items()}, 64)
    assert_selects_the_reference_top_k(indices.cpu(), reference, 64)


def _extend_key(dispatcher):
    from dispatch.contract.key import DispatchKey

    return DispatchKey(dispatcher.target_arch, "extend", 1, "e4m3fn")


def layer_inputs_at(case, heads: int, head_dim: int):
    gen = torch.Generator().manual_seed(13)
    rows = case.batch.total_tokens
    positions = [p + j for p, e in zip(case.batch.host_prefix_lens, case.batch.host_extend_lens) for j in range(e)]
    return dict(
        q=(torch.randn(rows, heads, head_dim, generator=gen) * 4).to(torch.bfloat16),
        weights=torch.randn(rows, heads, generator=gen),
        positions=torch.tensor(positions, dtype=torch.long),
        cos_sin_cache=torch.randn(1024, 64, generator=gen).to(torch.bfloat16),
    )


def _on_cpu(case):
    import dataclasses

    batch = case.batch
    cpu_batch = ExtendBatch.from_lengths(batch.host_prefix_lens, batch.host_extend_lens, batch.page_table.cpu())
    return dataclasses.replace(case, batch=cpu_batch, kv_cache=case.kv_cache.cpu())
