"""`explain --batch-size B` on the shipped H200 overlay's top-k bands: the band's choice and why; without
a batch size the key's choice with every band's listed; --seq-lens gives B; a batch size that cannot
occur is a located usage error (exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.cli_session import clean_environment, run  # noqa: F401 (clean_environment: an autouse fixture)

H200_VERIFY = ("--gpu", "h200", "--forward-mode", "target_verify", "--next-n", "2")


def _block(out: str, op: str) -> str:
    start = out.index(f"\n{op} for ") + 1  # after the what-if note
    return out[start:].split("\n\n")[0]


def _rejected(block: str) -> dict[str, str]:
    lines = block.split("  rejected:\n")[1].splitlines()
    return {line.split()[0]: line.split(None, 1)[1] for line in lines}


def test_a_batch_size_shows_its_bands_choice_and_why(capsys):
    code, out, err = run(capsys, "explain", *H200_VERIFY, "--op", "topk", "--batch-size", "32")
    assert code == 0, err
    block = _block(out, "topk")
    assert "  chosen:   cuda.radix\n" in block
    assert "  by:       cluster `h200-mtp` measured[0] for 8 < B <= 32 (" in block
    assert "by batch:" not in block  # the batch size was given: one band, no listing
    # The band's rows differ by length: the sub-bands are listed, --max-seq-len picks one.
    assert "  by length: rows <= 12K: sglang.topk_v2; rows > 12K: cuda.radix (--max-seq-len L explains one)" in block
    assert "(geometric mean over 2 shapes)" in block and "at B=32 N=2 L~32K" in block and "B=8 N=2" not in block
    # At B <= 32 the tune ranks the top-k by the whole step: the evidence and the losers say so.
    assert "  evidence: measured in the step on NVIDIA H200, 2026-12-03, B=32: cuda.radix 43.2 us" in block
    rejected = _rejected(block)
    assert rejected["sglang.topk_v2"] == (
        "measured slower in the step at B=32: 43.8 us vs 43.2 us (cuda.radix, geometric mean over 2 shapes)"
    )
    assert rejected["triton"] == (
        "measured slower in the step at B=32: 48.2 us vs 43.2 us (cuda.radix, geometric mean over 2 shapes)"
    )


def test_a_loser_within_one_percent_is_called_level_and_the_rules_order_named(capsys, tmp_path):
    # The shipped overlay with SGLang's v2 a hair faster than cuda.radix in the step at B=32 next_n 2
    # L~32K, so that its mean over the band's two shapes is 0.2% below cuda.radix's: a tie, kept in order.
    root = Path(__file__).resolve().parents[2]
    shutil.copy(root / "registry.yaml", tmp_path / "registry.yaml")
    (tmp_path / "measured").mkdir()
    overlay = (root / "measured" / "h200-mtp.yaml").read_text()
    step_at_32k = "median_us: {cuda.radix: 66.7, sglang.topk_v2: 69.4,"
    assert overlay.count(step_at_32k) == 1
    (tmp_path / "measured" / "h200-mtp.yaml").write_text(
        overlay.replace(step_at_32k, "median_us: {cuda.radix: 66.7, sglang.topk_v2: 67.4,"))
    code, out, err = run(capsys, "explain", "--registry", str(tmp_path / "registry.yaml"), *H200_VERIFY, "--op", "topk",
                         "--batch-size", "32")
    assert code == 0, err
    block = _block(out, "topk")
    assert "  chosen:   cuda.radix\n" in block
    assert _rejected(block)["sglang.topk_v2"] == (
        "measured level in the step at B=32: 43.1 us vs 43.2 us (cuda.radix, geometric mean over 2 shapes), "
        "within 1%, where the rules' order puts cuda.radix first"
    )


@pytest.mark.parametrize("batch_size, backend, serves", [("1", "sglang.topk_v2", "B <= 1"),
                                                         ("2", "cuda.radix", "1 < B <= 8"),
                                                         ("8", "cuda.radix", "1 < B <= 8"),
                                                         ("9", "cuda.radix", "8 < B <= 32"),
                                                         ("64", "cuda.radix", "32 < B <= 128"),
                                                         ("1024", "cuda.radix", "B > 128")])
def test_each_batch_size_gets_its_bands_choice(capsys, batch_size, backend, serves):
    code, out, err = run(capsys, "explain", "--json", *H200_VERIFY, "--op", "topk", "--batch-size", batch_size)
    assert code == 0, err
    (decision,) = json.loads(out)["decisions"]
    assert (decision["backend"], decision["band"], decision["source"]) == (backend, serves, "measured")
    assert "bands" not in decision


def test_without_a_batch_size_the_keys_choice_and_every_bands_are_listed(capsys):
    code, out, err = run(capsys, "explain", *H200_VERIFY, "--op", "topk")
    assert code == 0, err
    block = _block(out, "topk")
    assert "  chosen:   cuda.radix\n" in block and "  by:       cluster `h200-mtp` measured[0] (" in block
    assert ("  by batch: B <= 1: sglang.topk_v2; 1 < B <= 8: cuda.radix (rows <= 12K: sglang.topk_v2, "
            "rows > 12K: cuda.radix); 8 < B <= 32: cuda.radix (rows <= 12K: sglang.topk_v2, rows > 12K: cuda.radix); "
            "32 < B <= 128: cuda.radix (rows <= 12K: sglang.topk_v2, rows > 12K: cuda.radix); B > 128: cuda.radix "
            "(--batch-size B explains one, with --max-seq-len L a sub-band)\n") in block
    code, out, err = run(capsys, "explain", "--json", *H200_VERIFY, "--op", "topk")
    (decision,) = json.loads(out)["decisions"]
    assert decision["band"] is None
    assert [(b["batch_size_up_to"], b["serves"], b["backend"]) for b in decision["bands"]] == [
        (1, "B <= 1", "sglang.topk_v2"), (8, "1 < B <= 8", "cuda.radix"), (32, "8 < B <= 32", "cuda.radix"),
        (128, "32 < B <= 128", "cuda.radix"), (256, "B > 128", "cuda.radix")]


def test_a_key_without_bands_lists_none(capsys):
    code, out, err = run(capsys, "explain", "--gpu", "h200", "--forward-mode", "target_verify", "--next-n", "4",
                         "--op", "paged_mqa_logits")  # one backend wins every batch size there
    assert code == 0, err
    assert "by batch:" not in out


# Rows past 12K keys: one request's band chooses SGLang's v2, larger batches' `cuda.radix`.
@pytest.mark.parametrize("lengths, backend", [("20000", "sglang.topk_v2"), ("20000,19000,18000,17000", "cuda.radix"),
                                              (",".join(["20000"] * 40), "cuda.radix")])
def test_seq_lens_give_the_batch_size(capsys, lengths, backend):
    code, out, err = run(capsys, "explain", "--json", *H200_VERIFY, "--seq-lens", lengths)
    assert code == 0, err
    payload = json.loads(out)
    topk = next(d for d in payload["decisions"] if d["op"] == "topk")
    assert payload["plan"]["batch_size"] == len(lengths.split(",")) and topk["backend"] == backend


@pytest.mark.parametrize("value, message", [
    ("0", "argument --batch-size: --batch-size is 0; it must be from 1 to 1024"),
    ("-4", "argument --batch-size: --batch-size is -4; it must be from 1 to 1024"),
    ("1025", "argument --batch-size: --batch-size is 1025; it must be from 1 to 1024"),
    ("eight", "argument --batch-size: --batch-size 'eight' is not an integer"),
    ("2.5", "argument --batch-size: --batch-size '2.5' is not an integer"),
])
def test_a_batch_size_that_cannot_occur_is_a_usage_error(capsys, value, message):
    code, out, err = run(capsys, "explain", *H200_VERIFY, f"--batch-size={value}")
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_a_batch_size_that_contradicts_the_lengths_is_refused(capsys):
    code, out, err = run(capsys, "explain", *H200_VERIFY, "--seq-lens", "30,40", "--batch-size", "3")
    assert code == 2 and out == ""
    assert "--batch-size 3 but --seq-lens lists 2 requests" in err
    code, out, err = run(capsys, "explain", *H200_VERIFY, "--seq-lens", "30,40", "--batch-size", "2")
    assert code == 0, err
