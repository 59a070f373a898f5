"""The engines' top-k kernels as `topk` backends (backends/sglang_topk, backends/vllm_topk): each adapter
against recording stand-ins of the engines' entry points on the CPU (tests/support/fake_engine_topk.py), beside
the torch reference; their call limits, probes, plan state, and how bench and tune treat a refused call.
The real kernels run on a GPU where the engines are installed (the gpu-marked test at the end)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from backends.engine_probe import engine_topk_availability, import_module
from backends.reference.plugin import register_backends as register_reference
from backends.reference.topk import topk_indices as reference_topk
from backends.sglang_topk.plugin import sglang_topk_backends
from backends.vllm_topk.plugin import vllm_topk_backends
from dispatch.contract.errors import LayoutError, UnservedCallError
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode, Op
from dispatch.contract.ops import topk as topk_through_plan
from dispatch.step.paged_plan import PagedPlan, layout_tensors, page_rows
from tests.support.fake_engine_topk import FakeSglangV2, FakeSglKernel, FakeVllmOps
from tests.support.plans import decision_for


def engine_backends():
    v2, sgl_kernel, vllm = FakeSglangV2(), FakeSglKernel(), FakeVllmOps()
    backends = sglang_topk_backends(load_v2=lambda: v2, load_sgl_kernel=lambda: sgl_kernel)
    backends += vllm_topk_backends(load=lambda: vllm)
    return {b.name: b for b in backends}, {"v2": v2, "sgl_kernel": sgl_kernel, "vllm": vllm}


# Each backend with a k it is built for and whether it takes row starts.
CASES = [
    ("sglang.topk_v2", 100, False),
    ("sglang.topk_v2", 2048, False),
    ("sglang.topk_v2.ragged", 300, True),
    ("sglang.fast_topk", 2048, True),
    ("vllm.persistent_topk", 512, False),
    ("vllm.cooperative_topk", 1024, False),
    ("vllm.top_k_per_row", 700, True),
    ("vllm.auto", 512, False),
]


def ragged_rows(rows: int, width: int, *, starts: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=generator)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator, dtype=torch.int32)
    lengths[0], lengths[-1] = width, 0  # a full row and an empty one
    first = None
    if starts:
        first = (torch.rand(rows, generator=generator) * (width - lengths).float()).to(torch.int32)
    return logits, lengths, first


def values_of(logits, positions, starts):
    """Each row's selected values, sorted: what two exact top-k selections must agree on."""
    begin = torch.zeros(logits.shape[0], dtype=torch.long) if starts is None else starts.long()
    out = []
    for r in range(logits.shape[0]):
        picked = positions[r][positions[r] >= 0].long()
        out.append(sorted(logits[r, begin[r] + picked].tolist()))
    return out


@pytest.mark.parametrize("name,k,with_starts", CASES)
@pytest.mark.parametrize("rows,width", [(5, 3000), (12, 2500), (3, 64)])
def test_each_backend_selects_what_the_reference_selects(name, k, with_starts, rows, width):
    backends, _ = engine_backends()
    logits, lengths, starts = ragged_rows(rows, width, starts=with_starts, seed=rows * width + k)
    logits[1, :7] = float("-inf")  # -inf is a visible number: selected after every finite value
    kwargs = {"starts": starts} if starts is not None else {}
    got = backends[name].run(logits, lengths, k, **kwargs)
    want = reference_topk(logits, lengths, k, **kwargs)
    assert got.dtype == torch.int32 and got.shape == (rows, k)
    # Exact: both sides pick among the same fp32 values with no arithmetic, so the multisets are equal.
    assert values_of(logits, got, starts) == values_of(logits, want, starts)
    assert torch.equal((got >= 0).sum(dim=1), (want >= 0).sum(dim=1))  # -1 exactly past what a row sees


@pytest.mark.parametrize("name,k,with_starts", CASES)
def test_a_nan_is_never_selected_and_a_poisoned_row_selects_nothing(name, k, with_starts):
    backends, _ = engine_backends()
    logits, _, _ = ragged_rows(4, 2600, starts=False, seed=7)
    lengths = torch.tensor([2600, 2597, 40, 0], dtype=torch.int32)
    starts = torch.tensor([0, 3, 9, 0], dtype=torch.int32) if with_starts else None
    logits[0] = float("nan")
    logits[1, 10::500] = float("nan")  # 6 NaNs among numbers: each ranks first in the kernels, then turns -1
    kwargs = {"starts": starts} if starts is not None else {}
    got = backends[name].run(logits, lengths, k, **kwargs)
    assert got[0].tolist() == [-1] * k
    begin = 0 if starts is None else int(starts[1])
    picked = got[1][got[1] >= 0].long() + begin
    assert picked.numel() >= k - 6 and not torch.isnan(logits[1, picked]).any()  # the one documented difference


