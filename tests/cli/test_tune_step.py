"""tune ranks the top-k at small batches by the whole step (Q quant and logits as decided, each top-k
candidate in turn) and says how every time was taken: the step's time orders those batch sizes'
bands, not the op's alone; a backend that fails in the step is never preferred; eager timing is named;
and on the CPU a whole tune with recording top-k backends writes an overlay that loads and that the
dispatcher and explain decide by."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from backends.reference.topk import topk_indices
from dispatch.bench.step import STEP
from dispatch.bench.tune import Tuner, measure_overlay
from dispatch.cli.explain import explain
from dispatch.contract import PAGED_MODES, Layout, Op
from dispatch.contract.backend import Backend, Support
from dispatch.contract.host import collect_backends
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode
from dispatch.deciding.runtime import build_dispatcher, load_plugins
from dispatch.registry.document import load_registry
from dispatch.registry.measured import parse_measured
from tests.support.fakes import fake_plugin
from tests.support.reference_registry import dispatcher_with_overlay, reference_registry


def _tuner() -> Tuner:
    tuner = object.__new__(Tuner)
    tuner.failures, tuner.say = 0, lambda text: None
    return tuner


def _row(backend: str, shape: str, us: float, *, step: bool = False, timing: str = "graph", check: str = "ok"):
    extra = {"timing": timing} | ({"stages": {"indexer_q_quant": "triton", "paged_mqa_logits": "deepgemm.sm90"}} if step else {})
    return SimpleNamespace(op=STEP if step else "topk", backend=backend, shape=shape, check=check, seconds=us / 1e6,
                           extra=extra)


B8, B128 = "B=8 N=4 L~8K H=64 D=128 k=2048", "B=128 N=4 L~8K H=64 D=128 k=2048"
# The H200's B=8 next_n 4 L~8K (2026-12-01): triton the fastest alone, the slowest in the step.
ALONE_B8 = {"triton": 12.0, "cuda.radix": 13.6, "sglang.topk_v2": 13.9}
STEP_B8 = {"triton": 29.2, "cuda.radix": 23.1, "sglang.topk_v2": 21.6}
ALONE_B128 = {"triton": 40.0, "cuda.radix": 30.0, "sglang.topk_v2": 33.0}
RULES = ["cuda.radix", "sglang.topk_v2", "triton"]


def _rows(step_b8=STEP_B8) -> list:
    return ([_row(name, B8, us) for name, us in ALONE_B8.items()] + [_row(name, B128, us) for name, us in ALONE_B128.items()]
            + [_row(name, B8, us, step=True) for name, us in step_b8.items()])


def test_the_small_batches_band_is_ordered_by_the_steps_time_not_the_ops():
    preference = _tuner()._preference(_rows(), RULES)
    assert preference["bands"] == [
        {"batch_size_up_to": 8, "order": ["sglang.topk_v2", "cuda.radix", "triton"], "ranked_by": "step"},
        {"batch_size_up_to": 128, "order": ["cuda.radix", "sglang.topk_v2", "triton"]},  # the op alone past the step's reach
    ]
    assert "ranked_by" not in preference  # the key's own order: the op alone over every shape
    assert preference["step_shapes"] == [{
        "shape": B8, "median_us": {"cuda.radix": 23.1, "sglang.topk_v2": 21.6, "triton": 29.2},
        "stages": {"indexer_q_quant": "triton", "paged_mqa_logits": "deepgemm.sm90"},
    }]
    assert preference["timing"] == "graph" and "timed_eagerly" not in preference
    alone = _tuner()._preference([row for row in _rows() if row.op != STEP], RULES)
    assert alone["bands"][0]["order"][0] == "triton" and "step_shapes" not in alone  # what the op alone said


def test_a_step_that_agrees_with_the_op_still_says_the_band_was_ranked_by_it():
    agreeing = {"triton": 20.0, "cuda.radix": 23.1, "sglang.topk_v2": 23.5}
    rows = [row for row in _rows(agreeing) if not (row.shape == B128 and row.op != STEP)]
    rows += [_row(name, B128, us) for name, us in {"triton": 20.0, "cuda.radix": 25.0, "sglang.topk_v2": 26.0}.items()]
    preference = _tuner()._preference(rows, RULES)
    assert [band.get("ranked_by") for band in preference["bands"]] == ["step", None]


def test_a_key_timed_in_the_step_at_every_shape_is_ranked_by_it():
    rows = [row for row in _rows() if row.shape == B8]
    preference = _tuner()._preference(rows, RULES)
    assert preference["ranked_by"] == "step" and preference["order"] == ["sglang.topk_v2", "cuda.radix", "triton"]
    assert "bands" not in preference  # one batch size: the key's order is the band


def test_a_backend_that_fails_in_the_step_is_never_preferred():
    rows = [row for row in _rows() if not (row.op == STEP and row.backend == "sglang.topk_v2")]
    rows.append(_row("sglang.topk_v2", B8, 0.0, step=True, check="failed: BackendError: wrote past the row"))
    tuner = _tuner()
    preference = tuner._preference(rows, RULES)
    assert preference["failed"] == {"sglang.topk_v2": f"failed: BackendError: wrote past the row at {B8} in the step"}
    assert "sglang.topk_v2" not in preference["order"] and tuner.failures == 1
    assert preference["bands"][0] == {"batch_size_up_to": 8, "order": ["cuda.radix", "triton"], "ranked_by": "step"}


def test_a_batch_size_the_step_timed_only_in_part_is_ranked_by_the_op():
    rows = [row for row in _rows() if not (row.op == STEP and row.backend == "triton")]  # triton's step never ran
    preference = _tuner()._preference(rows, RULES)
    assert "step_shapes" not in preference and all("ranked_by" not in band for band in preference.get("bands", []))


def test_eager_timing_is_named():
    rows = [_row(row.backend, row.shape, row.seconds * 1e6, step=row.op == STEP,
                 timing="eager" if row.backend == "sglang.topk_v2" and row.op == STEP else "graph") for row in _rows()]
    preference = _tuner()._preference(rows, RULES)
    assert (preference["timing"], preference["timed_eagerly"]) == ("graph", {"sglang.topk_v2": f"at {B8} in the step"})
    cpu = [_row(row.backend, row.shape, row.seconds * 1e6, step=row.op == STEP, timing="eager") for row in _rows()]
    preference = _tuner()._preference(cpu, RULES)
    assert preference["timing"] == "eager" and "timed_eagerly" not in preference


def test_the_cpu_times_eagerly_and_says_so():
    from dispatch.bench.timing import time_rotating

    seconds, method = time_rotating([lambda: sum(range(100))], on_gpu=False, repeats=3)
    assert method == "eager" and seconds > 0


# --- a whole tune on the CPU, with recording top-k backends ---

STEP_LAG_S = 0.03  # what `laggard` adds to every call: made up, far past the CPU step's noise


def _recording_topk(name: str, calls: list, lag_s: float) -> Backend:
    def run(logits, lengths, k, **options):
        calls.append((name, tuple(logits.shape)))
        time.sleep(lag_s)
        return topk_indices(logits, lengths, k, **options)

    return Backend(name=name, op=Op.TOPK, layout=Layout.ROWS, supports=Support(forward_modes=PAGED_MODES), run=run,
                   version="1")


REGISTRY = reference_registry("""\
  ci-cpu:
    disable: [triton, triton.flatten, torch.reference.flatten]
    workload: {batch_sizes: [2, 3], lengths: [160], next_n: [1], tokens: [8], k: [32], extend_requests: [1],
               extend_lens: [8], prefix_lens: [0]}
