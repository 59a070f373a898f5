"""A measured band's length sub-bands (`lengths`): the valid form, each invalid one refused with file,
line and key (one per measured length, bounded by 3L/2, ascending, ranked as its band, each order the
key's backends fastest first by that length's shapes, the 1% tie kept), a band of one batch size
allowed only with sub-bands, and the overlays from before sub-bands still read and deciding as before."""

from __future__ import annotations

import shutil

import pytest

from dispatch.contract.errors import RegistryError
from dispatch.contract.key import Op
from dispatch.deciding.runtime import DEFAULT_REGISTRY, load_dispatcher
from dispatch.registry.measured import load_measured, parse_measured
from dispatch.registry.measured_bands import length_bound, length_label, mean_len_of
from tests.support.overlay_refusals import assert_refused_at
from tests.support.length_banded import FLATTEN, NATIVE, OVERLAY, VERIFY

PATH = "measured/banded.yaml"
SHORT = f"          order: [{FLATTEN}, {NATIVE}]\n"  # the L~256 sub-band's
LONG = f"          order: [{NATIVE}, {FLATTEN}]\n"  # the L~1K sub-band's


def test_the_valid_form_is_read_with_each_sub_bands_shapes():
    preference = parse_measured(OVERLAY, PATH).find(Op.PAGED_MQA_LOGITS, VERIFY)[1]
    band = preference.bands[0]
    assert band.length_bounds == (384, 1536) and preference.bands[1].lengths == ()
    assert [s.shape for s in preference.band_shapes(0, 0)] == ["B=2 N=2 L~256 H=64 D=128"]
    order, shapes, mean = preference.measured_at(0, 1)
    assert order == (NATIVE, FLATTEN) and [s.shape for s in shapes] == ["B=2 N=2 L~1K H=64 D=128"]
    assert (mean(NATIVE), mean(FLATTEN)) == (22.0, 30.0)
    assert preference.ranked_by_at(0, 1) == "op" and len(preference.alone_at(0, 0)) == 1


def _swap(text: str) -> str:
    return text.replace("max_seq_len_up_to: 384", "max_seq_len_up_to: X").replace(
        "max_seq_len_up_to: 1536", "max_seq_len_up_to: 384").replace("max_seq_len_up_to: X", "max_seq_len_up_to: 1536")


