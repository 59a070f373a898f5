"""A measured preference's `bands`: the valid form, each invalid one refused with file, line and key,
an overlay without bands still read, and the batch sizes each band serves."""

from __future__ import annotations

import pytest

from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Op
from dispatch.registry.measured import parse_measured
from dispatch.registry.measured_bands import band_index, band_label, batch_size_of
from tests.support.overlay_refusals import assert_refused_at, line_of as _line
from tests.support.banded import FLATTEN, NATIVE, OVERLAY, VERIFY

PATH = "measured/banded.yaml"
FIRST_ORDER = f"order: [{FLATTEN}, {NATIVE}]"
SECOND_ORDER = f"        order: [{NATIVE}, {FLATTEN}]\n"


def test_the_valid_form_is_read_with_each_bands_shapes():
    preference = parse_measured(OVERLAY, PATH).find(Op.PAGED_MQA_LOGITS, VERIFY)[1]
    assert preference.order == (NATIVE, FLATTEN)
    assert preference.bounds == (2, 16)
    assert [band.order for band in preference.bands] == [(FLATTEN, NATIVE), (NATIVE, FLATTEN)]
    assert [s.shape for s in preference.band_shapes(0)] == ["B=2 N=2 L~256 H=64 D=128", "B=2 N=2 L~1K H=64 D=128"]
    assert preference.band_mean_us(0, FLATTEN) == pytest.approx((10.0 * 12.0) ** 0.5, rel=1e-12)


def test_an_overlay_without_bands_stays_valid():
    start, end = OVERLAY.index("      bands:\n"), OVERLAY.index("      shapes:\n")
    preference = parse_measured(OVERLAY[:start] + OVERLAY[end:], PATH).find(Op.PAGED_MQA_LOGITS, VERIFY)[1]
    assert preference.bands == () and preference.bounds == ()


def _swapped_bands(text: str) -> str:
    return text.replace("batch_size_up_to: 2\n", "batch_size_up_to: X\n").replace(
        "batch_size_up_to: 16\n", "batch_size_up_to: 2\n").replace("batch_size_up_to: X\n", "batch_size_up_to: 16\n")


INVALID = {
    "descending": (_swapped_bands, ("batch_size_up_to: 2", 0), "bands[1].batch_size_up_to",
                   "2 after 16: bands are ascending, one per measured batch size"),
    "twice": (lambda t: t.replace("batch_size_up_to: 16", "batch_size_up_to: 2"), ("batch_size_up_to: 2", 1),
              "bands[1].batch_size_up_to", "2 after 2: bands are ascending"),
    "unmeasured": (lambda t: t.replace("batch_size_up_to: 16", "batch_size_up_to: 20"), ("batch_size_up_to: 20", 0),
                   "bands[1].batch_size_up_to", "20 is not a measured batch size (the shapes measure 2, 16)"),
    "missing": (lambda t: t.replace("      - batch_size_up_to: 16\n" + SECOND_ORDER, ""), ("bands:", 0),
                "bands", "no band for the measured batch size 16: one band per batch size"),
    "not the key's backends": (lambda t: t.replace(FIRST_ORDER, f"order: [{FLATTEN}]"), (f"order: [{FLATTEN}]", 0),
                               "bands[0].order", f"lists `{FLATTEN}`; a band orders exactly the key's backends"),
    "an unknown name": (lambda t: t.replace(FIRST_ORDER, f"order: [{FLATTEN}, tritn]"), ("tritn", 0),
                        "bands[0].order", f"lists `{FLATTEN}`, `tritn`; a band orders exactly the key's backends"),
    "a backend twice": (lambda t: t.replace(FIRST_ORDER, f"order: [{FLATTEN}, {FLATTEN}]"), (f"[{FLATTEN}, {FLATTEN}]", 0),
                        "bands[0].order", "a band orders exactly the key's backends"),
    "against its times": (lambda t: t.replace(FIRST_ORDER, f"order: [{NATIVE}, {FLATTEN}]"), (f"order: [{NATIVE}, {FLATTEN}]", 1),
                          "bands[0].order", f"puts `{NATIVE}` (21.0 us) before `{FLATTEN}` (11.0 us)"),
    "shapes without a batch size": (lambda t: t.replace("shape: B=2 N=2 L~256", "shape: T=64 N=2 L~256"), ("bands:", 0),
                                    "bands", "bands need shapes that each name a batch size (`B=<n>` or `R=<n>`)"),
    "one batch size": (lambda t: t.replace("shape: B=16", "shape: B=2"), ("bands:", 0),
                       "bands", "at least two of them; these shapes name 2"),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_each_invalid_form_names_file_line_and_key(name):
    change, (fragment, occurrence), location, message = INVALID[name]
    text = change(OVERLAY)
    assert text != OVERLAY
    assert_refused_at(text, PATH, fragment, occurrence, f"ops.paged_mqa_logits.preferences[0].{location}", message)


def test_a_bound_that_is_not_a_positive_int_is_refused_at_its_line():
    text = OVERLAY.replace("batch_size_up_to: 2\n", "batch_size_up_to: 0\n")
    with pytest.raises(RegistryError, match=rf"^{PATH}:{_line(text, 'batch_size_up_to: 0')}: "
                                            r"ops\.paged_mqa_logits\.preferences\[0\]\.bands\[0\]\.batch_size_up_to: "):
        parse_measured(text, PATH)


def test_an_overlay_with_bands_cut_short_is_refused():
    text = OVERLAY[:OVERLAY.index("      shapes:\n")]
    with pytest.raises(RegistryError, match="incomplete: a measured overlay's last line is `# end`"):
        parse_measured(text, PATH)


@pytest.mark.parametrize("shape, size", [("B=8 N=1 L~8K H=64 D=128 k=2048", 8), ("M=4K S=52K R=4 H=64 D=128", 4),
                                         ("T=512 H=64 D=128 rot=64", None), ("B=x N=1", None), ("NB=3 N=1", None)])
def test_the_batch_size_a_shape_names(shape, size):
    assert batch_size_of(shape) == size


@pytest.mark.parametrize("batch_size, index", [(1, 0), (8, 0), (9, 1), (32, 1), (33, 2), (128, 2), (4096, 2)])
def test_each_batch_size_is_served_by_its_band_and_the_last_serves_larger_ones(batch_size, index):
    assert band_index((8, 32, 128), batch_size) == index


def test_band_labels_say_which_batches_each_serves():
    assert [band_label((8, 32, 128), i) for i in range(3)] == ["B <= 8", "8 < B <= 32", "B > 32"]
    assert [band_label((2, 16), i) for i in range(2)] == ["B <= 2", "B > 2"]


def test_validate_checks_an_overlays_bands(tmp_path, capsys):
    from dispatch.cli.commands import main
    from tests.support.banded import write_banded

    registry = write_banded(tmp_path)
    assert main(["validate", str(registry)]) == 0
    assert "1 measured overlay" in capsys.readouterr().out
    write_banded(tmp_path, OVERLAY.replace("batch_size_up_to: 16", "batch_size_up_to: 20"))
    assert main(["validate", str(registry)]) == 2
    overlay = tmp_path / "measured" / "banded.yaml"
    line = _line(OVERLAY.replace("batch_size_up_to: 16", "batch_size_up_to: 20"), "batch_size_up_to: 20")
    assert (f"{overlay}:{line}: ops.paged_mqa_logits.preferences[0].bands[1].batch_size_up_to: 20 is not a measured "
            "batch size") in capsys.readouterr().err
