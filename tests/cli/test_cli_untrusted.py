"""Every user mistake on bench, tune, validate and explain is a located error with exit 2, no traceback,
found before any measurement starts; what the CLI prints stays bounded (issue 24)."""

from __future__ import annotations

import time

import pytest

from dispatch.contract.backend import Support
from dispatch.cli.commands import main
from dispatch.contract.errors import PluginError
from dispatch.contract.key import DispatchKey, Op
from dispatch.contract.limits import MAX_ERRORS_LISTED, MAX_MESSAGE_CHARS
from dispatch.deciding.runtime import DEFAULT_REGISTRY
from tests.support.fakes import catalog_of, dispatcher, fake_backend

LONG = "n" * 300  # longer than a file name may be (255 bytes on Linux filesystems)


def _exit_2_at_once(capsys, argv, words):
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < 20  # refused before anything is measured
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("argv", "words"), [
    (["--extend-shapes", "abc"], "'abc' is not RxE+P"),
    (["--extend-shapes", "4x0+3"], "R must be from 1"),
    (["--repeats", "0"], "argument --repeats: 0 is out of range; it must be from 1 to 1000"),
    (["--heads", "0"], "argument --heads: 0 is out of range"),
    (["--head-dim", "-4"], "argument --head-dim: -4 is out of range"),
    (["--batch-sizes", "1e9"], "argument --batch-sizes: '1e9' is not an integer"),
    (["--batch-sizes", "1000000000"], "argument --batch-sizes: 1000000000 is out of range"),
    (["--lengths", ",".join(["8"] * 17)], "17 values; at most 16"),
    (["--k", "0"], "argument --k: 0 is out of range"),
    (["--logits-budget", "0"], "argument --logits-budget: 0 is out of range"),
])
def test_bench_refuses_bad_arguments(capsys, argv, words):
    _exit_2_at_once(capsys, ["bench", "--quick", *argv], words)


@pytest.mark.parametrize(("output", "words"), [
    ("/", "-o /: not a regular file"), ("/dev/full", "-o /dev/full: not a regular file"),
    (f"/tmp/{LONG}/overlay.yaml", "cannot write there: File name too long"),
])
def test_tune_refuses_an_output_it_cannot_write_before_measuring(capsys, output, words):
    _exit_2_at_once(capsys, ["tune", "--quick", "-o", output], words)


def test_tune_refuses_bad_repeats(capsys):
    _exit_2_at_once(capsys, ["tune", "--quick", "--repeats", "0"], "argument --repeats: 0 is out of range")


@pytest.mark.parametrize("argv", [["validate", f"/tmp/{LONG}.yaml"], ["explain", "--registry", f"/tmp/{LONG}.yaml"]])
def test_an_overlong_registry_path_is_a_located_error(capsys, argv):
    err = _exit_2_at_once(capsys, argv, "cannot read the registry: File name too long")
    assert len(err) < MAX_MESSAGE_CHARS + 200


def test_an_overlong_measured_path_is_a_located_error(capsys, tmp_path):
    text = DEFAULT_REGISTRY.read_text().replace("measured: measured/h200-mtp.yaml", f"measured: {LONG}.yaml")
    (tmp_path / "registry.yaml").write_text(text)
    _exit_2_at_once(capsys, ["validate", str(tmp_path / "registry.yaml")], "cannot be read: File name too long")


def _many_unknown(count: int, rule_id: str = "r") -> str:
    rules = "".join(f"      - {{id: {rule_id}{i}, when: {{next_n: {i + 1}}}, use: [nope{i}]}}\n" for i in range(count))
    return ("version: 1\nops:\n  paged_mqa_logits:\n    rules:\n" + rules + "    fallback: [torch.reference]\n"
            "  indexer_q_quant: {fallback: [torch.reference]}\n  topk: {fallback: [torch.reference]}\n"
            "  ragged_mqa_logits: {fallback: [torch.reference]}\n")


def test_validate_lists_at_most_fifty_problems_each_cut(capsys, tmp_path):
    path = tmp_path / "registry.yaml"
    path.write_text(_many_unknown(200))
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) <= MAX_ERRORS_LISTED + 1 and "more" in lines[-1], lines[-3:]
    path.write_text(_many_unknown(1, rule_id="x" * 20_000))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert all(len(line) <= MAX_MESSAGE_CHARS + 60 for line in err.splitlines()), max(map(len, err.splitlines()))


def test_the_unknown_cluster_error_lists_a_few_clusters(capsys, tmp_path):
    clusters = "".join(f"  c{i:05d}: {{prefer: [torch.reference]}}\n" for i in range(1000))
    path = tmp_path / "registry.yaml"
    path.write_text(_many_unknown(1).replace("nope0", "torch.reference") + "clusters:\n" + clusters)
    assert main(["explain", "--registry", str(path), "--cluster", "nope"]) == 2
    err = capsys.readouterr().err
    assert "and 992 more" in err and len(err) < MAX_MESSAGE_CHARS, err


@pytest.mark.parametrize("extra", [lambda key: 1 / 0, lambda key: 42], ids=["raises", "not-a-str"])
def test_a_plugin_whose_support_check_fails_is_a_plugin_error(extra):
    text = """
    version: 1
    ops:
      paged_mqa_logits: {fallback: [odd]}
      indexer_q_quant: {fallback: [quant]}
      topk: {fallback: [top]}
      ragged_mqa_logits: {fallback: [ragged]}
    """
    catalog = catalog_of(_with_extra(fake_backend("odd"), extra), fake_backend("quant", Op.INDEXER_Q_QUANT),
                         fake_backend("top", Op.TOPK), fake_backend("ragged", Op.RAGGED_MQA_LOGITS))
    chooser = dispatcher(text, catalog)
    with pytest.raises(PluginError, match=r"plugin `plugin-paged_mqa_logits-odd` .*backend `odd`'s supports.extra"):
        chooser.decide(Op.PAGED_MQA_LOGITS, DispatchKey("sm90", "decode", 1, "e4m3fn"))


def _with_extra(backend, extra):
    import dataclasses

    return dataclasses.replace(backend, supports=Support(extra=extra))
