"""DeepGEMM's schedule computed by our kernel in the page guard's launch (backends/deepgemm/guard_and_schedule.py)
against the rule spelled out in plain Python (uint32 arithmetic, DeepGEMM's binary search step for step):
equal, exactly (both compute the same integers), at ragged lengths, several batch and slot counts, both
variants of the rule, and hostile lengths (zero, negative, past int32's half, sums that wrap uint32). The
fused launch's guard outputs equal the guard launched alone. On a GPU with a deep_gemm build installed:
equal to deep_gemm's own get_paged_mqa_logits_metadata, and the logits through our schedule equal to the
logits through deep_gemm's."""

from __future__ import annotations

import pytest
import torch

from backends.deepgemm.guard_and_schedule import (SPLIT_KV, DeepGemmSchedule, ScheduleRule, launch_guard_and_schedule,
                                                  schedule_rule_of)
from backends.shared.page_guard import PageGuard
from dispatch.contract import new_error_flags
from tests.support.deepgemm_schedule import spelled_out

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels under the interpreter
SGL = ScheduleRule(clamp_request=False, max_next_n=2, source="test")
TOKENSPEED = ScheduleRule(clamp_request=True, max_next_n=None, source="test")

def _lens(batch: int, next_n: int, seed: int, high: int = 70000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    last = torch.randint(next_n, high, (batch, 1), generator=gen, dtype=torch.int32)
    return (last + torch.arange(1 - next_n, 1, dtype=torch.int32)).contiguous()


def _ours(lens: torch.Tensor, slots: int, rule: ScheduleRule) -> list[list[int]]:
    schedule = DeepGemmSchedule.allocate(lens.to(DEVICE), slots, rule)
    schedule.launch()
    return schedule.schedule.cpu().tolist()


@pytest.mark.parametrize("rule", [SGL, TOKENSPEED], ids=["sgl", "tokenspeed"])
@pytest.mark.parametrize("batch,next_n,slots", [(1, 1, 132), (3, 2, 132), (32, 1, 66), (33, 4, 66), (130, 2, 132),
                                                (300, 1, 132), (7, 1, 1), (64, 2, 5)])
def test_the_schedule_is_the_rule_at_ragged_lengths(rule, batch, next_n, slots):
    for seed in range(2):
        lens = _lens(batch, next_n, seed + batch)
        assert _ours(lens, slots, rule) == spelled_out(lens.tolist(), slots, rule.clamp_request)


@pytest.mark.parametrize("rule", [SGL, TOKENSPEED], ids=["sgl", "tokenspeed"])
def test_hostile_lengths_give_the_rules_schedule(rule):
    cases = [
        [[0]] * 5,  # no segments at all: every slot past the last request (clamped or not)
        [[1], [0], [256], [257], [0]],
        [[-1], [5], [-(2**31)]],  # negative lengths read as uint32, as deep_gemm reads them
        [[2**31 - 1]] * 40 + [[300]],
        [[-300]] * 300,  # segment sums that wrap uint32
    ]
    for lens in cases:
        for slots in (1, 3, 132):
            tensor = torch.tensor(lens, dtype=torch.int32)
            assert _ours(tensor, slots, rule) == spelled_out(lens, slots, rule.clamp_request), (lens[:3], slots)


def test_the_fused_launch_guards_as_the_guard_alone_does():
    gen = torch.Generator().manual_seed(3)
    lens = _lens(9, 2, 1, high=900).to(DEVICE)
    table = torch.randint(-2, 40, (9, 16), generator=gen, dtype=torch.int32).to(DEVICE)  # some entries outside
    alone = PageGuard.allocate(lens, table, 1024, new_error_flags(lens.device))
    alone.launch(30)
    fused = PageGuard.allocate(lens, table, 1024, new_error_flags(lens.device))
    schedule = DeepGemmSchedule.allocate(lens, 132, TOKENSPEED)
    launch_guard_and_schedule(fused, schedule, 30)
    for name in ("safe_table", "lens", "error_flags"):
        assert torch.equal(getattr(fused, name), getattr(alone, name)), name
    assert torch.equal(fused.fill.isnan(), alone.fill.isnan()) and torch.equal(fused.fill.nan_to_num(), alone.fill.nan_to_num())
    assert fused.error_flags.item() != 0 and fused.num_blocks == 30
    assert schedule.schedule.cpu().tolist() == spelled_out(lens.cpu().tolist(), 132, True)


def test_lens_it_cannot_read_are_refused_before_a_launch():
    from dispatch.contract import LayoutError

    with pytest.raises(LayoutError, match="unit column stride"):
        DeepGemmSchedule.allocate(torch.zeros(4, 2, dtype=torch.int32).t(), 132, SGL)
    with pytest.raises(LayoutError, match="int32 lens"):
        DeepGemmSchedule.allocate(torch.zeros(4, 2, dtype=torch.int64), 132, SGL)
    with pytest.raises(LayoutError, match="scheduler slot"):
        DeepGemmSchedule.allocate(torch.zeros(4, 2, dtype=torch.int32), 0, SGL)


def test_a_build_without_a_known_scheduler_keeps_its_own_kernel(tmp_path):
    import types

    assert schedule_rule_of(types.SimpleNamespace()) is None  # a stand-in without a file
    package = tmp_path / "deep_gemm"
    (package / "include" / "deep_gemm" / "scheduler").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "include" / "deep_gemm" / "scheduler" / "paged_mqa_logits.cuh").write_text("another generation")
    assert schedule_rule_of(types.SimpleNamespace(__file__=str(package / "__init__.py"))) is None
    assert SGL.serves(2) and not SGL.serves(4) and TOKENSPEED.serves(4)


