"""The workload's named shapes: `shapes` (paged batches beside the grid) and `extend_batches` (extend
batches whose requests' prefixes spread), validated with located errors and in the JSON schema; a whole
tune on the CPU measures them as it measures the grid's (the paged logits, the top-k alone, the step's
ranking at B <= --step-up-to, the extend key), and writes length sub-bands where the fastest differs
between a batch size's lengths, which the dispatcher and explain then decide by."""

from __future__ import annotations

import pytest

from backends.reference.topk import topk_indices
from dispatch.bench.step import STEP
from dispatch.bench.tune import measure_overlay
from dispatch.bench.workload import LogitsShape, RaggedShape, paged_shapes
from dispatch.cli.explain import explain
from dispatch.contract import PAGED_MODES, Layout, Op
from dispatch.contract.backend import Backend, Support
from dispatch.contract.errors import RegistryError
from dispatch.contract.host import collect_backends
from dispatch.contract.key import Arch, DispatchKey, Fp8Dtype, ForwardMode
from dispatch.deciding.runtime import build_dispatcher, load_plugins
from dispatch.registry.document import load_registry, parse_registry
from dispatch.registry.measured import parse_measured
from dispatch.registry.models import Registry, Workload
from tests.support.fakes import fake_plugin
from tests.support.reference_registry import dispatcher_with_overlay, reference_registry

# --- validation ---------------------------------------------------------------------------------------

WORKLOAD = "    workload: {batch_sizes: [8, 32], lengths: [8192], next_n: [1, 2]"


def _registry(extra: str) -> str:
    return reference_registry(f"  tuned:\n{WORKLOAD}{extra}}}\n")


def test_named_shapes_and_spread_batches_are_read():
    document = parse_registry(_registry(
        ", shapes: [{batch_size: 64, next_n: 4, length: 65536}, {batch_size: 8, next_n: 1, length: 2048}],"
        " extend_batches: [{requests: 16, extend: 256, prefix_up_to: 15360}]"))
    workload = document.registry.clusters["tuned"].workload
    assert [(s.batch_size, s.next_n, s.length) for s in workload.shapes] == [(64, 4, 65536), (8, 1, 2048)]
    assert workload.paged_next_n() == (1, 2, 4)  # a named shape's next_n is measured too
    (spread,) = workload.extend_batches
    assert spread.prefixes() == tuple(range(0, 15361, 1024))  # 4096 rows of windows 1 .. 16K


@pytest.mark.parametrize("extra, location, message", [
    (", shapes: [{batch_size: 8, next_n: 2, length: 8192}]", "shapes[0]",
     "(B=8, next_n=2, length=8192) is in the grid (batch_sizes x next_n x lengths) already"),
    (", shapes: [{batch_size: 9, next_n: 2, length: 8192},\n               {batch_size: 9, next_n: 2, length: 8192}]",
     "shapes[1]", "repeats shapes[0]: each shape is measured once"),
    (", shapes: [{batch_size: 0, next_n: 2, length: 8192}]", "shapes[0].batch_size", "greater than or equal to 1"),
    (", shapes: [{batch_size: 8, next_n: 65, length: 8192}]", "shapes[0].next_n", "less than or equal to 64"),
    (", shapes: [{batch_size: 8, next_n: 1, length: 2097152}]", "shapes[0].length", "less than or equal to 1048576"),
    (", shapes: [{batch_size: 8, next_n: 1}]", "shapes[0].length", "required field is missing"),
    (", shapes: [{batch_size: 8, next_n: 1, length: 64, heads: 8}]", "shapes[0].heads", "unknown field"),
    (", extend_batches: [{requests: 1, extend: 256, prefix_up_to: 1024}]", "extend_batches[0].requests",
     "greater than or equal to 2"),
    (", extend_batches: [{requests: 64, extend: 4096, prefix_up_to: 65536}]", "extend_batches[0]",
     "has fp32 logits [M=262144, S=2359265] of 2304.0 GiB, more than the 8 GiB tune holds per batch"),
    (", extend_batches: [{requests: 2, extend: 8, prefix_up_to: 8}, {requests: 2, extend: 8, prefix_up_to: 8}]",
     "extend_batches[1]", "repeats extend_batches[0]: each batch is measured once"),
])
def test_a_bad_item_is_refused_at_its_line_by_name(extra, location, message):
    text = _registry(extra)
    with pytest.raises(RegistryError) as raised:
        parse_registry(text, "registry.yaml")
    first = str(raised.value).splitlines()[0]
    line = text.count("\n", 0, text.index("{batch_size: 9", text.index("{batch_size: 9") + 1)) + 1 if "repeats shapes" in message \
        else text.count("\n", 0, text.index(WORKLOAD)) + 1
    assert first.startswith(f"registry.yaml:{line}: clusters.tuned.workload.{location}: "), first
    assert message in first, first