@pytest.mark.parametrize("name,k,with_starts", CASES)
def test_sorted_and_the_page_transform(name, k, with_starts):
    backends, _ = engine_backends()
    logits, lengths, starts = ragged_rows(6, 2200, starts=with_starts, seed=11)
    page_table = torch.randint(0, 1000, (3, 2200 // 64 + 1), dtype=torch.int32)
    rows_of = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)  # native: next_n 2 tokens share a table row
    kwargs = {"starts": starts} if starts is not None else {}
    positions = backends[name].run(logits, lengths, k, sorted=True, **kwargs)
    begin = torch.zeros(6, dtype=torch.long) if starts is None else starts.long()
    for r in range(6):
        kept = positions[r][positions[r] >= 0].long()
        assert positions[r, kept.numel():].tolist() == [-1] * (k - kept.numel())  # -1s last
        values = logits[r, begin[r] + kept]
        assert torch.all(values[:-1] >= values[1:])
    slots = backends[name].run(logits, lengths, k, page_table=page_table, page_rows=rows_of, block_size=64, **kwargs)
    want = reference_topk(logits, lengths, k, page_table=page_table, page_rows=rows_of, block_size=64, **kwargs)
    # Same selection, as physical slots: compared as sets per row (the kernels' order is unspecified).
    for r in range(6):
        assert sorted(slots[r].tolist()) == sorted(want[r].tolist())


def test_ragged_v2_leaves_the_callers_logits_as_they_were():
    backends, calls = engine_backends()
    logits, lengths, starts = ragged_rows(6, 3000, starts=True, seed=3)
    starts[:] = torch.tensor([1, 2, 3, 5, 6, 7], dtype=torch.int32)  # unaligned windows
    lengths[:] = 2900
    before = logits.clone()
    backends["sglang.topk_v2.ragged"].run(logits, lengths, 2048, starts=starts)
    (call,) = calls["v2"].calls
    assert call.args[0] is logits  # the kernel wrote -inf ahead of each window; the adapter put it back
    assert torch.equal(logits, before)


@pytest.mark.parametrize("name,k", [(name, k) for name, k, with_starts in CASES if with_starts])
def test_strided_row_starts_and_lengths_reach_the_kernel_contiguous(name, k):
    """An engine's starts and lengths may be columns of one [rows, 2] tensor (ks, ke): the kernels read
    them through raw pointers or contiguous-only matchers, so the adapter hands them over contiguous."""
    backends, _ = engine_backends()
    logits, lengths, starts = ragged_rows(8, 2600, starts=True, seed=17)
    packed = torch.stack([starts, lengths], dim=1)  # [rows, 2]: each column strided
    strided_starts, strided_lengths = packed[:, 0], packed[:, 1]
    assert not strided_starts.is_contiguous()
    got = backends[name].run(logits, strided_lengths, k, starts=strided_starts)
    want = backends[name].run(logits, lengths, k, starts=starts)
    assert values_of(logits, got, starts) == values_of(logits, want, starts)


def test_paged_v2_uses_the_routing_plan_built_once_per_batch():
    backends, calls = engine_backends()
    backend = backends["sglang.topk_v2"]
    seq_lens = torch.tensor([2500, 40, 3000], dtype=torch.int32)
    plan = plan_with_topk(backend, seq_lens, next_n=2)
    (planned,) = calls["v2"].calls
    assert torch.equal(planned.args[0], plan.token_lengths)
    logits = torch.randn(6, plan.max_context_len)
    for _layer in range(3):
        out = topk_through_plan(plan, logits, 2048, transform_to_slots=True)
    runs = [c for c in calls["v2"].calls if c.name == "topk_transform_paged_v2"]
    assert len(calls["v2"].calls) == 4 and all(c.args[5] is plan.state_of(Op.TOPK).metadata for c in runs)
    assert runs[0].args[2] is None  # positions alone: the finish maps them through the plan's table
    want = reference_topk(logits, plan.token_lengths, 2048, page_table=plan.block_table, page_rows=plan.page_rows)
    assert [sorted(r) for r in out.tolist()] == [sorted(r) for r in want.tolist()]


def test_paged_v2_plans_over_the_plans_readable_lengths_where_its_one_launch_wrote_them():
    """A plan that carries readable lengths (the one launch's) hands them to plan_topk_v2 as they are;
    one without them gets token_lengths cut to the logits' width, the same values."""
    backends, calls = engine_backends()
    backend = backends["sglang.topk_v2"]
    plan = plan_with_topk(backend, torch.tensor([2500, 40, 3000], dtype=torch.int32), next_n=2, max_seq_len=2600)
    (cut,) = calls["v2"].calls
    assert cut.args[0].tolist() == plan.token_lengths.clamp(max=2600).tolist() and cut.args[0].dtype == torch.int32
    written = plan.token_lengths.clamp(max=2600).to(torch.int32)
    with_them = dataclasses.replace(plan, readable_lengths=written)
    state = backend.prepare(with_them)
    assert calls["v2"].calls[-1].args[0] is written and state.lengths is written
    assert state.source_ptr == with_them.token_lengths.data_ptr()  # a layer's call is still known as the plan's


def test_paged_v2_state_refreshed_in_place_is_followed_like_a_graph_replay():
    backends, calls = engine_backends()
    backend = backends["sglang.topk_v2"]
    plan = plan_with_topk(backend, torch.tensor([2500, 3000], dtype=torch.int32), next_n=1)
    fresh = plan_with_topk(backend, torch.tensor([2999, 7], dtype=torch.int32), next_n=1, max_seq_len=3000)
    plan.context_lens.copy_(fresh.context_lens)
    backend.refresh_state(plan.state_of(Op.TOPK), fresh.state_of(Op.TOPK))
    logits = torch.randn(2, 3000)
    out = topk_through_plan(plan, logits, 2048)
    assert values_of(logits, out, None) == values_of(logits, reference_topk(logits, fresh.token_lengths, 2048), None)


def test_paged_v2_outside_a_plan_plans_the_call_itself():
    backends, calls = engine_backends()
    logits = torch.randn(3, 2100)
    backends["sglang.topk_v2"].run(logits, torch.tensor([2100, 5, 2099], dtype=torch.int32), 2048)
    assert [c.name for c in calls["v2"].calls] == ["plan_topk_v2", "topk_transform_paged_v2"]


def plan_with_topk(topk_backend, seq_lens, *, next_n, max_seq_len=None):
    """A paged plan whose top-k decision is `topk_backend` (the logits' layout native), state prepared."""
    key = DispatchKey(Arch.SM90, ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY, next_n,
                      Fp8Dtype.E4M3FN)
    reference = {}
    register_reference(lambda b: reference.setdefault((b.op, b.name), b))
    logits_backend = reference[(Op.PAGED_MQA_LOGITS, "torch.reference")]
    pages = -(-int(seq_lens.max()) // 64)
    page_table = torch.arange(seq_lens.shape[0] * pages, dtype=torch.int32).reshape(seq_lens.shape[0], pages).flip(1)
    context_lens, block_table = layout_tensors(logits_backend.layout, seq_lens, page_table, next_n)
    decisions = {op: decision_for(logits_backend, key) for op in Op}
    decisions[Op.TOPK] = decision_for(topk_backend, key)
    plan = PagedPlan(key=key, decisions=decisions, batch_size=seq_lens.shape[0], next_n=next_n,
                       context_lens=context_lens, block_table=block_table,
                       max_context_len=int(seq_lens.max()) if max_seq_len is None else max_seq_len,
                       page_rows=page_rows(logits_backend.layout, seq_lens.shape[0], next_n, seq_lens.device))
    return dataclasses.replace(plan, states={Op.TOPK: topk_backend.prepare(plan)})


@pytest.mark.parametrize("name,k,rows,starts,reason", [
    ("sglang.topk_v2", 4096, 2, False, "past its 2048"),
    ("sglang.topk_v2", 64, 2, True, "ragged rows"),
    ("sglang.topk_v2.ragged", 2049, 2, True, "past its 2048"),
    ("sglang.fast_topk", 512, 2, False, "not one it is built for"),
    ("vllm.persistent_topk", 100, 2, False, "not one it is built for"),
    ("vllm.persistent_topk", 512, 2, True, "ragged rows"),
    ("vllm.cooperative_topk", 512, 65, False, "65 rows is past its 64"),
    ("vllm.top_k_per_row", 4096, 2, False, "past its 2048"),
])
def test_a_call_a_kernel_cannot_serve_is_refused_with_the_reason_before_the_kernel(name, k, rows, starts, reason):
    backends, calls = engine_backends()
    logits = torch.randn(rows, 300)
    lengths = torch.full((rows,), 10, dtype=torch.int32)
    kwargs = {"starts": torch.zeros(rows, dtype=torch.int32)} if starts else {}
    with pytest.raises(UnservedCallError, match=f"`{name}` cannot serve this call: .*{reason}"):
        backends[name].run(logits, lengths, k, **kwargs)
    assert not any(fake.calls for fake in calls.values())
    assert issubclass(UnservedCallError, LayoutError)  # a project error: call_backend passes it through


@pytest.mark.parametrize("rows,k,expected", [(64, 2048, "cooperative_topk"), (65, 2048, "persistent_topk"),
                                             (8, 100, "top_k_per_row_decode")])
def test_vllm_auto_resolves_as_vllm_does(rows, k, expected):
    backends, calls = engine_backends()
    logits = torch.randn(rows, 2100)
    out = backends["vllm.auto"].run(logits, torch.full((rows,), 2100, dtype=torch.int32), k)
    assert [c.name for c in calls["vllm"].calls] == [expected]
    assert values_of(logits, out, None) == values_of(logits, reference_topk(logits, torch.full((rows,), 2100,
                                                                              dtype=torch.int32), k), None)


@pytest.mark.parametrize("name", ["sglang.topk_v2", "sglang.topk_v2.ragged", "vllm.cooperative_topk"])
def test_a_row_stride_the_kernel_cannot_load_reaches_it_aligned(name):
    backends, calls = engine_backends()
    wide = torch.randn(4, 2103)
    logits = wide[:, :2101]  # row stride 2103 floats: not a multiple of 4
    out = backends[name].run(logits, torch.full((4,), 2101, dtype=torch.int32), 1024)
    fake = calls["vllm" if name.startswith("vllm") else "v2"]
    handed = [c for c in fake.calls if c.name != "plan_topk_v2"][0].args[0]
    assert handed.stride(0) % 4 == 0 and torch.equal(handed, logits)
    want = reference_topk(logits, torch.full((4,), 2101, dtype=torch.int32), 1024)
    assert values_of(logits, out, None) == values_of(logits, want, None)


def test_a_copy_for_alignment_is_said_once_with_its_reason(caplog, monkeypatch):
    from backends import adapted_topk

    monkeypatch.setattr(adapted_topk, "_COPY_REASONS_SAID", set())
    backends, _ = engine_backends()
    lengths = torch.full((4,), 2101, dtype=torch.int32)
    short = torch.empty_strided((4, 2101), (2104, 1)).normal_()  # storage ends at the last row's width
    with caplog.at_level("WARNING", logger="backends.adapted_topk"):
        for _ in range(3):
            backends["sglang.topk_v2"].run(short, lengths, 1024)
        backends["sglang.topk_v2"].run(torch.randn(4, 2103)[:, :2101], lengths, 1024)
        backends["sglang.topk_v2"].run(torch.randn(4, 2104)[:, :2101], lengths, 1024)  # readable: no copy
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "storage ends before the last row's width" in said[0] and "[4, 2101]" in said[0]
    assert "row stride is not a multiple" in said[1]


def test_vllm_kernels_get_per_row_lengths_the_width_as_bound_and_a_workspace():
    backends, calls = engine_backends()
    logits = torch.randn(3, 2500)
    lengths = torch.tensor([2500, 1, 2400], dtype=torch.int32)
    backends["vllm.persistent_topk"].run(logits, lengths, 2048)
    (call,) = calls["vllm"].calls
    handed_logits, handed_lengths, _, workspace, k, bound = call.args
    assert handed_logits is logits and torch.equal(handed_lengths, lengths) and handed_lengths.dim() == 1
    # The workspace is the kernels' scratch, allocated and not filled: one launch fewer, as vLLM hands it.
    assert (k, bound) == (2048, 2500) and workspace.numel() == 1024 * 1024 and workspace.dtype == torch.uint8


@pytest.mark.parametrize("view,expected", [
    (lambda wide: wide[:, :2100], "cooperative_topk"),  # stride 2104: a multiple of 4
    (lambda wide: wide[:, 1:2101], "persistent_topk"),  # the same stride, a base 4 bytes past 16-byte alignment
    (lambda wide: torch.randn(8, 2101)[:, :2100], "persistent_topk"),  # stride 2101
])
def test_vllm_auto_takes_cooperative_only_on_rows_it_loads_as_they_are(view, expected):
    # vLLM's _cooperative_constraints: logits.stride(0) % 4 == 0, else persistent_topk; it never copies to align.
    backends, calls = engine_backends()
    logits = view(torch.randn(8, 2104))
    lengths = torch.full((8,), 2100, dtype=torch.int32)
    out = backends["vllm.auto"].run(logits, lengths, 2048)
    (call,) = calls["vllm"].calls
    assert call.name == expected and call.args[0].data_ptr() == logits.data_ptr()
    assert values_of(logits, out, None) == values_of(logits, reference_topk(logits, lengths, 2048), None)


def test_a_last_row_whose_storage_ends_at_its_width_reaches_cooperative_copied():
    # cooperative_topk loads round_up(length, 4) floats of a row: stride 2104 keeps that inside every row but
    # the last, whose storage here stops 3 floats short of it, so the kernel gets a padded copy.
    backends, calls = engine_backends()
    storage = torch.randn(2 * 2104 + 2101)
    logits = storage.as_strided((3, 2101), (2104, 1))
    lengths = torch.full((3,), 2101, dtype=torch.int32)
    out = backends["vllm.cooperative_topk"].run(logits, lengths, 2048)
    handed = calls["vllm"].calls[0].args[0]
    assert handed.data_ptr() != logits.data_ptr() and torch.equal(handed, logits)
    rows, width = handed.shape
    assert handed.storage_offset() + (rows - 1) * handed.stride(0) + 2104 <= handed.untyped_storage().nbytes() // 4
    assert values_of(logits, out, None) == values_of(logits, reference_topk(logits, lengths, 2048), None)
    whole = torch.randn(3, 2104)
    backends["vllm.cooperative_topk"].run(whole[:, :2101], lengths, 2048)
    assert calls["vllm"].calls[1].args[0].data_ptr() == whole.data_ptr()  # the whole stride is there: no copy


def test_per_row_extend_gets_row_starts_and_ends():
    backends, calls = engine_backends()
    logits = torch.randn(2, 500)
    starts, lengths = torch.tensor([3, 100], dtype=torch.int32), torch.tensor([400, 50], dtype=torch.int32)
    backends["vllm.top_k_per_row"].run(logits, lengths, 64, starts=starts)
    (call,) = calls["vllm"].calls
    assert call.name == "top_k_per_row_prefill"
    assert call.args[1].tolist() == [3, 100] and call.args[2].tolist() == [403, 150]


def test_per_row_extend_hands_the_kernel_contiguous_row_starts():
    # A strided int32 view is a valid `starts` for the contract; vLLM's kernel indexes a raw pointer.
    backends, calls = engine_backends()
    logits = torch.randn(4, 600)
    pairs = torch.tensor([[3, 0], [100, 0], [0, 0], [250, 0]], dtype=torch.int32)
    starts, lengths = pairs[:, 0], torch.tensor([400, 50, 600, 300], dtype=torch.int32)
    out = backends["vllm.top_k_per_row"].run(logits, lengths, 64, starts=starts)
    (call,) = calls["vllm"].calls
    assert call.args[1].is_contiguous() and call.args[1].tolist() == [3, 100, 0, 250]
    for r in range(4):
        window = logits[r, starts[r]:starts[r] + lengths[r]]
        assert sorted(window[out[r][out[r] >= 0].long()].tolist()) == sorted(window.topk(min(64, len(window))).values.tolist())


def test_probes_say_why_they_cannot_run():
    def missing():
        raise ImportError("No module named 'sglang'")

    common = dict(archs=frozenset({Arch.SM90, Arch.SM100}), module="sglang", symbols=("plan_topk_v2",))
    assert "no CUDA GPU" in engine_topk_availability(host=Arch.SM90, gpu_visible=False, load=missing, **common).reason
    assert "this machine is sm89" in engine_topk_availability(host=Arch.SM89, gpu_visible=True, load=missing,
                                                              **common).reason
    assert "cannot be imported" in engine_topk_availability(host=Arch.SM90, gpu_visible=True, load=missing,
                                                            **common).reason
    assert engine_topk_availability(host=Arch.SM90, gpu_visible=True, load=FakeSglangV2, **common).ok
    ops = dict(archs=frozenset({Arch.SM90}), module="vllm._C", symbols=("cooperative_topk",))
    lacking = FakeVllmOps(missing=("cooperative_topk",))
    assert "has no `cooperative_topk`" in engine_topk_availability(host=Arch.SM90, gpu_visible=True,
                                                                   load=lambda: lacking, **ops).reason


def test_registering_imports_neither_torch_nor_the_engines():
    code = ("import sys; from backends.sglang_topk.plugin import register_backends as s; "
            "from backends.vllm_topk.plugin import register_backends as v; seen = []; s(seen.append); v(seen.append); "
            "print(sorted(b.name for b in seen)); print([m for m in ('torch', 'sglang', 'sgl_kernel', 'vllm') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == str(sorted(["sglang.topk_v2", "sglang.topk_v2.ragged", "sglang.fast_topk", "vllm.persistent_topk",
                                 "vllm.cooperative_topk", "vllm.top_k_per_row", "vllm.auto"]))
    assert out[1] == "[]"