def _deep_gemm():
    try:
        import deep_gemm
    except Exception as error:  # noqa: BLE001 - a missing or unloadable build both mean: skip
        pytest.skip(f"deep_gemm not importable: {error}")
    return deep_gemm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_schedule_is_deep_gemms_own_on_the_gpu():
    from backends.deepgemm.adapter import build_schedule, num_sms

    module = _deep_gemm()
    rule = schedule_rule_of(module)
    assert rule is not None, "the installed deep_gemm's scheduler is not a rule we compute"
    sms = num_sms(module, torch.device("cuda"))
    checked = 0
    for next_n in (1, 2, 4):
        if not rule.serves(next_n):
            continue
        slots = sms // 2 if next_n == 4 else sms  # the 2-CTA next_n 4 kernel: one task per cluster
        for batch in (5, 128, 300):  # each aligned batch size is one JIT build of deep_gemm's kernel
            for seed in range(2):
                lens = _lens(batch, next_n, seed, high=140000).cuda()
                assert _ours(lens, slots, rule) == build_schedule(module, lens, slots).cpu().tolist(), (next_n, batch)
                flat = lens.reshape(-1, 1)  # the flatten layout's lens
                if flat.shape[0] <= 320:
                    assert _ours(flat, slots, rule) == build_schedule(module, flat, slots).cpu().tolist()
                checked += 1
    assert checked >= 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,next_n", [("deepgemm.sm90", 2), ("deepgemm.sm90.n4", 4)])
def test_logits_through_the_one_launch_prepare_equal_those_through_deep_gemms_schedule(name, next_n):
    import dataclasses

    from backends.deepgemm.adapter import DeepGemmState, build_schedule, num_sms
    from backends.deepgemm.plugin import deepgemm_backends
    from dispatch.contract import Arch, Op
    from dispatch.contract.ops import paged_mqa_logits
    from tests.support.paged_batch import expected_logits, paged_batch
    from tests.support.plans import plan_for

    module = _deep_gemm()
    backend = next(b for b in deepgemm_backends() if b.name == name)
    if not backend.availability().ok:
        pytest.skip(f"{name}: {backend.availability().reason}")
    batch = paged_batch([1000, 64, 2049, 7, 300, 4096, 129, 65], next_n, heads=64, head_dim=128, device="cuda", seed=1)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, arch=Arch.SM90,
                    num_kv_blocks=batch.kv_cache.shape[0])  # the pool given: guard and schedule in one launch
    assert schedule_rule_of(module) is not None and plan.state.guard.num_blocks == batch.kv_cache.shape[0]
    slots = num_sms(module, torch.device("cuda")) // (2 if next_n == 4 else 1)
    theirs = build_schedule(module, plan.context_lens, slots)
    assert torch.equal(plan.state.schedule, theirs)
    out = paged_mqa_logits(plan, batch.q_tokens, batch.kv_cache, batch.weights).clone()
    own = dataclasses.replace(plan, states={Op.PAGED_MQA_LOGITS: DeepGemmState(theirs, plan.state.guard)})
    assert torch.equal(paged_mqa_logits(own, batch.q_tokens, batch.kv_cache, batch.weights).nan_to_num(), out.nan_to_num())
    expected = expected_logits(batch)
    hidden = expected == float("-inf")
    assert torch.equal(out == float("-inf"), hidden) and not out.isnan().any()
    error = ((out[~hidden].double() - expected[~hidden].double()).norm() / expected[~hidden].double().norm()).item()
    assert error < 1e-3, f"relative error {error:.2e}"
