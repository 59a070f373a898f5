"""`explain --batch-size B --max-seq-len L` with length sub-bands: the sub-band's choice, its line and
why; with a batch size only, the band's choice and each sub-band's listed (`by length:`); with neither,
each band's choice with its sub-bands' beside it; --seq-lens gives the longest; --max-seq-len without a
batch size, or beside lengths, is a usage error (exit 2)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_session import clean_environment, run  # noqa: F401 (clean_environment: an autouse fixture)
from tests.support.length_banded import FLATTEN, NATIVE, OVERLAY, write_banded


@pytest.fixture
def verify(tmp_path):
    return ("--registry", str(write_banded(tmp_path, overlay=OVERLAY)), "--cluster", "banded", "--arch", "cpu",
            "--forward-mode", "target_verify", "--next-n", "2", "--op", "paged_mqa_logits")


def test_a_batch_size_and_max_seq_len_show_the_sub_bands_choice(capsys, verify):
    code, out, err = run(capsys, "explain", *verify, "--batch-size", "2", "--max-seq-len", "1000")
    assert code == 0, err
    assert f"  chosen:   {NATIVE}\n" in out
    assert "  by:       cluster `banded` measured[0] for B <= 2, rows > 384 (" in out
    assert "by length:" not in out and "by batch:" not in out
    assert "at B=2 N=2 L~1K H=64 D=128" in out and "L~256" not in out.split("  evidence:")[1].split("\n")[0]
    assert f"measured slower at B=2, rows > 384: 30.0 us vs 22.0 us ({NATIVE})" in out


def test_a_batch_size_alone_lists_its_bands_sub_bands(capsys, verify):
    code, out, err = run(capsys, "explain", *verify, "--batch-size", "2")
    assert code == 0, err
    assert f"  chosen:   {FLATTEN}\n" in out and "measured[0] for B <= 2 (" in out
    assert (f"  by length: rows <= 384: {FLATTEN}; rows > 384: {NATIVE} (--max-seq-len L explains one)\n") in out
    code, out, err = run(capsys, "explain", "--json", *verify, "--batch-size", "2")
    (decision,) = json.loads(out)["decisions"]
    assert [(s["max_seq_len_up_to"], s["serves"], s["backend"]) for s in decision["lengths"]] == [
        (384, "rows <= 384", FLATTEN), (1536, "rows > 384", NATIVE)]


def test_without_a_batch_size_each_band_lists_its_sub_bands(capsys, verify):
    code, out, err = run(capsys, "explain", *verify)
    assert code == 0, err
    assert (f"  by batch: B <= 2: {FLATTEN} (rows <= 384: {FLATTEN}, rows > 384: {NATIVE}); B > 2: {NATIVE} "
            "(--batch-size B explains one, with --max-seq-len L a sub-band)\n") in out
    code, out, err = run(capsys, "explain", "--json", *verify)
    (decision,) = json.loads(out)["decisions"]
    assert [b.get("lengths", []) and [s["backend"] for s in b["lengths"]] for b in decision["bands"]] == [
        [FLATTEN, NATIVE], []]


@pytest.mark.parametrize("lengths, backend", [("300,20", FLATTEN), ("300,900", NATIVE)])
def test_seq_lens_give_the_longest(capsys, verify, lengths, backend):
    code, out, err = run(capsys, "explain", "--json", *verify, "--seq-lens", lengths)
    assert code == 0, err
    (decision,) = [d for d in json.loads(out)["decisions"] if d["op"] == "paged_mqa_logits"]
    assert decision["backend"] == backend


@pytest.mark.parametrize("extra, message", [
    (("--max-seq-len", "1000"), "--max-seq-len picks a length sub-band inside a batch-size band: give --batch-size too"),
    (("--seq-lens", "300,20", "--max-seq-len", "1000"), "--max-seq-len with --seq-lens or --extend-lens"),
    (("--batch-size", "2", "--max-seq-len", "0"), "argument --max-seq-len: --max-seq-len is 0; it must be from 1 to"),
])
def test_a_max_seq_len_without_a_batch_size_or_beside_lengths_is_refused(capsys, verify, extra, message):
    code, out, err = run(capsys, "explain", *verify, *extra)
    assert code == 2 and out == "" and message in err and "Traceback" not in err