def test_a_modules_loader_imports_it_once_and_retries_a_failed_import(monkeypatch):
    """Adapters load their engine's module on every call: the loader keeps it after the first import,
    and an import that failed (an engine installed later) is tried again, never remembered as missing."""
    import importlib
    import types

    tried = []
    module = types.ModuleType("engine_stand_in")

    def importing(name):
        tried.append(name)
        if len(tried) == 1:
            raise ImportError("not installed yet")
        return module

    monkeypatch.setattr(importlib, "import_module", importing)
    load = import_module("engine_stand_in")
    with pytest.raises(ImportError):
        load()
    assert load() is module and load() is module and tried == ["engine_stand_in"] * 2


def test_supports_name_the_modes_each_serves():
    backends, _ = engine_backends()
    extend = DispatchKey(Arch.SM90, ForwardMode.EXTEND, 1, Fp8Dtype.E4M3FN)
    verify = DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 4, Fp8Dtype.E4M3FN)
    assert "forward_mode extend not supported" in backends["sglang.topk_v2"].supports.why_not(extend)
    assert backends["sglang.topk_v2.ragged"].supports.why_not(extend) is None
    assert backends["vllm.top_k_per_row"].supports.why_not(extend) is None
    assert all(b.supports.why_not(verify) is None for b in backends.values())
    sm120 = DispatchKey(Arch.SM120, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN)
    assert "arch sm120 not supported" in backends["vllm.cooperative_topk"].supports.why_not(sm120)
    assert backends["vllm.persistent_topk"].supports.why_not(sm120) is None


