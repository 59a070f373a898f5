"""A measured order ranked by the whole step (`ranked_by: step`, with the step's times in `step_shapes`)
and how the times were taken (`timing`, `timed_eagerly`): the valid form, each invalid one refused
with file, line and key, an overlay from before these fields still read, and explain naming the step
in the decision's evidence."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Op
from dispatch.registry.measured import load_measured, parse_measured
from tests.support.overlay_refusals import assert_refused_at
from tests.support.cli_session import clean_environment, run  # noqa: F401 (clean_environment: an autouse fixture)
from tests.support.step_ranked import DECODE, LARGE, OVERLAY, SMALL, write_stepped

PATH = "measured/stepped.yaml"
STEP_TIMES = "median_us: {triton: 30.0, torch.reference: 25.0}"
STEP_BAND = "        order: [torch.reference, triton]\n        ranked_by: step\n"


def test_a_band_ranked_by_the_step_rests_on_the_steps_times():
    preference = parse_measured(OVERLAY, PATH).find(Op.TOPK, DECODE)[1]
    assert [band.ranked_by for band in preference.bands] == ["step", "op"]
    assert (preference.ranked_by, preference.timing, preference.timed_eagerly) == ("op", "graph", {})
    order, shapes, mean = preference.measured_at(0)
    assert order == ("torch.reference", "triton") and [s.shape for s in shapes] == [SMALL]
    assert (mean("torch.reference"), mean("triton")) == (25.0, 30.0)  # the step's, not the op's 12.0 and 10.0
    assert [s.shape for s in preference.alone_at(0)] == [SMALL]
    assert dict(preference.step_shapes[0].stages) == {Op.INDEXER_Q_QUANT: "torch.reference",
                                                       Op.PAGED_MQA_LOGITS: "torch.reference"}
    order, shapes, mean = preference.measured_at(1)  # B=16 is the op's alone
    assert order == ("triton", "torch.reference") and mean("triton") == 20.0
    assert preference.mean_us("triton") == pytest.approx((10.0 * 20.0) ** 0.5)  # the key's own order: the op's


def test_a_key_ranked_by_the_step_is_ordered_by_the_steps_times():
    start, end = OVERLAY.index("      bands:\n"), OVERLAY.index("      shapes:\n")
    text = (OVERLAY[:start] + "      ranked_by: step\n" + OVERLAY[end:]).replace(f"      - shape: {LARGE}\n"
                                                                                 "        median_us: {triton: 20.0, torch.reference: 40.0}\n", "")
    text = text.replace("order: [triton, torch.reference]\n      ranked_by", "order: [torch.reference, triton]\n      ranked_by")
    preference = parse_measured(text, PATH).find(Op.TOPK, DECODE)[1]
    assert preference.ranked_by == "step" and preference.mean_us("torch.reference") == 25.0
    with pytest.raises(RegistryError, match=r"puts `triton` \(30.0 us\) before `torch.reference` \(25.0 us\).* in the step"):
        parse_measured(text.replace("order: [torch.reference, triton]\n      ranked_by",
                                    "order: [triton, torch.reference]\n      ranked_by"), PATH)


INVALID = {
    "a step band without the step's times": (
        lambda t: t.replace("      step_shapes:\n", "      step_shapes: []\n      unused_shapes:\n"), None, None),
    "a step band out of the step's order": (
        lambda t: t.replace(STEP_BAND, "        order: [triton, torch.reference]\n        ranked_by: step\n"),
        ("order: [triton, torch.reference]", 1), ("bands[0].order", "before `torch.reference` (25.0 us)")),
    "a step band without step times at its size": (
        lambda t: t.replace(f"      - shape: {SMALL}\n        {STEP_TIMES}", f"      - shape: {LARGE}\n        {STEP_TIMES}"),
        ("ranked_by: step", 0), ("bands[0].ranked_by", "is `step`, but `step_shapes` time 0 of the 1 shapes at B=2")),
    "a step time missing for a backend": (
        lambda t: t.replace(STEP_TIMES, "median_us: {torch.reference: 25.0}"), ("- key:", 0),
        ("", "every ordered backend needs a step time at every step shape")),
    "a step shape the op was not timed at": (
        lambda t: t.replace(f"      - shape: {SMALL}\n        {STEP_TIMES}", f"      - shape: B=2 N=1 L~1K\n        {STEP_TIMES}"),
        ("- key:", 0), ("", "step shape `B=2 N=1 L~1K` is not one of `shapes`")),
    "step times no order is ranked by": (
        lambda t: t.replace(STEP_BAND, "        order: [triton, torch.reference]\n"),
        ("step_shapes:", 0), ("step_shapes", "time the step at B=2, which no band is ranked by")),
    "a timing that is neither": (
        lambda t: t.replace("timing: graph", "timing: replayed"), ("timing: replayed", 0), ("timing", "'graph' or 'eager'")),
    "an eager backend the key did not measure": (
        lambda t: t.replace("timing: graph", "timing: graph\n      timed_eagerly: {flashinfer: at B=2}"), ("- key:", 0),
        ("", "`timed_eagerly` names `flashinfer`, which this key did not measure")),
}


@pytest.mark.parametrize("name", [n for n, (_, where, _) in INVALID.items() if where])
def test_each_invalid_form_names_file_line_and_key(name):
    change, (fragment, occurrence), (location, message) = INVALID[name]
    text = change(OVERLAY)
    assert text != OVERLAY
    assert_refused_at(text, PATH, fragment, occurrence, f"ops.topk.preferences[0]{'.' + location if location else ''}",
                      message)


def test_a_step_band_with_no_step_times_at_all_is_refused():
    change = INVALID["a step band without the step's times"][0]
    with pytest.raises(RegistryError, match="unused_shapes"):  # strict: an unknown field is refused too
        parse_measured(change(OVERLAY), PATH)
    start, end = OVERLAY.index("      step_shapes:\n"), OVERLAY.index("      timing:")
    with pytest.raises(RegistryError, match=r"bands\[0\]\.ranked_by: is `step`, but `step_shapes` time 0 of the 1"):
        parse_measured(OVERLAY[:start] + OVERLAY[end:], PATH)


def test_an_overlay_from_before_the_step_and_timing_fields_still_loads():
    # The H200 overlay committed on 2026-12-01, as tune wrote it then (kept as it was: the shipped one is newer).
    overlay = load_measured(Path(__file__).parent / "data" / "h200-mtp-2026-12-01.yaml").overlay
    preferences = [p for table in overlay.ops.values() for p in table.preferences]
    assert preferences and all(p.timing is None and p.ranked_by == "op" and not p.step_shapes for p in preferences)
    assert all(band.ranked_by == "op" for p in preferences for band in p.bands)


def test_explain_shows_the_step_in_the_decisions_evidence(tmp_path, capsys):
    registry = write_stepped(tmp_path)
    args = ("explain", "--registry", str(registry), "--cluster", "stepped", "--arch", "cpu", "--forward-mode", "decode",
            "--op", "topk")
    code, out, err = run(capsys, *args, "--batch-size", "2")
    assert code == 0, err
    overlay = tmp_path / "measured" / "stepped.yaml"
    assert "  chosen:   torch.reference\n" in out
    assert (f"  evidence: measured in the step on NVIDIA H200, 2026-12-02, B=2: torch.reference 25.0 us, triton 30.0 us "
            f"at {SMALL}, timed in CUDA graphs ({overlay}:") in out
    assert (f"            torch.reference 25.0 us, triton 30.0 us at {SMALL} (the step with indexer_q_quant "
            "torch.reference, paged_mqa_logits torch.reference)\n"
            "              the op alone: torch.reference 12.0 us, triton 10.0 us\n") in out
    rejected = {line.split()[0]: line.split(None, 1)[1] for line in out.split("  rejected:\n")[1].splitlines()}
    assert rejected["triton"] == "measured slower in the step at B=2: 30.0 us vs 25.0 us (torch.reference)"
    code, out, err = run(capsys, *args, "--batch-size", "16")  # the band past the step's reach: the op alone
    assert code == 0, err
    assert "  chosen:   triton\n" in out and "in the step" not in out
    assert f"  evidence: measured on NVIDIA H200, 2026-12-02: triton 20.0 us, torch.reference 40.0 us at {LARGE}, " \
           "timed in CUDA graphs (" in out
    code, out, err = run(capsys, *args, "--batch-size", "2", "--json")
    (decision,) = json.loads(out)["decisions"]
    evidence = decision["evidence"]
    assert (evidence["ranked_by"], evidence["batch_size"], evidence["timing"]) == ("step", 2, "graph")
    assert evidence["shapes"] == [{"shape": SMALL, "median_us": {"torch.reference": 25.0, "triton": 30.0}}]
    assert evidence["alone"] == [{"shape": SMALL, "median_us": {"torch.reference": 12.0, "triton": 10.0}}]
    assert evidence["stages"] == {SMALL: {"indexer_q_quant": "torch.reference", "paged_mqa_logits": "torch.reference"}}


def test_validate_accepts_an_overlay_ranked_by_the_step(tmp_path, capsys):
    from dispatch.cli.commands import main

    assert main(["validate", str(write_stepped(tmp_path))]) == 0
    assert "1 measured overlay" in capsys.readouterr().out