""")
DECODE = DispatchKey(Arch.CPU, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN)
# Alone, as the op's runner would have timed them (made up, and the opposite of the step): `laggard` the
# fastest, at both batch sizes.
ALONE_US = {"laggard": 5.0, "quick": 9.0, "torch.reference": 50.0}


@pytest.fixture(scope="module")
def stepped_tune(tmp_path_factory):
    """(folder, catalog, overlay text, each recording backend's calls): one tune, the step at B <= 2."""
    import dispatch.bench.runner as runner

    calls: list = []
    catalog = collect_backends(load_plugins() + [fake_plugin(
        "recording-topk", _recording_topk("quick", calls, 0.0), _recording_topk("laggard", calls, STEP_LAG_S))])
    folder = tmp_path_factory.mktemp("stepped")
    (folder / "registry.yaml").write_text(REGISTRY)
    dispatcher = build_dispatcher(load_registry(folder / "registry.yaml"), catalog, cluster="ci-cpu")
    real = runner.bench_topk

    def alone(*args, **kwargs):
        rows = real(*args, **kwargs)
        for row in rows:
            row.seconds = ALONE_US[row.backend] / 1e6
        return rows

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "bench_topk", alone)
        text, failures = measure_overlay(dispatcher, repeats=3, output=str(folder / "measured" / "ci-cpu.yaml"),
                                         step_up_to=2)
    assert failures == 0
    return folder, catalog, text, calls


def test_a_whole_tune_ranks_the_small_batch_by_the_step(stepped_tune):
    _, _, text, calls = stepped_tune
    preference = parse_measured(text).find(Op.TOPK, DECODE)[1]
    assert preference.timing == "eager"  # the CPU
    assert preference.order[0] == "laggard"  # over both batch sizes, the op alone
    small, large = preference.bands
    assert (small.batch_size_up_to, small.ranked_by, large.batch_size_up_to, large.ranked_by) == (2, "step", 3, "op")
    assert small.order.index("quick") < small.order.index("laggard")  # 30 ms later in every step
    assert large.order == ("laggard", "quick", "torch.reference")
    (step,) = preference.step_shapes
    assert step.shape == "B=2 N=1 L~160 H=64 D=128 k=32" and step.median_us["laggard"] > STEP_LAG_S * 1e6
    assert dict(step.stages) == {Op.INDEXER_Q_QUANT: "torch.reference", Op.PAGED_MQA_LOGITS: "torch.reference"}
    # Each recording backend ran inside the step on the step's own logits: 2 rows of the batch's width.
    assert {(name, shape[0]) for name, shape in calls} >= {("quick", 2), ("laggard", 2), ("quick", 3)}