def test_explain_lists_them_as_candidates_after_triton_and_flashinfer():
    out = subprocess.run([sys.executable, "-m", "dispatch", "explain", "--arch", "sm90", "--op", "topk"],
                         capture_output=True, text=True, check=True).stdout
    assert "sm90-cuda-radix-measured" in out  # sm90's paged modes: dispatch's CUDA top-k, then triton, flashinfer, the engines'
    for name in ("sglang.topk_v2", "vllm.auto", "vllm.cooperative_topk", "sglang.fast_topk"):
        assert f"{name} " in out


def test_bench_records_a_refused_call_as_cannot_serve_and_tune_never_prefers_it_nor_counts_a_failure():
    from dispatch.bench.runner import UNSERVED, Row
    from dispatch.bench.tune import Tuner

    refused = Row("topk", "vllm.cooperative_topk", "rows", "B=128")
    refused.failed(UnservedCallError("top-k backend `vllm.cooperative_topk` cannot serve this call: 128 rows"))
    wrong = Row("topk", "sglang.fast_topk", "rows", "B=128")
    wrong.failed(RuntimeError("illegal address"))
    assert refused.check.startswith(UNSERVED) and wrong.check.startswith("failed")
    fast = Row("topk", "triton", "rows", "B=8", seconds=20e-6, check="ok")
    faster = Row("topk", "vllm.cooperative_topk", "rows", "B=8", seconds=9e-6, check="ok")
    tuner = Tuner.__new__(Tuner)
    tuner.failures, tuner.started = 0, 0.0
    preference = tuner._preference([fast, faster, refused], ["triton", "vllm.cooperative_topk"])
    assert preference["order"] == ["triton"] and tuner.failures == 0


