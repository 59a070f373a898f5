"""tools/plot_bench.py: the bench report's rows parsed into one line per (backend, batch size) per
(op, next_n) panel, and each line's ratio to the fastest backend, always; the picture drawn only where
matplotlib is installed (a development tool)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_bench.py"


@pytest.fixture(scope="module")
def plot_bench():
    spec = importlib.util.spec_from_file_location("plot_bench", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(op, backend, shape, us):
    return {"op": op, "backend": backend, "shape": shape, "median_us": us, "check": "ok" if us else "failed: x"}


REPORT = {
    "machine": "NVIDIA H200",
    "date": "2026-11-30",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "rows": [
        row("paged_mqa_logits", "triton", "B=128 N=1 L~32K H=64 D=128", 161.9),
        row("paged_mqa_logits", "triton", "B=128 N=1 L~8K H=64 D=128", 49.2),
        row("paged_mqa_logits", "deepgemm.sm90", "B=128 N=1 L~32K H=64 D=128", 202.6),
        row("paged_mqa_logits", "triton", "B=32 N=4 L~512 H=64 D=128", 20.0),
        row("paged_mqa_logits", "triton.flatten", "B=32 N=4 L~512 H=64 D=128", None),  # failed: no time
        row("topk", "torch.reference", "B=128 N=1 L~32K H=64 D=128 k=2048", 900.0),
        row("indexer_q_quant", "triton", "T=16384 H=64 D=128 rot=64", 114.4),  # no length: not drawn
    ],
}


def test_shape_fields(plot_bench):
    assert plot_bench.shape_fields("B=128 N=4 L~32K H=64 D=128") == (128, 4, 32768)
    assert plot_bench.shape_fields("B=2 N=1 L~256 H=64 D=128 k=64") == (2, 1, 256)
    assert plot_bench.shape_fields("T=64 H=64 D=128 rot=64") is None


def test_series_groups_by_panel_and_line_sorted_by_length(plot_bench):
    panels = plot_bench.series(REPORT)
    assert set(panels) == {("paged_mqa_logits", 1), ("paged_mqa_logits", 4), ("topk", 1)}
    assert panels[("paged_mqa_logits", 1)] == {
        ("triton", 128): [(8192, 49.2), (32768, 161.9)],
        ("deepgemm.sm90", 128): [(32768, 202.6)],
    }
    assert panels[("paged_mqa_logits", 4)] == {("triton", 32): [(512, 20.0)]}  # the untimed row is left out
    assert panels[("topk", 1)] == {("torch.reference", 128): [(32768, 900.0)]}


def test_ratios_are_against_the_fastest_backend_at_each_batch_and_length(plot_bench):
    lines = plot_bench.series(REPORT)[("paged_mqa_logits", 1)]
    assert plot_bench.ratios(lines) == {
        ("triton", 128): [(8192, 1.0), (32768, 1.0)],  # 49.2 was timed alone; 161.9 the fastest at 32K
        ("deepgemm.sm90", 128): [(32768, 202.6 / 161.9)],  # the same division on both sides: exact
    }


def test_ratios_compare_only_within_a_batch_size(plot_bench):
    lines = {("a", 1): [(256, 2.0), (512, 4.0)], ("b", 1): [(256, 1.0)], ("a", 8): [(256, 8.0)]}
    assert plot_bench.ratios(lines) == {("a", 1): [(256, 2.0), (512, 1.0)], ("b", 1): [(256, 1.0)], ("a", 8): [(256, 1.0)]}


def test_draw_writes_a_picture(plot_bench, tmp_path):
    pytest.importorskip("matplotlib")
    output = tmp_path / "grid.png"
    plot_bench.draw(REPORT, str(output))
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_refuses_a_report_with_nothing_to_draw(plot_bench, tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit, match="no timed rows"):
        plot_bench.draw({**REPORT, "rows": REPORT["rows"][-1:]}, str(tmp_path / "x.png"))


def test_it_reads_what_bench_writes(plot_bench, capsys):
    """The labels bench prints are the ones the tool parses (a quick CPU bench, reference only)."""
    from dispatch.cli.commands import main

    main(["bench", "--quick", "--op", "paged_mqa_logits", "--next-n", "1,2", "--backends", "torch.reference", "--json"])
    report = json.loads(capsys.readouterr().out)
    panels = plot_bench.series(report)
    assert panels == {
        ("paged_mqa_logits", n): {("torch.reference", 2): [(256, r["median_us"])]}
        for n, r in zip((1, 2), report["rows"])
    }