def test_the_overlay_round_trips_and_the_dispatcher_and_explain_decide_by_the_step(stepped_tune):
    folder, catalog, text, _ = stepped_tune
    dispatcher = dispatcher_with_overlay(folder, REGISTRY, text, catalog)
    preference = dispatcher.document.measured["ci-cpu"].find(Op.TOPK, DECODE)[1]
    assert preference == parse_measured(text).find(Op.TOPK, DECODE)[1]
    small = dispatcher.decide(Op.TOPK, DECODE, batch_size=2)
    assert (small.backend, small.source, small.band) == (preference.bands[0].order[0], "measured", "B <= 2")
    assert small.evidence.ranked_by == "step" and small.evidence.batch_size == 2
    assert dispatcher.decide(Op.TOPK, DECODE, batch_size=3).backend == "laggard"
    block = explain(dispatcher, DECODE, ops=[Op.TOPK], batch_size=2).text()
    assert "  evidence: measured in the step on CPU (" in block and ", B=2: " in block and ", timed eagerly (" in block
    assert "measured slower in the step at B=2: " in block


# --- graph timing, on a simulated device: the host launches, the device runs what is queued ---


class _SimulatedGpu:
    """A host that spends `launch_s` on every launch and a device that runs each queued item once the
    host has launched it and the one before has finished (a replay takes `replay_s`, an event nothing)."""

    def __init__(self, launch_s: float, replay_s: float):
        self.launch_s, self.replay_s = launch_s, replay_s
        self.host_s = self.device_free_s = 0.0
        self.holds: list[float] = []

    def launch(self, work_s: float) -> float:
        self.host_s += self.launch_s
        start = max(self.device_free_s, self.host_s)
        self.device_free_s = start + work_s
        return start

    def install(self, patch) -> None:
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                self.at_s = None

            def record(self):
                self.at_s = gpu.launch(0.0)

            def elapsed_time(self, other) -> float:
                return (other.at_s - self.at_s) * 1e3  # ms, as CUDA's

        def sleep(cycles: int) -> None:
            gpu.holds.append(cycles / 2.5e9)
            gpu.launch(cycles / 2.5e9)

        def synchronize() -> None:
            gpu.host_s = max(gpu.host_s, gpu.device_free_s)

        patch.setattr(torch.cuda, "Event", Event)
        patch.setattr(torch.cuda, "_sleep", sleep)
        patch.setattr(torch.cuda, "synchronize", synchronize)
        patch.setattr("dispatch.bench.timing.time.perf_counter", lambda: gpu.host_s)

    def graph(self):
        return SimpleNamespace(replay=lambda: self.launch(self.replay_s))


def test_replays_held_behind_the_host_time_the_device_not_the_launches(monkeypatch):
    from dispatch.bench.timing import time_cuda, time_graph

    gpu = _SimulatedGpu(launch_s=6e-6, replay_s=7e-6)  # an event pair and a replay: 18 us of host a call
    gpu.install(monkeypatch)
    graph = gpu.graph()
    one_at_a_time = time_cuda(graph.replay, repeats=20)  # the start event runs, then the device waits for the replay
    assert one_at_a_time == pytest.approx(13e-6)
    assert time_graph(graph, repeats=20) == pytest.approx(7e-6) and len(gpu.holds) == 1


def test_a_hold_that_runs_out_is_doubled_and_the_replays_timed_again(monkeypatch):
    from dispatch.bench import timing

    gpu = _SimulatedGpu(launch_s=6e-6, replay_s=7e-6)
    gpu.install(monkeypatch)
    held = timing._held_replays

    def slower_host(graph, repeats, hold_s):  # the host slows down after the hold was sized from it
        gpu.launch_s = 40e-6
        return held(graph, repeats, hold_s)

    monkeypatch.setattr(timing, "_held_replays", slower_host)
    assert timing.time_graph(gpu.graph(), repeats=20) == pytest.approx(7e-6)
    assert len(gpu.holds) == 2 and gpu.holds[1] == pytest.approx(2 * gpu.holds[0], rel=1e-6)


def test_a_step_limit_below_zero_is_a_usage_error(capsys):
    from dispatch.cli.commands import main

    assert main(["tune", "--quick", "--step-up-to", "-1"]) == 2
    assert "argument --step-up-to: -1 is out of range; it must be from 0 to 1024" in capsys.readouterr().err


@pytest.mark.gpu
def test_on_a_gpu_held_replays_of_a_small_call_time_less_than_one_at_a_time():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dispatch.bench.timing import _captured, time_cuda, time_graph

    x = torch.ones(1 << 16, device="cuda")
    graph = _captured([lambda: x.add_(1).mul_(0.5).add_(1).mul_(0.5)])  # four small kernels, a few us
    one_at_a_time = time_cuda(graph.replay, repeats=50)
    held = time_graph(graph, repeats=50)
    assert 0 < held <= one_at_a_time