@pytest.mark.gpu
def test_real_engine_kernels_match_torch_topk_where_installed():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    real = [b for b in sglang_topk_backends() + vllm_topk_backends() if b.availability().ok]
    if not real:
        pytest.skip("neither SGLang nor vLLM is installed here")
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(1, 9000, (64,), generator=generator, device="cuda", dtype=torch.int32)
    logits = torch.randn(64, 9000, generator=generator, device="cuda")
    for backend in real:
        out = backend.run(logits, lengths, 2048)
        want = reference_topk(logits, lengths, 2048)
        assert values_of(logits.cpu(), out.cpu(), None) == values_of(logits.cpu(), want.cpu(), None), backend.name


def test_engine_stacks_name_what_each_engine_runs_for_the_step():
    from dispatch.bench.engine_stacks import engine_stacks, stack_of

    decode = DispatchKey(Arch.SM90, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN)
    verify2 = DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 2, Fp8Dtype.E4M3FN)
    verify4 = DispatchKey(Arch.SM90, ForwardMode.TARGET_VERIFY, 4, Fp8Dtype.E4M3FN)
    assert engine_stacks(decode) == {"SGLang": ("deepgemm.sm90", "sglang.topk_v2"),
                                     "vLLM": ("deepgemm.sm90", "vllm.auto")}
    assert engine_stacks(verify2)["SGLang"][0] == "deepgemm.sm90.flatten"  # SGLang: native only on SM100
    assert engine_stacks(verify2)["vLLM"][0] == "deepgemm.sm90"
    # vLLM 0.33's native_next_n_supported on SM90 is {1, 2, 4}: next_n 4 is the build's 2-CTA kernel, 3 flattens.
    assert engine_stacks(verify4)["vLLM"] == ("deepgemm.sm90.n4", "vllm.auto")
    verify3 = dataclasses.replace(verify4, next_n=3)
    assert engine_stacks(verify3)["vLLM"] == ("deepgemm.sm90.flatten", "vllm.auto")
    assert stack_of(verify4, "deepgemm.sm90.n4", "vllm.auto") == "vLLM's stack"
    assert stack_of(verify4, "deepgemm.sm90.flatten", "vllm.auto") is None
    assert stack_of(verify4, "deepgemm.sm90.flatten", "sglang.topk_v2") == "SGLang's stack"
    assert stack_of(verify4, "triton", "triton") is None
    assert engine_stacks(DispatchKey(Arch.SM89, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN)) == {}