AT = "bands[0].lengths"
INVALID = {
    "descending": (_swap, ("max_seq_len_up_to: 384", 0), f"{AT}[1].max_seq_len_up_to",
                   "384 after 1536: length sub-bands are ascending, one per measured length"),
    "not 3L/2": (lambda t: t.replace("max_seq_len_up_to: 384", "max_seq_len_up_to: 256"), ("max_seq_len_up_to: 256", 0),
                 f"{AT}[0].max_seq_len_up_to", "256 is not 3L/2 of a length measured at B=2 (the sub-bands' bounds are 384, 1536)"),
    "missing": (lambda t: t.replace("        - max_seq_len_up_to: 1536\n" + LONG, ""), ("        lengths:", 0), AT,
                "no sub-band up to 1536 at B=2: one sub-band per measured length"),
    "not the key's backends": (lambda t: t.replace(SHORT, f"          order: [{FLATTEN}]\n"), (f"order: [{FLATTEN}]", 0),
                               f"{AT}[0].order", f"lists `{FLATTEN}`; a sub-band orders exactly the key's backends"),
    "against its times": (lambda t: t.replace(SHORT, LONG), (LONG.strip(), 1), f"{AT}[0].order",
                          f"puts `{NATIVE}` (20.0 us) before `{FLATTEN}` (10.0 us); the measured order is fastest first, "
                          "ties within 1% of the fastest (to override a measurement, use the cluster's `prefer`) at B=2, "
                          "rows <= 384"),
    "ranked otherwise than its band": (lambda t: t.replace("        - max_seq_len_up_to: 384\n",
                                                           "        - max_seq_len_up_to: 384\n          ranked_by: step\n"),
                                       ("ranked_by: step", 0), f"{AT}[0].ranked_by",
                                       "is `step` in a band ranked by `op`: a sub-band is ranked by the times its band is"),
    "one length": (lambda t: t.replace("shape: B=2 N=2 L~1K", "shape: B=2 N=2 L~256 k=64"), ("        lengths:", 0), AT,
                   "length sub-bands need the shapes at B=2 to each name a mean length (`L~<n>`), at least two of them"),
    "a bound past its limit": (lambda t: t.replace("max_seq_len_up_to: 1536", "max_seq_len_up_to: 9999999"),
                               ("max_seq_len_up_to: 9999999", 0), f"{AT}[1].max_seq_len_up_to", "less than or equal to"),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_each_invalid_form_names_file_line_and_key(name):
    change, (fragment, occurrence), location, message = INVALID[name]
    text = change(OVERLAY)
    assert text != OVERLAY
    assert_refused_at(text, PATH, fragment, occurrence, f"ops.paged_mqa_logits.preferences[0].{location}", message)


def test_a_tie_within_one_percent_is_accepted_in_a_sub_band_and_past_it_refused():
    tied = OVERLAY.replace("{torch.reference: 22.0, torch.reference.flatten: 30.0}",
                           "{torch.reference: 22.0, torch.reference.flatten: 21.9}")
    # (the band and key orders stay valid: flatten 14.8 at B=2 against native 21.0; 26.0 over all)
    assert parse_measured(tied, PATH)
    past = tied.replace("flatten: 21.9}", "flatten: 21.7}")
    with pytest.raises(RegistryError, match=r"bands\[0\]\.lengths\[1\]\.order: puts `torch.reference` \(22.0 us\)"):
        parse_measured(past, PATH)


def test_one_batch_size_takes_a_band_only_with_sub_bands():
    start, end = OVERLAY.index("      - batch_size_up_to: 16\n"), OVERLAY.index("      shapes:\n")
    shapes = OVERLAY[OVERLAY.index("      shapes:\n"):OVERLAY.index("      - shape: B=16")] + "# end\n"
    one = OVERLAY[:start] + shapes
    one = one.replace(f"      order: [{NATIVE}, {FLATTEN}]\n", f"      order: [{FLATTEN}, {NATIVE}]\n", 1)
    preference = parse_measured(one, PATH).find(Op.PAGED_MQA_LOGITS, VERIFY)[1]
    assert preference.bounds == (2,) and preference.bands[0].length_bounds == (384, 1536)
    bare = one.replace(one[one.index("        lengths:\n"):one.index("      shapes:\n")], "")
    with pytest.raises(RegistryError, match=r"at least two of them; these shapes name 2 \(one batch size takes a band only "
                                            r"with length sub-bands\)"):
        parse_measured(bare, PATH)


@pytest.mark.parametrize("shape, length", [("B=8 N=1 L~8K H=64 D=128 k=2048", 8192), ("B=2 N=2 L~256 H=64", 256),
                                           ("B=2 N=2 L~3000 H=64", 3000), ("M=4K S=52K R=4 H=64 D=128", None),
                                           ("T=512 H=64", None)])
def test_the_mean_length_a_shape_names(shape, length):
    assert mean_len_of(shape) == length


def test_bounds_are_the_longest_request_of_the_measured_shape_and_labels_say_so():
    assert [length_bound(n) for n in (2048, 8192, 32768)] == [3072, 12288, 49152]
    assert [length_label((3072, 12288, 49152), i) for i in range(3)] == ["rows <= 3K", "3K < rows <= 12K", "rows > 12K"]
    assert [length_label((384, 1536), i) for i in range(2)] == ["rows <= 384", "rows > 384"]


@pytest.mark.parametrize("fixture", ["h200-mtp-2026-12-01.yaml", "h200-mtp-2026-12-02.yaml"])
def test_the_overlays_from_before_sub_bands_load_and_decide_as_before(tmp_path, fixture):
    """The H200 overlays tuned before sub-bands (2026-12-01, 2026-12-02 02:23 UTC) have no `lengths`: a
    declared max_seq_len changes nothing there."""
    source = DEFAULT_REGISTRY.parent / "tests" / "registry" / "data" / fixture
    assert not any(band.lengths for table in load_measured(source).overlay.ops.values()
                   for p in table.preferences for band in p.bands)
    (tmp_path / "measured").mkdir()
    shutil.copy(source, tmp_path / "measured" / "h200-mtp.yaml")
    shutil.copy(DEFAULT_REGISTRY, tmp_path / "registry.yaml")
    dispatcher = load_dispatcher(tmp_path / "registry.yaml", arch="sm90", cluster="h200-mtp", device_name="NVIDIA H200")
    for preference in dispatcher.document.measured["h200-mtp"].overlay.ops[Op.TOPK].preferences:
        key = preference.key.keys()[0]
        for size in (1, 8, 32, 128, 256):
            banded = dispatcher.decide(Op.TOPK, key, batch_size=size)
            for longest in (1, 3072, 12288, 49152, 2**20):
                assert dispatcher.decide(Op.TOPK, key, batch_size=size, max_seq_len=longest) == banded
