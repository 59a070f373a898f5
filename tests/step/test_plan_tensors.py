"""build_plan through a logits backend's `plan_tensors` (the plan's lengths, flags and that backend's state
in one host call), on the CPU with recording fakes: the plan takes exactly what it returns, the
backend's `prepare` is not called, the other ops' prepares still are and see those tensors; None sends
the plan down the usual path; a flatten decision never asks; a failure names the backend; prepare=False
asks nothing. The one-launch kernel itself, against the Triton launches, is tests/backends/test_plan_prepare.py
(GPU); here, that the extension says why it is not there and the backends' warm-ups keep them available."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.shared import plan_extension
from dispatch.contract import BackendError, PlanTensors
from dispatch.contract.backend import Availability
from dispatch.contract.key import Arch, ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.step.paged_plan import PagedBatch, build_plan, visible_lengths
from tests.support.fakes import catalog_of, dispatcher, fake_backend

SEQ_LENS = torch.tensor([5, 9, 3], dtype=torch.int32)
PAGES = torch.tensor([[10, 11], [20, 21], [30, 31]], dtype=torch.int32)
REGISTRY = """\
version: 1
ops:
  paged_mqa_logits:
    rules:
      - id: verify
        when: {forward_mode: draft_extend}
        use: [fused.flatten]
    fallback: [fused]
  indexer_q_quant:
    fallback: [quant]
  topk:
    fallback: [topk]
  ragged_mqa_logits:
    fallback: [topk]