@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100])
@pytest.mark.parametrize("next_n", range(1, 9))
def test_each_engine_stack_names_backends_that_serve_its_key(arch, next_n):
    # A stack row is only formed from eligible backends: a name that cannot serve the key would never be marked.
    from backends.deepgemm.plugin import deepgemm_backends
    from dispatch.bench.engine_stacks import engine_stacks

    backends = {(b.op, b.name): b for b in deepgemm_backends() + sglang_topk_backends() + vllm_topk_backends()}
    key = DispatchKey(arch, ForwardMode.TARGET_VERIFY, next_n, Fp8Dtype.E4M3FN)
    stacks = engine_stacks(key)
    assert set(stacks) == {"SGLang", "vLLM"}
    for logits_name, topk_name in stacks.values():
        assert backends[(Op.PAGED_MQA_LOGITS, logits_name)].supports.why_not(key) is None, (logits_name, key)
        assert backends[(Op.TOPK, topk_name)].supports.why_not(key) is None, (topk_name, key)
    native = stacks["vLLM"][0] != "deepgemm.sm90.flatten"
    assert native == (arch is Arch.SM100 or next_n in (1, 2, 4))  # vLLM 0.33's native_next_n_supported


def test_lengths_are_clamped_to_each_rows_window_without_a_host_tensor():
    from backends.adapted_topk import clamped_lengths

    logits = torch.zeros(3, 100)
    lengths = torch.tensor([150, -2, 60], dtype=torch.int32)
    assert clamped_lengths(logits, lengths, None).tolist() == [100, 0, 60]
    assert clamped_lengths(logits, lengths, torch.tensor([10, 0, 70], dtype=torch.int32)).tolist() == [90, 0, 30]


