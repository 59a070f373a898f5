"""Files are complete or refused (issue 24): a measured overlay must end with `# end` (tune writes it,
atomically: temporary file, then rename), a registry that was loaded with `# end` is not replaced on reload
by one without it, and a measured order's tie band is against the fastest, not the neighbour."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatch.bench.overlay_file import check_writable, write_atomically
from dispatch.bench.ordering import measured_order
from dispatch.contract.errors import OptionError, RegistryError
from dispatch.registry.document import load_registry
from dispatch.registry.reading import END_MARKER, is_sealed
from dispatch.registry.measured import parse_measured
from dispatch.engines.reloading import LiveDispatcher
from dispatch.deciding.runtime import DEFAULT_REGISTRY

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_OVERLAY = ROOT / "measured" / "h200-mtp.yaml"


def test_the_shipped_files_are_sealed():
    assert is_sealed(DEFAULT_REGISTRY.read_text()) and load_registry(DEFAULT_REGISTRY).sealed
    assert is_sealed(SHIPPED_OVERLAY.read_text())


def test_every_line_prefix_of_the_shipped_overlay_is_refused():
    lines = SHIPPED_OVERLAY.read_text().splitlines(keepends=True)
    parse_measured("".join(lines), "h200-mtp.yaml")
    # Cut before `ops:` the prefix is valid YAML and a valid overlay: the marker is what refuses it.
    for cut in range(len(lines) - 1, 0, -1):
        with pytest.raises(RegistryError, match=f"incomplete: a measured overlay's last line is `{END_MARKER}`"):
            parse_measured("".join(lines[:cut]), "h200-mtp.yaml")


def test_a_reload_refuses_the_shipped_registry_cut_short(tmp_path):
    text = DEFAULT_REGISTRY.read_text()
    path = tmp_path / "registry.yaml"
    path.write_text(text)
    (tmp_path / "measured").symlink_to(ROOT / "measured")
    live = LiveDispatcher(path, arch="cpu")
    lines = text.splitlines(keepends=True)
    # Cut before the marker, then before the last cluster's `prefer`: each prefix parses and serves every
    # key; the second silently loses an operator's word.
    for cut in (len(lines) - 1, len(lines) - 2):
        path.write_text("".join(lines[:cut]))
        result = live.reload()
        assert not result.ok and "ends with `# end` and this file does not" in result.error, result
    path.write_text(text)
    assert live.reload().ok


def test_tune_writes_atomically_and_checks_the_path_first(tmp_path):
    target = tmp_path / "sub" / "overlay.yaml"
    write_atomically(target, "first\n")
    write_atomically(target, "second\n")
    assert target.read_text() == "second\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["overlay.yaml"]  # no temporary file left
    for bad in ["/", "/dev/full", str(tmp_path / ("x" * 300) / "o.yaml"), str(tmp_path / ("y" * 300))]:
        with pytest.raises(OptionError, match="-o "):
            check_writable(bad)


@pytest.mark.parametrize(
    "order, means, rule_order, expected",
    [
        # Each within 1% of its neighbour, but `a` is 1.9% slower than `c`: it never goes before `c`.
        (["c", "b", "a"], [100.0, 101.0, 101.9], ["a", "b", "c"], ["b", "c", "a"]),
        # All within 1% of the fastest: the registry's order.
        (["c", "b", "a"], [100.0, 100.5, 100.9], ["a", "b", "c"], ["a", "b", "c"]),
    ],
)
def test_the_tie_band_is_against_the_fastest(order, means, rule_order, expected):
    placed = measured_order(order, dict(zip(order, means)).__getitem__, rule_order)
    assert placed == expected
    by_name = dict(zip(order, means))
    for index, name in enumerate(placed):  # what the loader checks
        assert by_name[name] <= min(by_name[n] for n in placed[index:]) * 1.01


OVERLAY = """\
version: 1
machine: NVIDIA H200
date: 2026-11-30
dispatch: 0.1.0
torch: 2.11.0
workload: {batch_sizes: [128], lengths: [32768], next_n: [1]}
ops:
  paged_mqa_logits:
    versions: {a: "1", b: "1", c: "1"}
    preferences:
      - key: {arch: sm90, forward_mode: decode, next_n: 1, fp8_dtype: e4m3fn}
        order: [a, b, c]
        shapes:
          - shape: B=128
            median_us: {a: 101.9, b: 101.0, c: 100.0}
# end
"""


def test_the_loader_refuses_a_chain_of_ties():
    with pytest.raises(RegistryError, match=r"puts `a` \(101.9 us\) before `c` \(100.0 us\).*within 1% of the fastest"):
        parse_measured(OVERLAY, "h200.yaml")
    parse_measured(OVERLAY.replace("a: 101.9", "a: 100.9"), "h200.yaml")