def test_at_most_sixteen_named_shapes():
    shapes = [{"batch_size": 1 + i, "next_n": 1, "length": 100} for i in range(17)]
    with pytest.raises(ValueError, match="at most 16 items"):
        Workload(shapes=shapes)


def test_the_json_schema_has_the_named_shapes_and_the_sub_bands():
    from dispatch.registry.measured import MeasuredOverlay

    workload = Registry.model_json_schema()["$defs"]["Workload"]["properties"]
    assert {"shapes", "extend_batches"} <= set(workload) and workload["shapes"]["maxItems"] == 16
    defs = Registry.model_json_schema()["$defs"]
    assert set(defs["PagedShape"]["required"]) == {"batch_size", "next_n", "length"}
    assert set(defs["SpreadExtendBatch"]["required"]) == {"requests", "extend", "prefix_up_to"}
    band = MeasuredOverlay.model_json_schema()["$defs"]["Band"]["properties"]
    assert band["lengths"]["maxItems"] == 16


def test_the_grid_then_the_named_shapes_of_each_next_n():
    workload = Workload(batch_sizes=(8,), lengths=(8192,), next_n=(1,),
                        shapes=({"batch_size": 64, "next_n": 4, "length": 65536}, {"batch_size": 1, "next_n": 1, "length": 2048}))
    assert paged_shapes(workload, 1) == [LogitsShape(8, 1, 8192), LogitsShape(1, 1, 2048)]
    assert paged_shapes(workload, 4) == [LogitsShape(64, 4, 65536)]  # no grid at a next_n the grid does not name
    assert LogitsShape(8, 1, 3000).label() == "B=8 N=1 L~3000 H=64 D=128"  # exact: sub-bands are found from it
    spread = RaggedShape(16, 256, prefix_up_to=15360)
    assert (spread.rows, spread.keys, spread.label()) == (4096, 126976, "M=4K S=124K R=16 P=0..15K H=64 D=128")


# --- a whole tune on the CPU, recording what it measured ----------------------------------------------


def _recording_topk(name: str) -> Backend:
    def run(logits, lengths, k, **options):
        return topk_indices(logits, lengths, k, **options)

    return Backend(name=name, op=Op.TOPK, layout=Layout.ROWS,
                   supports=Support(forward_modes=PAGED_MODES | {ForwardMode.EXTEND}), run=run, version="1")


REGISTRY = reference_registry("""\
  ci-cpu:
    disable: [triton, triton.flatten]
    workload: {batch_sizes: [2], lengths: [160], next_n: [1], tokens: [8], k: [32], extend_requests: [1],
               extend_lens: [8], prefix_lens: [0],
               shapes: [{batch_size: 2, next_n: 1, length: 640}, {batch_size: 3, next_n: 1, length: 96},
                        {batch_size: 2, next_n: 2, length: 64}],
               extend_batches: [{requests: 2, extend: 8, prefix_up_to: 16}]}
""")
DECODE = DispatchKey(Arch.CPU, ForwardMode.DECODE, 1, Fp8Dtype.E4M3FN)
VERIFY = DispatchKey(Arch.CPU, ForwardMode.TARGET_VERIFY, 2, Fp8Dtype.E4M3FN)
EXTEND = DispatchKey(Arch.CPU, ForwardMode.EXTEND, 1, Fp8Dtype.E4M3FN)
# Made up, so the orders are the test's: alone `quick` leads everywhere; in the step `quick` leads at
# L~160 and `wide` at L~640 (as SGLang's v2 leads short rows and cuda.radix long ones).
ALONE_US = {"quick": 5.0, "wide": 9.0, "torch.reference": 50.0}
STEP_US = {"L~160": {"quick": 10.0, "wide": 20.0, "torch.reference": 50.0},
           "L~640": {"quick": 20.0, "wide": 10.0, "torch.reference": 50.0},
           "L~64": {"quick": 10.0, "wide": 12.0, "torch.reference": 50.0}}


@pytest.fixture(scope="module")
def shaped_tune(tmp_path_factory):
    """(folder, catalog, overlay text, {op: labels measured}): one tune of the named shapes, the step at B <= 2."""
    import dispatch.bench.runner as runner
    import dispatch.bench.step as step

    measured: dict[str, list[str]] = {}
    catalog = collect_backends(load_plugins() + [fake_plugin("recording-topk", _recording_topk("quick"),
                                                             _recording_topk("wide"))])
    folder = tmp_path_factory.mktemp("shaped")
    (folder / "registry.yaml").write_text(REGISTRY)
    dispatcher = build_dispatcher(load_registry(folder / "registry.yaml"), catalog, cluster="ci-cpu")

    def recorded(name, real, times):
        def run(*args, **kwargs):
            rows = real(*args, **kwargs)
            for row in rows:
                measured.setdefault(name, []).append(row.shape)
                if times is not None and row.check == "ok":
                    row.seconds = times(row) / 1e6
            return rows
        return run

    length = lambda row: next(part for part in row.shape.split() if part.startswith("L~"))  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "bench_topk", recorded("topk", runner.bench_topk, lambda row: ALONE_US[row.backend]))
        patch.setattr(runner, "bench_logits", recorded("logits", runner.bench_logits, None))
        patch.setattr(runner, "bench_ragged_topk", recorded("extend topk", runner.bench_ragged_topk, None))
        patch.setattr(step, "bench_step_topk", recorded("step", step.bench_step_topk,
                                                        lambda row: STEP_US[length(row)][row.backend]))
        text, failures = measure_overlay(dispatcher, repeats=3, output=str(folder / "measured" / "ci-cpu.yaml"),
                                         step_up_to=2)
    assert failures == 0
    return folder, catalog, text, measured