@pytest.mark.parametrize("with_starts,with_table", [(False, False), (True, False), (False, True), (True, True)])
def test_the_one_launch_finish_is_the_torch_finish(with_starts, with_table):
    # backends/triton/selection_finish.py (what a GPU runs) against backends/adapted_topk.finish_with_torch_ops:
    # exact, both keep or drop the same int32 positions and map them through the same table entries.
    from backends.adapted_topk import finish_with_torch_ops
    from backends.triton.selection_finish import finish_in_place

    # On a GPU the kernel runs compiled (launched with PDL on sm90+), on the CPU under the interpreter.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(5)
    rows, width, k = 7, 600, 50
    logits = torch.randn(rows, width, generator=generator)
    logits[2, ::3] = float("nan")
    logits[4] = float("nan")
    lengths = torch.randint(0, 400, (rows,), generator=generator, dtype=torch.int32)
    starts = torch.randint(0, 200, (rows,), generator=generator, dtype=torch.int32) if with_starts else None
    raw = torch.randint(-1, 420, (rows, k), generator=generator, dtype=torch.int32)  # some past the length
    table = torch.randint(0, 90, (4, 7), generator=generator, dtype=torch.int32) if with_table else None
    table_rows = torch.tensor([0, 1, 1, 2, 3, 3, 0], dtype=torch.int32) if with_table else None
    logits, lengths, raw = logits.to(device), lengths.to(device), raw.to(device)
    starts, table, table_rows = (t.to(device) if t is not None else None for t in (starts, table, table_rows))
    want = finish_with_torch_ops(logits, lengths, raw.clone(), page_table=table, page_rows=table_rows,
                                 block_size=64, sorted=False, starts=starts)
    got = finish_in_place(raw.clone(), logits, lengths, starts=starts, page_table=table, page_rows=table_rows,
                          block_size=64)
    assert torch.equal(got, want)