"""


def _batch(mode=ForwardMode.TARGET_VERIFY, pool=64) -> PagedBatch:
    return PagedBatch(seq_lens=SEQ_LENS, page_table=PAGES, max_seq_len=9, forward_mode=mode, next_n=2, num_kv_blocks=pool)


class Recorder:
    def __init__(self, answer="tensors"):
        self.answer, self.asked, self.prepared, self.topk_saw = answer, [], [], []

    def plan_tensors(self, **batch):
        self.asked.append(batch)
        if self.answer is None:
            return None
        if self.answer == "raise":
            raise RuntimeError("the launch failed")
        lens = visible_lengths(batch["seq_lens"], batch["next_n"]) + 0  # a fresh tensor the plan must carry
        readable = lens.reshape(-1).clamp(max=batch["max_context_len"]) + 0
        return PlanTensors(lens, torch.full((1,), 7, dtype=torch.int32), {"made": "in one call"}, readable)

    def prepare(self, plan):
        self.prepared.append(plan)
        return {"made": "by prepare"}

    def topk_prepare(self, plan):
        self.topk_saw.append(plan.context_lens)
        return "topk state"

    def chooser(self):
        fused = dataclasses.replace(fake_backend("fused", prepare=self.prepare), plan_tensors=self.plan_tensors)
        flatten = dataclasses.replace(fake_backend("fused.flatten", layout=Layout.FLATTEN, prepare=self.prepare),
                                      plan_tensors=self.plan_tensors)
        catalog = catalog_of(fused, flatten, fake_backend("quant", Op.INDEXER_Q_QUANT),
                             fake_backend("topk", Op.TOPK, prepare=self.topk_prepare),
                             fake_backend("topk", Op.RAGGED_MQA_LOGITS))
        return dispatcher(REGISTRY, catalog, arch=Arch.CPU)


def test_the_plan_carries_what_plan_tensors_made_and_skips_that_prepare():
    recorder = Recorder()
    plan = build_plan(recorder.chooser(), _batch(), kv_fp8_dtype="e4m3fn")
    assert recorder.asked == [dict(seq_lens=SEQ_LENS, page_table=PAGES, next_n=2, max_context_len=9, num_kv_blocks=64)]
    assert recorder.prepared == []
    assert plan.state == {"made": "in one call"} and plan.state_of(Op.TOPK) == "topk state"
    assert int(plan.error_flags) == 7 and plan.block_table is PAGES
    assert torch.equal(plan.context_lens, visible_lengths(SEQ_LENS, 2))
    assert recorder.topk_saw == [plan.context_lens]  # the other ops prepare on the very tensors
    assert plan.readable_token_lengths() is plan.readable_lengths and plan.readable_lengths is not None


def test_none_takes_the_usual_path():
    recorder = Recorder(answer=None)
    plan = build_plan(recorder.chooser(), _batch(pool=None), kv_fp8_dtype="e4m3fn")
    assert len(recorder.asked) == 1 and recorder.asked[0]["num_kv_blocks"] is None
    assert len(recorder.prepared) == 1 and recorder.prepared[0].context_lens is plan.context_lens
    assert plan.state == {"made": "by prepare"} and int(plan.error_flags) == 0
    assert plan.readable_lengths is None  # the usual path cuts the lengths where a top-k asks


def test_readable_lengths_are_the_token_lengths_cut_to_the_logits_width_on_either_path():
    """A past-bound length (the engine's error, flagged by the guard) is cut to max_context_len, so a
    top-k that trusts its lengths reads inside its row; the one call's tensor and the usual path's clamp
    hold the same values."""
    hostile = _batch()
    # Request 1 (length 9) past the bound, after the batch's own check: lengths on a GPU are not read there.
    object.__setattr__(hostile, "max_seq_len", 7)
    for answer in ("tensors", None):
        plan = build_plan(Recorder(answer=answer).chooser(), hostile, kv_fp8_dtype="e4m3fn")
        readable = plan.readable_token_lengths()
        assert readable.dtype == torch.int32
        assert readable.tolist() == [4, 5, 7, 7, 2, 3], answer


def test_a_flatten_decision_and_a_what_if_never_ask():
    recorder = Recorder()
    flatten = build_plan(recorder.chooser(), _batch(ForwardMode.DRAFT_EXTEND), kv_fp8_dtype="e4m3fn")
    assert flatten.layout is Layout.FLATTEN and recorder.asked == [] and len(recorder.prepared) == 1
    described = build_plan(recorder.chooser(), _batch(), kv_fp8_dtype="e4m3fn", prepare=False)
    assert recorder.asked == [] and described.states == {}


def test_a_failing_plan_tensors_names_the_backend():
    with pytest.raises(BackendError, match=r"backend `fused`.*RuntimeError preparing a batch for paged_mqa_logits"):
        build_plan(Recorder(answer="raise").chooser(), _batch(), kv_fp8_dtype="e4m3fn")


def test_without_a_gpu_the_extension_says_why_and_warm_ups_keep_backends_available(monkeypatch):
    monkeypatch.setattr(plan_extension._Loaded, "why_not", None)
    monkeypatch.setattr(plan_extension._Loaded, "module", None)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the GPU tests cover the built extension")
    assert plan_extension.loaded() is None
    assert plan_extension.why_not_loaded() == "no CUDA device visible to torch"
    warm_up = plan_extension.logits_warm_up(Availability.yes)
    assert warm_up() == Availability(True, "plans take the Triton launches: no CUDA device visible to torch")
    ruled_out = plan_extension.logits_warm_up(lambda: Availability.no("deep_gemm is not installed"))
    assert ruled_out() == Availability.no("deep_gemm is not installed")


def test_a_built_library_that_does_not_load_leaves_the_triton_launches(monkeypatch, tmp_path):
    """warm() where the build succeeded but the library cannot be imported: no module, the reason kept,
    and the backends' warm-up still available (their plans take the Triton launches)."""
    from backends.cuda_topk import build

    facts = build.MachineFacts(rocm=False, gpu_visible=True, arch=None, capability=(9, 0), nvcc="/usr/bin/nvcc",
                               nvcc_version="13.0", torch_cuda="13.0", torch_version=torch.__version__)
    monkeypatch.setattr(plan_extension, "machine_facts", lambda: facts)
    monkeypatch.setattr(plan_extension, "cuda_topk_availability", lambda facts, cached: Availability.yes())
    monkeypatch.setenv("DISPATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_extension, "built_library", lambda slot, build, wait_s: tmp_path / "broken.so")

    def refuse(name, path):
        raise ImportError(f"undefined symbol in {path.name}")

    monkeypatch.setattr(plan_extension, "load_library", refuse)
    monkeypatch.setattr(plan_extension._Loaded, "module", None)
    monkeypatch.setattr(plan_extension._Loaded, "why_not", None)
    assert plan_extension.warm() == Availability.no("its built library did not load: ImportError: undefined symbol in broken.so")
    assert plan_extension.loaded() is None
    assert plan_extension.logits_warm_up(Availability.yes)() == Availability(
        True, "plans take the Triton launches: its built library did not load: ImportError: undefined symbol in broken.so")


def test_a_graph_update_rewrites_the_captured_plans_readable_lengths_or_puts_them_back():
    """A captured plan made by the one call keeps its readable lengths equal to its lengths: an update
    writes the fresh batch's into them in place, and one a backend refuses puts the old ones back."""
    from dispatch.engines.graphs import refresh_captured_plan

    chooser = Recorder().chooser()
    refused = []

    def refresh_state(captured_state, fresh_state):
        if refused and fresh_state is not captured_state:
            raise RuntimeError("refused")

    captured = _refreshable(build_plan(chooser, _batch(), kv_fp8_dtype="e4m3fn"), refresh_state)
    readable = captured.readable_lengths
    shorter = dataclasses.replace(_batch(), seq_lens=torch.tensor([3, 4, 2], dtype=torch.int32))
    refresh_captured_plan(captured, shorter, build_plan(chooser, shorter, kv_fp8_dtype="e4m3fn"))
    assert captured.readable_lengths is readable and readable.tolist() == [2, 3, 3, 4, 1, 2]
    before, refused[:] = readable.clone(), [True]
    with pytest.raises(RuntimeError, match="refused"):
        refresh_captured_plan(captured, _batch(), build_plan(chooser, _batch(), kv_fp8_dtype="e4m3fn"))
    assert torch.equal(readable, before)


def _refreshable(plan, refresh_state):
    """`plan` whose backends with a per-batch state refresh it through `refresh_state`."""
    decisions = {op: dataclasses.replace(decision, impl=dataclasses.replace(decision.impl, refresh_state=refresh_state))
                 for op, decision in plan.decisions.items()}
    return dataclasses.replace(plan, decisions=decisions)


class _Refusing:
    """The built launch where it does not take a batch (plan_prepare.cu's servable): no tensors."""

    def __init__(self):
        self.calls = []

    def triton_prepare(self, *args):
        self.calls.append(args)
        return []

    deepgemm_prepare = triton_prepare


def test_a_batch_the_launch_does_not_take_sends_the_plan_to_the_triton_launches(monkeypatch):
    """Which batches the one launch serves is its own question, asked in C++ (each Python tensor query
    costs a GPU's host a fraction of a microsecond, every batch): an empty answer is None, both paths."""
    from backends.deepgemm import plan_tensors as deepgemm_tensors
    from backends.deepgemm.guard_and_schedule import ScheduleRule
    from backends.triton.plan_tensors import triton_plan_tensors

    refusing = _Refusing()
    monkeypatch.setattr("backends.triton.plan_tensors.loaded", lambda: refusing)
    monkeypatch.setattr(deepgemm_tensors, "loaded", lambda: refusing)
    monkeypatch.setattr(deepgemm_tensors, "_rule_of", lambda module: ScheduleRule(False, None, "test"))
    batch = dict(seq_lens=SEQ_LENS, page_table=PAGES, next_n=2, max_context_len=9, num_kv_blocks=64)
    assert triton_plan_tensors(**batch) is None

    class Paged:
        layout, sm90_schedule = Layout.NATIVE, True

        def load(self):
            return object()

        def schedule_slots(self, module, device):
            return 4

    assert deepgemm_tensors.deepgemm_plan_tensors(Paged(), **batch) is None
    assert len(refusing.calls) == 2 and all(call[0] is SEQ_LENS and call[1] is PAGES for call in refusing.calls)