def _labels(labels: list[str]) -> list[str]:
    return list(dict.fromkeys(" ".join(label.split()[:3]) for label in labels))


def test_tune_measures_the_grid_then_the_named_shapes_in_every_op(shaped_tune):
    _, _, _, measured = shaped_tune
    paged = ["B=2 N=1 L~160", "B=2 N=1 L~640", "B=3 N=1 L~96", "B=2 N=2 L~64"]
    assert _labels(measured["logits"]) == paged
    assert _labels(measured["topk"]) == paged
    assert _labels(measured["step"]) == ["B=2 N=1 L~160", "B=2 N=1 L~640", "B=2 N=2 L~64"]  # B <= --step-up-to
    assert {label.split(" H=")[0] for label in measured["extend topk"]} == {"M=8 S=8 R=1", "M=16 S=32 R=2 P=0..16"}


def test_the_overlay_holds_the_named_shapes_and_length_sub_bands(shaped_tune):
    _, _, text, _ = shaped_tune
    overlay = parse_measured(text)
    assert [(s.batch_size, s.next_n, s.length) for s in overlay.overlay.workload.shapes] == [(2, 1, 640), (3, 1, 96), (2, 2, 64)]
    decode = overlay.find(Op.TOPK, DECODE)[1]
    small, large = decode.bands
    assert (small.batch_size_up_to, small.ranked_by, large.batch_size_up_to, large.ranked_by) == (2, "step", 3, "op")
    assert [(sub.max_seq_len_up_to, sub.order[0], sub.ranked_by) for sub in small.lengths] == [
        (240, "quick", "step"), (960, "wide", "step")]  # 3L/2 of L~160 and of L~640
    assert large.lengths == ()  # one length measured at B=3
    verify = overlay.find(Op.TOPK, VERIFY)[1]  # a next_n only a named shape measures
    assert [s.shape for s in verify.shapes] == ["B=2 N=2 L~64 H=64 D=128 k=32"] and verify.ranked_by == "step"
    extend = overlay.find(Op.TOPK, EXTEND)[1]
    assert "M=16 S=32 R=2 P=0..16 H=64 D=128 k=32" in [s.shape for s in extend.shapes]
    assert all(not band.lengths for band in extend.bands)  # the extend key's bands are by R alone


def test_the_dispatcher_and_explain_decide_by_the_tuned_sub_bands(shaped_tune):
    folder, catalog, text, _ = shaped_tune
    dispatcher = dispatcher_with_overlay(folder, REGISTRY, text, catalog)
    short = dispatcher.decide(Op.TOPK, DECODE, batch_size=2, max_seq_len=240)
    long = dispatcher.decide(Op.TOPK, DECODE, batch_size=2, max_seq_len=241)
    assert (short.backend, short.band, long.backend, long.band) == ("quick", "B <= 2, rows <= 240", "wide", "B <= 2, rows > 240")
    assert dispatcher.decide(Op.TOPK, DECODE, batch_size=3, max_seq_len=241).backend == "quick"
    block = explain(dispatcher, DECODE, ops=[Op.TOPK], batch_size=2, max_seq_len=500).text()
    assert "measured[0] for B <= 2, rows > 240 (" in block and "at B=2 N=1 L~640" in block
    assert "measured slower in the step at B=2, rows > 240: 20.0 us vs 10.0 us (wide)" in block


def test_the_table_check_reads_every_shape_of_the_issues_table_from_the_shipped_overlay():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "table_topk.py"
    spec = importlib.util.spec_from_file_location("table_topk", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    from dispatch.deciding.runtime import load_dispatcher

    dispatcher = load_dispatcher(cluster="h200-mtp", arch="sm90", check_availability=False, device_name="NVIDIA H200")
    lines = table.rows(dispatcher)
    assert len(lines) == len(table.TABLE) + 1 and all(" decided " in line for line in lines)
    assert lines[0].startswith("B=128 N=4 L~32K ") and lines[-1].startswith("M=4K S=124K R=16 P=0..15K ")
    assert all(("shape not measured" in line) or (" us vs " in line) for line in lines)
