"""The DeepGEMM backends against a recording stand-in for deep_gemm: the exact arguments they build,
both API generations, the schedule's life cycle, the -inf masking, and the availability reasons."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from backends.adapted_topk import aligned_rows
from backends.deepgemm import plugin as availability
from backends.deepgemm.plugin import deepgemm_availability, probe_for
from backends.deepgemm.plugin import deepgemm_backends, register_backends
from dispatch.contract.errors import DtypeMismatchError, LayoutError
from dispatch.contract.key import Arch, ForwardMode, Op
from dispatch.contract.layout import ROW_UNIT_FLOATS, Layout
from dispatch.contract.ops import paged_mqa_logits
from tests.support.fake_deep_gemm import FakeDeepGemm
from tests.support.numerics import CPU_LOGITS_TOLERANCE, assert_logits_match
from tests.support.paged_batch import expected_logits, paged_batch
from tests.support.plans import plan_for

SEQ_LENS = [70, 5, 130]  # ragged, across page boundaries, one shorter than a page
READABLE_WIDTH = 132  # max(SEQ_LENS) rounded up to ROW_UNIT_FLOATS: the width deep_gemm is asked for
NUM_SMS = 8


def backend_named(name: str, fake: FakeDeepGemm):
    return next(b for b in deepgemm_backends(load=lambda: fake) if b.name == name)


def run_once(name: str, next_n: int, *, generation: str = "fp8_fp4", garbage: str = "nan"):
    fake = FakeDeepGemm(generation, num_sms=NUM_SMS, garbage=garbage, sm90_next_n4=name == "deepgemm.sm90.n4")
    backend = backend_named(name, fake)
    batch = paged_batch(SEQ_LENS, next_n)
    arch = Arch.SM100 if name == "deepgemm.sm100" else Arch.SM90
    plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, arch=arch)
    out = backend.run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)
    return fake, plan, batch, out


def causal_lens(seq_lens: list[int], next_n: int) -> torch.Tensor:
    return torch.tensor([[length - next_n + j + 1 for j in range(next_n)] for length in seq_lens], dtype=torch.int32)


# --- registration and import --------------------------------------------------------------------


def test_package_registers_six_backends_without_importing_deep_gemm():
    code = (
        "import sys; from backends.deepgemm.plugin import register_backends; seen = []; "
        "register_backends(seen.append); print([(b.op.value, b.name) for b in seen]); print('deep_gemm' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, imported = result.stdout.splitlines()
    assert names == str([("paged_mqa_logits", "deepgemm.sm100"), ("paged_mqa_logits", "deepgemm.sm90"),
                         ("paged_mqa_logits", "deepgemm.sm90.n4"), ("paged_mqa_logits", "deepgemm.sm90.flatten"),
                         ("ragged_mqa_logits", "deepgemm.sm100"),
                         ("ragged_mqa_logits", "deepgemm.sm90")])
    assert imported == "False"


def test_ragged_backend_table():
    seen = []
    register_backends(seen.append)
    ragged = {b.name: b for b in seen if b.op is Op.RAGGED_MQA_LOGITS}
    assert set(ragged) == {"deepgemm.sm100", "deepgemm.sm90"}
    for name, backend in ragged.items():
        assert backend.layout is Layout.RAGGED and backend.prepare is not None
        assert backend.supports.archs == {Arch(name.split(".")[1])}
        assert {d.value for d in backend.supports.fp8_dtypes} == {"e4m3fn"}
        assert ForwardMode.EXTEND in backend.supports.forward_modes


def test_backend_table():
    seen = []
    register_backends(seen.append)
    seen = [b for b in seen if b.op is Op.PAGED_MQA_LOGITS]
    by_name = {b.name: b for b in seen}
    sm100, sm90, flatten = by_name["deepgemm.sm100"], by_name["deepgemm.sm90"], by_name["deepgemm.sm90.flatten"]
    n4 = by_name["deepgemm.sm90.n4"]
    assert (sm100.layout, sm90.layout, n4.layout, flatten.layout) == (
        Layout.NATIVE, Layout.NATIVE, Layout.NATIVE, Layout.FLATTEN
    )
    assert sm100.supports.archs == {Arch.SM100}
    assert sm90.supports.archs == n4.supports.archs == flatten.supports.archs == {Arch.SM90}
    ranges = [(b.supports.next_n_min, b.supports.next_n_max) for b in (sm100, sm90, n4, flatten)]
    assert ranges == [(1, None), (1, 2), (4, 4), (1, None)]
    for backend in seen:
        assert backend.prepare is not None
        assert backend.supports.forward_modes == {
            ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND
        }
        assert {d.value for d in backend.supports.fp8_dtypes} == {"e4m3fn"}


# --- the arguments built ------------------------------------------------------------------------


@pytest.mark.parametrize("generation", ["fp8_fp4", "fp8"])
@pytest.mark.parametrize("name,next_n", [("deepgemm.sm90", 1), ("deepgemm.sm90", 2), ("deepgemm.sm100", 3)])
def test_native_arguments(generation, name, next_n):
    fake, plan, batch, _ = run_once(name, next_n, generation=generation)
    (schedule_call,) = fake.calls_to("get_paged_mqa_logits_metadata")
    lens, block_kv, sms = schedule_call.args
    assert lens is plan.context_lens and (block_kv, sms) == (64, NUM_SMS)

    (call,) = fake.calls_to(f"{generation}_paged_mqa_logits")
    q, kv_cache, weights, context_lens, block_table, schedule, max_len, clean = call.args
    if generation == "fp8_fp4":
        assert isinstance(q, tuple) and q[1] is None
        q = q[0]
    rows, heads, dim = len(SEQ_LENS), 32, 32
    assert tuple(q.shape) == (rows, next_n, heads, dim) and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert q.data_ptr() == batch.q_tokens.data_ptr()  # a view of the caller's q, no copy
    assert kv_cache is batch.kv_cache and weights is batch.weights
    assert context_lens is plan.context_lens and context_lens.is_contiguous()
    assert context_lens.dtype == torch.int32 and torch.equal(context_lens, causal_lens(SEQ_LENS, next_n))
    # Native reads each request's pages once: the engine's table, not repeated per token, in the page
    # guard's copy (out-of-range entries would point at block 0; these are all in range).
    pages = -(-max(SEQ_LENS) // 64)
    assert torch.equal(block_table, batch.page_table[:, :pages]) and block_table.shape[0] == rows
    assert schedule is plan.state.schedule and tuple(schedule.shape) == (NUM_SMS + 1, 2)
    assert (max_len, clean) == (READABLE_WIDTH, False)


@pytest.mark.parametrize("name,next_n", [("deepgemm.sm90", 1), ("deepgemm.sm90", 2), ("deepgemm.sm90.flatten", 3),
                                         ("deepgemm.sm90.n4", 4), ("deepgemm.sm100", 3)])
def test_logits_hold_each_rows_16_byte_tail_so_an_engines_top_k_reads_them_in_place(name, next_n):
    # deep_gemm's storage ends at the last row's width; an engine's top-k loading 16 bytes at a time
    # would read past it, so its adapter copied all the logits (19 us at B=128 L~32K on the H200).
    fake, plan, _, out = run_once(name, next_n)
    assert max(SEQ_LENS) % ROW_UNIT_FLOATS and READABLE_WIDTH == -(-max(SEQ_LENS) // ROW_UNIT_FLOATS) * ROW_UNIT_FLOATS
    assert tuple(out.shape) == (plan.batch_size * next_n, max(SEQ_LENS))
    assert out.untyped_storage().data_ptr() == fake.outputs[-1].untyped_storage().data_ptr()
    assert aligned_rows(out, ROW_UNIT_FLOATS) is out  # no copy
    made = fake.outputs[-1]  # the stand-in's storage, like deep_gemm's, ends at the width it was asked for
    assert made.untyped_storage().nbytes() == ((made.shape[0] - 1) * made.stride(0) + READABLE_WIDTH) * 4
    # Asked for max(SEQ_LENS) columns, as before, the last row's tail would be outside it: a copy.
    short = torch.empty_strided(tuple(out.shape), made.stride())
    assert aligned_rows(short, ROW_UNIT_FLOATS).data_ptr() != short.data_ptr()


@pytest.mark.parametrize("next_n", [1, 3, 4])
def test_flatten_arguments(next_n):
    fake, plan, batch, _ = run_once("deepgemm.sm90.flatten", next_n)
    (call,) = fake.calls_to("fp8_fp4_paged_mqa_logits")
    (q, _), _, _, context_lens, block_table, *_ = call.args
    tokens = len(SEQ_LENS) * next_n
    assert tuple(q.shape) == (tokens, 1, 32, 32) and q.is_contiguous()
    assert torch.equal(context_lens, causal_lens(SEQ_LENS, next_n).reshape(-1, 1))
    pages = -(-max(SEQ_LENS) // 64)
    assert torch.equal(block_table, batch.page_table.repeat_interleave(next_n, dim=0)[:, :pages])
    (schedule_call,) = fake.calls_to("get_paged_mqa_logits_metadata")
    assert schedule_call.args[0] is context_lens is plan.context_lens


def test_schedule_comes_from_the_lens_the_kernel_receives():
    fake, plan, _, _ = run_once("deepgemm.sm90", 2)
    (schedule_call,) = fake.calls_to("get_paged_mqa_logits_metadata")
    (call,) = fake.calls_to("fp8_fp4_paged_mqa_logits")
    assert call.args[3] is schedule_call.args[0] is plan.context_lens
    assert call.args[5] is plan.state.schedule


def test_schedule_is_built_once_per_plan_not_per_layer():
    fake = FakeDeepGemm(num_sms=NUM_SMS)
    backend = backend_named("deepgemm.sm90", fake)
    batch = paged_batch(SEQ_LENS, 2)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, 2, arch=Arch.SM90)
    q = plan.q_in_layout(batch.q_tokens)
    for _layer in range(4):
        backend.run(plan, q, batch.kv_cache, batch.weights)
    assert len(fake.calls_to("get_paged_mqa_logits_metadata")) == 1
    logits_calls = fake.calls_to("fp8_fp4_paged_mqa_logits")
    assert len(logits_calls) == 4 and all(call.args[5] is plan.state.schedule for call in logits_calls)


def test_lens_and_schedule_refreshed_in_place_are_followed_like_a_graph_replay():
    # dispatch.engines.graphs refreshes a captured plan in place: the lens and table copied in, then the backend's
    # refresh_state (the schedule copied from a fresh prepare, the page guard run again). The next run
    # must answer for the new batch.
    fake = FakeDeepGemm(num_sms=NUM_SMS)
    backend = backend_named("deepgemm.sm90", fake)
    first, second = paged_batch([70, 5, 130], 2, seed=1), paged_batch([30, 129, 64], 2, seed=2)
    plan = plan_for(backend, first.seq_lens, first.page_table, 2, arch=Arch.SM90)
    backend.run(plan, plan.q_in_layout(first.q_tokens), first.kv_cache, first.weights)
    fresh = plan_for(backend, second.seq_lens, second.page_table, 2, arch=Arch.SM90)
    plan.context_lens.copy_(fresh.context_lens)
    plan.block_table.copy_(fresh.block_table)
    backend.refresh_state(plan.state, fresh.state)
    # A captured graph keeps one cache: the second batch's blocks inside one as large as the first's.
    spare = first.kv_cache.shape[0] - second.kv_cache.shape[0]
    cache = torch.cat([second.kv_cache, torch.zeros_like(first.kv_cache[: max(spare, 0)])])
    out = backend.run(plan, plan.q_in_layout(second.q_tokens), cache, second.weights)
    width = second.max_seq_len  # the plan keeps its captured width, 130
    # The stand-in scores the native layout, the expectation one token at a time: the same sums in another
    # order (tests/support/numerics.py).
    assert_logits_match(out[:, :width], expected_logits(second), tolerance=CPU_LOGITS_TOLERANCE)
    assert (out[:, width:] == float("-inf")).all()


def test_num_sms_falls_back_to_the_device_count(monkeypatch):
    class Props:
        multi_processor_count = 5

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    fake = FakeDeepGemm(num_sms=5, has_get_num_sms=False)
    backend = backend_named("deepgemm.sm90", fake)
    batch = paged_batch(SEQ_LENS, 1)
    plan_for(backend, batch.seq_lens, batch.page_table, 1, arch=Arch.SM90)
    (schedule_call,) = fake.calls_to("get_paged_mqa_logits_metadata")
    assert schedule_call.args[2] == 5


# --- the result -----------------------------------------------------------------------------------


@pytest.mark.parametrize("garbage", ["nan", "random"])
@pytest.mark.parametrize(
    "name,next_n", [("deepgemm.sm90", 1), ("deepgemm.sm90", 2), ("deepgemm.sm100", 3), ("deepgemm.sm90.flatten", 4)]
)
def test_result_is_the_reference_with_minus_inf_past_lengths(garbage, name, next_n):
    fake, _, batch, out = run_once(name, next_n, garbage=garbage)
    expected = expected_logits(batch)
    assert tuple(out.shape) == (len(SEQ_LENS) * next_n, max(SEQ_LENS))
    assert torch.equal(out == float("-inf"), expected == float("-inf"))  # the mask: exact
    assert_logits_match(out, expected, tolerance=CPU_LOGITS_TOLERANCE)  # the sums: another order
    # Masked in place: the result is the kernel's own slice of its 256-aligned buffer, not a copy.
    (kernel_out,) = fake.outputs
    assert out.data_ptr() == kernel_out.data_ptr() and out.stride(0) == 256


@pytest.mark.parametrize("name,next_n", [("deepgemm.sm90", 2), ("deepgemm.sm100", 3), ("deepgemm.sm90.flatten", 4)])
def test_without_clean_logits_only_poisoned_rows_are_rewritten(name, next_n):
    """clean_logits=False: the visible logits as with it, the kernel's garbage left past the lengths
    (no masking pass), and the rows of a token that needs an out-of-pool page all NaN."""
    fake = FakeDeepGemm(num_sms=NUM_SMS, garbage="random")
    backend = backend_named(name, fake)
    batch = paged_batch(SEQ_LENS, next_n)
    table = batch.page_table.clone()
    table[1, 0] = 1 << 20  # request 1's only page: outside the pool, so its tokens are poisoned
    arch = Arch.SM100 if name == "deepgemm.sm100" else Arch.SM90
    plan = plan_for(backend, batch.seq_lens, table, next_n, arch=arch)
    out = backend.run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights, clean_logits=False)
    expected = expected_logits(batch)
    poisoned = torch.zeros(out.shape[0], dtype=torch.bool)
    poisoned[next_n : 2 * next_n] = True
    assert torch.isnan(out[poisoned]).all()
    visible = expected > float("-inf")
    visible[poisoned] = False
    assert_logits_match(out, expected, tolerance=CPU_LOGITS_TOLERANCE, where=visible)
    hidden = ~visible & ~poisoned[:, None]
    assert hidden.any() and not (out[hidden] == float("-inf")).all()  # the tail was not masked


# --- what run rejects before the launch ----------------------------------------------------------


def fresh_plan(name: str, next_n: int):
    fake = FakeDeepGemm(num_sms=NUM_SMS)
    backend = backend_named(name, fake)
    batch = paged_batch(SEQ_LENS, next_n)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, arch=Arch.SM90)
    return fake, backend, batch, plan


# The op's call checks the inputs once, before the backend (dispatch/contract/ops/paged_logits.py);
# the backend's run adds only deep_gemm's own checks, so these go through the op.
def test_the_ops_call_checks_the_layout_before_the_kernel():
    fake, backend, batch, plan = fresh_plan("deepgemm.sm90", 2)
    flat_q = batch.q_tokens[:, None]  # flatten-shaped q handed to a native plan
    with pytest.raises(LayoutError, match="expects per-token q"):
        paged_mqa_logits(plan, flat_q, batch.kv_cache, batch.weights)
    with pytest.raises(LayoutError, match="expects weights"):
        paged_mqa_logits(plan, batch.q_tokens, batch.kv_cache, batch.weights[:-1])
    assert not fake.calls_to("fp8_fp4_paged_mqa_logits")


def test_the_ops_call_checks_the_fp8_dtype_before_the_kernel():
    fake, backend, batch, plan = fresh_plan("deepgemm.sm90", 1)
    q_tokens = batch.q_tokens.view(torch.uint8).view(torch.float8_e4m3fnuz)
    with pytest.raises(DtypeMismatchError):
        paged_mqa_logits(plan, q_tokens, batch.kv_cache, batch.weights)
    assert not fake.calls_to("fp8_fp4_paged_mqa_logits")


def test_run_rejects_a_non_contiguous_q():
    fake, backend, batch, plan = fresh_plan("deepgemm.sm90", 2)
    q = plan.q_in_layout(batch.q_tokens)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, token-major memory
    with pytest.raises(LayoutError, match="contiguous q"):
        backend.run(plan, strided, batch.kv_cache, batch.weights)
    assert not fake.calls_to("fp8_fp4_paged_mqa_logits")


def test_run_rejects_a_plan_without_its_schedule():
    _, backend, batch, plan = fresh_plan("deepgemm.sm90", 2)
    bare = type(plan)(**{**plan.__dict__, "states": {}})
    with pytest.raises(LayoutError, match="no DeepGEMM schedule"):
        backend.run(bare, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)


# --- availability ---------------------------------------------------------------------------------


def missing_module():
    raise ModuleNotFoundError("No module named 'deep_gemm'")


def test_availability_when_deep_gemm_is_missing():
    result = deepgemm_availability(Arch.SM90, host=Arch.SM90, gpu_visible=True, load=missing_module)
    assert not result.ok and "No module named 'deep_gemm'" in result.reason


def test_availability_when_the_extension_fails_to_load():
    def broken():
        raise ImportError("_C.so: undefined symbol: _ZN3c105ErrorC2E")

    result = deepgemm_availability(Arch.SM90, host=Arch.SM90, gpu_visible=True, load=broken)
    assert not result.ok and "undefined symbol" in result.reason


def test_availability_names_a_missing_schedule_symbol():
    fake = FakeDeepGemm(has_schedule=False)
    result = deepgemm_availability(Arch.SM90, host=Arch.SM90, gpu_visible=True, load=lambda: fake)
    assert not result.ok and "`get_paged_mqa_logits_metadata`" in result.reason and "fake-fp8_fp4" in result.reason


def test_availability_names_both_logits_generations_when_neither_is_there():
    fake = FakeDeepGemm("none")
    result = deepgemm_availability(Arch.SM90, host=Arch.SM90, gpu_visible=True, load=lambda: fake)
    assert not result.ok
    assert "`fp8_fp4_paged_mqa_logits` or `fp8_paged_mqa_logits`" in result.reason


def test_availability_on_another_arch_does_not_load_deep_gemm():
    result = deepgemm_availability(Arch.SM90, host=Arch.SM100, gpu_visible=True, load=missing_module)
    assert not result.ok and "sm90" in result.reason and "sm100" in result.reason


def test_availability_without_a_gpu():
    result = deepgemm_availability(Arch.SM90, host=Arch.CPU, gpu_visible=False, load=missing_module)
    assert not result.ok and "no CUDA GPU" in result.reason


@pytest.mark.parametrize("generation", ["fp8_fp4", "fp8"])
def test_availability_yes_with_either_generation(generation):
    fake = FakeDeepGemm(generation)
    assert deepgemm_availability(Arch.SM90, host=Arch.SM90, gpu_visible=True, load=lambda: fake).ok


def test_probe_reads_the_detected_arch(monkeypatch):
    fake = FakeDeepGemm()
    monkeypatch.setattr(availability.detect, "detect_arch", lambda: Arch.SM90)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert probe_for(Arch.SM90, lambda: fake)().ok
    mismatch = probe_for(Arch.SM100, lambda: fake)()
    assert not mismatch.ok and "this machine is sm90" in mismatch.reason


# --- SM90 next_n 4: the 2-CTA KV-multicast kernel -------------------------------------------------


def test_next_n4_arguments_and_a_schedule_of_one_task_per_cluster():
    fake, plan, batch, out = run_once("deepgemm.sm90.n4", 4)
    (schedule_call,) = fake.calls_to("get_paged_mqa_logits_metadata")
    lens, block_kv, slots = schedule_call.args
    assert lens is plan.context_lens and (block_kv, slots) == (64, NUM_SMS // 2)
    (call,) = fake.calls_to("fp8_fp4_paged_mqa_logits")
    (q, scales), _, _, context_lens, block_table, schedule, max_len, clean = call.args
    assert scales is None and tuple(q.shape) == (len(SEQ_LENS), 4, 32, 32) and q.is_contiguous()
    assert q.data_ptr() == batch.q_tokens.data_ptr()  # native: a view of the caller's q
    assert context_lens is plan.context_lens and torch.equal(context_lens, causal_lens(SEQ_LENS, 4))
    assert block_table.shape[0] == len(SEQ_LENS)  # each request's pages once, not per token
    assert schedule is plan.state.schedule and tuple(schedule.shape) == (NUM_SMS // 2 + 1, 2)
    assert (max_len, clean) == (READABLE_WIDTH, False)
    expected = expected_logits(batch)
    assert torch.equal(out == float("-inf"), expected == float("-inf"))
    assert_logits_match(out, expected, tolerance=CPU_LOGITS_TOLERANCE)


def test_a_schedule_per_sm_is_what_the_multicast_kernel_refuses():
    # The stand-in asserts what the real host code does; the per-SM schedule of deepgemm.sm90 would fail.
    from backends.deepgemm.adapter import DeepGemmPagedLogits
    from tests.support.fake_deep_gemm import FakeKernelError

    fake = FakeDeepGemm(num_sms=NUM_SMS, sm90_next_n4=True)
    per_sm = DeepGemmPagedLogits(Layout.NATIVE, lambda: fake)  # kv_multicast 1
    backend = backend_named("deepgemm.sm90.n4", fake)
    batch = paged_batch(SEQ_LENS, 4)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, 4, arch=Arch.SM90)
    wrong = type(plan)(**{**plan.__dict__, "states": {Op.PAGED_MQA_LOGITS: per_sm.prepare(plan)}})
    with pytest.raises(FakeKernelError, match="num_sms / 2"):
        backend.run(wrong, wrong.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)


@pytest.mark.parametrize("garbage", ["nan", "random"])
def test_next_n4_graph_refresh_and_no_clean_logits(garbage):
    fake = FakeDeepGemm(num_sms=NUM_SMS, garbage=garbage, sm90_next_n4=True)
    backend = backend_named("deepgemm.sm90.n4", fake)
    first, second = paged_batch([70, 5, 130], 4, seed=3), paged_batch([30, 129, 64], 4, seed=4)
    plan = plan_for(backend, first.seq_lens, first.page_table, 4, arch=Arch.SM90)
    backend.run(plan, plan.q_in_layout(first.q_tokens), first.kv_cache, first.weights)
    fresh = plan_for(backend, second.seq_lens, second.page_table, 4, arch=Arch.SM90)
    plan.context_lens.copy_(fresh.context_lens)
    plan.block_table.copy_(fresh.block_table)
    backend.refresh_state(plan.state, fresh.state)
    assert tuple(plan.state.schedule.shape) == (NUM_SMS // 2 + 1, 2)
    spare = first.kv_cache.shape[0] - second.kv_cache.shape[0]
    cache = torch.cat([second.kv_cache, torch.zeros_like(first.kv_cache[: max(spare, 0)])])
    out = backend.run(plan, plan.q_in_layout(second.q_tokens), cache, second.weights, clean_logits=False)
    width = second.max_seq_len
    visible = expected_logits(second) > float("-inf")
    assert_logits_match(out[:, :width], expected_logits(second), tolerance=CPU_LOGITS_TOLERANCE, where=visible)


def test_next_n4_refuses_an_odd_sm_count():
    fake = FakeDeepGemm(num_sms=7, sm90_next_n4=True)
    backend = backend_named("deepgemm.sm90.n4", fake)
    batch = paged_batch(SEQ_LENS, 4)
    with pytest.raises(LayoutError, match="divisible by 2; get_num_sms\\(\\) is 7"):
        plan_for(backend, batch.seq_lens, batch.page_table, 4, arch=Arch.SM90)
    assert not fake.calls_to("get_paged_mqa_logits_metadata")


def n4_key(next_n: int, arch: Arch = Arch.SM90):
    from dispatch.contract.key import DispatchKey, Fp8Dtype

    return DispatchKey(arch=arch, forward_mode=ForwardMode.TARGET_VERIFY, next_n=next_n, fp8_dtype=Fp8Dtype.E4M3FN)


@pytest.mark.parametrize("next_n,arch,reason", [
    (3, Arch.SM90, "next_n 3 not supported (supports 4)"),
    (2, Arch.SM90, "next_n 2 not supported (supports 4)"),
    (8, Arch.SM90, "next_n 8 not supported (supports 4)"),
    (4, Arch.SM100, "arch sm100 not supported"),
])
def test_next_n4_serves_next_n_4_on_sm90_only(next_n, arch, reason):
    backend = backend_named("deepgemm.sm90.n4", FakeDeepGemm())
    assert backend.supports.why_not(n4_key(4)) is None
    assert reason in backend.supports.why_not(n4_key(next_n, arch))


def test_availability_of_next_n4_reads_the_shipped_kernel_source(tmp_path, monkeypatch):
    monkeypatch.setattr(availability.detect, "detect_arch", lambda: Arch.SM90)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with_kernel = FakeDeepGemm(sm90_next_n4=True, package_dir=tmp_path / "new")
    without = FakeDeepGemm(package_dir=tmp_path / "old")
    bare = FakeDeepGemm()  # no __file__: nothing shipped to read
    assert backend_named("deepgemm.sm90.n4", with_kernel).probe().ok
    old = backend_named("deepgemm.sm90.n4", without).probe()
    assert not old.ok and "has no SM90 next_n 4 kernel" in old.reason and "fake-fp8_fp4" in old.reason
    assert "sm90_fp8_paged_mqa_logits.cuh` has no KV multicast" in old.reason
    assert backend_named("deepgemm.sm90", without).probe().ok  # next_n 1-2 still served by that build
    none = backend_named("deepgemm.sm90.n4", bare).probe()
    assert not none.ok and "SM90 paged logits source" in none.reason


# --- the version a measurement records ----------------------------------------------------------


class _Distribution:
    def __init__(self, version: str, root):
        self.version, self._root = version, root

    def locate_file(self, path):
        return self._root / path


@pytest.mark.parametrize("imported", ["sgl", "ts"])
def test_with_two_builds_installed_the_version_names_the_one_imported(tmp_path, monkeypatch, imported):
    import importlib.machinery
    import importlib.metadata

    roots = {"sgl-deep-gemm": tmp_path / "sgl", "tokenspeed-deepgemm": tmp_path / "ts"}
    versions = {"sgl-deep-gemm": "0.1.5", "tokenspeed-deepgemm": "2.5.0.post20260629"}
    for root in roots.values():
        (root / "deep_gemm").mkdir(parents=True)
        (root / "deep_gemm" / "__init__.py").write_text("")

    def distribution(name):
        if name not in roots:
            raise importlib.metadata.PackageNotFoundError(name)
        return _Distribution(versions[name], roots[name])

    origin = str(tmp_path / imported / "deep_gemm" / "__init__.py")
    spec = importlib.machinery.ModuleSpec("deep_gemm", None, origin=origin)
    monkeypatch.setattr(availability.importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: spec if name == "deep_gemm" else None)
    expected = {"sgl": "sgl-deep-gemm 0.1.5", "ts": "tokenspeed-deepgemm 2.5.0.post20260629"}[imported]
    assert availability.library_version() == expected


def test_with_one_build_or_none_the_version_is_its_metadata(tmp_path, monkeypatch):
    import importlib.metadata

    def only_tokenspeed(name):
        if name != "tokenspeed-deepgemm":
            raise importlib.metadata.PackageNotFoundError(name)
        return _Distribution("2.5.0.post20260629", tmp_path)

    def find_spec(name):
        raise AssertionError("one build installed: nothing to disambiguate")

    monkeypatch.setattr(availability.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(availability.importlib.metadata, "distribution", only_tokenspeed)
    assert availability.library_version() == "tokenspeed-deepgemm 2.5.0.post20260629"

    def none(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(availability.importlib.metadata, "distribution", none)
    assert availability.library_version() == ""


# --- the schedule computed in the page guard's launch (backends/deepgemm/guard_and_schedule.py) ------------


@pytest.mark.parametrize("name,next_n,scheduler", [("deepgemm.sm90", 1, "sgl"), ("deepgemm.sm90", 2, "sgl"),
                                                   ("deepgemm.sm90.flatten", 3, "sgl"),
                                                   ("deepgemm.sm90.n4", 4, "tokenspeed"),
                                                   ("deepgemm.sm90", 2, "tokenspeed")])
def test_a_build_whose_scheduler_is_known_gets_its_schedule_from_the_guards_launch(tmp_path, name, next_n, scheduler):
    from tests.support.deepgemm_schedule import spelled_out

    fake = FakeDeepGemm(num_sms=NUM_SMS, sm90_next_n4=name == "deepgemm.sm90.n4", package_dir=tmp_path,
                        scheduler=scheduler)
    backend = backend_named(name, fake)
    batch = paged_batch(SEQ_LENS, next_n)
    plan = plan_for(backend, batch.seq_lens, batch.page_table, next_n, arch=Arch.SM90)
    out = backend.run(plan, plan.q_in_layout(batch.q_tokens), batch.kv_cache, batch.weights)
    assert fake.calls_to("get_paged_mqa_logits_metadata") == []  # no second launch
    slots = NUM_SMS // (2 if name == "deepgemm.sm90.n4" else 1)
    assert plan.state.schedule.tolist() == spelled_out(plan.context_lens.tolist(), slots, scheduler == "tokenspeed")
    expected = expected_logits(batch)
    assert torch.equal(out == float("-inf"), expected == float("-inf"))
    assert_logits_match(out, expected, tolerance=CPU_LOGITS_TOLERANCE)


def test_sgl_builds_past_next_n_2_and_sm100_keep_deep_gemms_own_schedule(tmp_path):
    sm100 = FakeDeepGemm(num_sms=NUM_SMS, package_dir=tmp_path / "a", scheduler="tokenspeed")
    backend = backend_named("deepgemm.sm100", sm100)
    batch = paged_batch(SEQ_LENS, 4)
    plan_for(backend, batch.seq_lens, batch.page_table, 4, arch=Arch.SM100)
    assert len(sm100.calls_to("get_paged_mqa_logits_metadata")) == 1  # SM100 counts next_n atoms its own way
    sgl = FakeDeepGemm(num_sms=NUM_SMS, package_dir=tmp_path / "b", scheduler="sgl")
    flatten = backend_named("deepgemm.sm90.flatten", sgl)
    plan_for(flatten, batch.seq_lens, batch.page_table, 4, arch=Arch.SM90)
    assert sgl.calls_to("get_paged_mqa_logits_metadata") == []  # flatten lens are [B*N, 1]: next_n 1