def test_fast_topk_refuses_rows_wider_than_it_answered_exactly():
    backends, calls = engine_backends()
    with pytest.raises(UnservedCallError, match="49152"):
        backends["sglang.fast_topk"].run(torch.randn(1, 49153), torch.tensor([10], dtype=torch.int32), 2048)
    assert not calls["sgl_kernel"].calls


@pytest.mark.gpu
def test_real_engine_kernels_replay_in_a_cuda_graph_on_fresh_logits():
    # As an engine runs the indexer: captured once, replayed with new logits written into the same buffer.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    real = [b for b in sglang_topk_backends() + vllm_topk_backends()
            if b.availability().ok and b.name != "sglang.topk_v2.ragged"]
    if not real:
        pytest.skip("neither SGLang nor vLLM is installed here")
    generator = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.randint(1, 5000, (48,), generator=generator, device="cuda", dtype=torch.int32)
    logits = torch.randn(48, 5004, generator=generator, device="cuda")[:, :5000]
    for backend in real:
        backend.run(logits, lengths, 2048)  # compile, plan and allocate outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.run(logits, lengths, 2048)
        logits.copy_(torch.randn(48, 5000, generator=generator, device="cuda"))
        graph.replay()
        want = reference_topk(logits, lengths, 2048)
        assert values_of(logits.cpu(), out.cpu(), None) == values_of(logits.cpu(), want.cpu(), None), backend.name


ENGINE_RUNS = ["sglang.topk_v2", "vllm.persistent_topk", "vllm.cooperative_topk", "vllm.top_k_per_row", "vllm.auto"]


@pytest.mark.parametrize("name", ENGINE_RUNS)
def test_engine_run_is_the_kernels_own_call_without_the_finish(name):
    """`engine_run` (bench's "engine's call" row) hands back what the engine itself gets from the kernel: the
    same selection where no NaN is visible, and a NaN the kernel ranked first left selected (the finish that
    `run` adds turns it into -1)."""
    backends, _ = engine_backends()
    logits, _, _ = ragged_rows(3, 2600, starts=False, seed=11)
    lengths = torch.tensor([2600, 2500, 900], dtype=torch.int32)
    logits[1, 7] = float("nan")
    own = backends[name].engine_run(logits, lengths, 512)
    served = backends[name].run(logits, lengths, 512)
    assert own.dtype == torch.int32 and own.shape == served.shape == (3, 512)
    assert values_of(logits[[0, 2]], own[[0, 2]], None) == values_of(logits[[0, 2]], served[[0, 2]], None)
    assert 7 in own[1].tolist() and 7 not in served[1].tolist()


def test_only_the_paged_and_vllm_kernels_have_an_engine_call():
    backends, _ = engine_backends()
    assert sorted(name for name, backend in backends.items() if backend.engine_run is not None) == sorted(ENGINE_RUNS)
