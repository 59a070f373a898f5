"""GPUs by name: `explain --gpu`, the `--arch h200` hint, and `python -m dispatch gpus`, whose markdown
is the README's table (kept from drifting by the test below)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.cli_session import clean_environment, run  # noqa: F401 (clean_environment: an autouse fixture)
from dispatch.contract.detect import detect_arch
from dispatch.contract.errors import InvalidKeyError
from dispatch.deciding.gpus import GPUS, find_gpu
from dispatch.contract.key import Arch

README = Path(__file__).resolve().parents[2] / "README.md"




@pytest.mark.parametrize(
    "name, arch",
    [("h200", "sm90"), ("NVIDIA H200", "sm90"), ("nvidia h100 80gb hbm3", "sm90"), ("H20", "sm90"),
     ("b200", "sm100"), ("GB200", "sm100"), ("L40S", "sm89"), ("rtx4090", "sm89"), ("RTX 4090", "sm89"),
     ("NVIDIA GeForce RTX 5090", "sm120"), ("mi300x", "gfx942"), ("AMD Instinct MI325X", "gfx942"),
     ("MI355X", "gfx950"), ("cpu", "cpu")],
)
def test_short_and_marketing_names_find_the_gpu(name, arch):
    assert find_gpu(name).arch.value == arch


def test_an_unknown_gpu_lists_the_names_known():
    with pytest.raises(InvalidKeyError, match=r"--gpu 'a100x' is not a GPU dispatch knows \(h100, h200"):
        find_gpu("a100x")


def test_every_alias_names_one_gpu():
    aliases = [alias for gpu in GPUS for alias in gpu.aliases]
    assert len(aliases) == len(set(aliases))


def test_explain_gpu_h200_takes_its_arch_dtype_and_cluster(capsys):
    code, out, err = run(capsys, "explain", "--json", "--gpu", "NVIDIA H200", "--forward-mode", "target_verify",
                         "--next-n", "4")
    assert code == 0, err
    (decision,) = json.loads(out)["decisions"]
    assert decision["key"] == {"arch": "sm90", "forward_mode": "target_verify", "next_n": 4, "fp8_dtype": "e4m3fn"}
    # The cluster prefers DeepGEMM's next_n 4 kernel where a build has it (measured ahead on 2026-12-01).
    assert (decision["cluster"], decision["backend"], decision["source"]) == ("h200-mtp", "deepgemm.sm90.n4",
                                                                              "cluster-prefer")
    code, out, _ = run(capsys, "explain", "--gpu", "h200")
    assert code == 0 and "explaining the H200 (NVIDIA H200): arch sm90, cluster `h200-mtp` (by its match)" in out


def test_explain_gpu_mi300x_takes_fnuz(capsys):
    code, out, err = run(capsys, "explain", "--json", "--gpu", "mi300x")
    assert code == 0, err
    (decision,) = json.loads(out)["decisions"]
    assert decision["key"]["fp8_dtype"] == "e4m3fnuz" and decision["backend"] == "rocm.fnuz"


def test_a_gpu_name_given_as_arch_is_refused_with_the_hint(capsys):
    code, _, err = run(capsys, "explain", "--arch", "h200")
    assert code == 2 and "h200 is a GPU name: use --gpu h200, or --arch sm90" in err
    code, _, err = run(capsys, "explain", "--arch", "sm91")
    assert code == 2 and "invalid choice: 'sm91' (choose from sm80, sm89, sm90" in err
    code, _, err = run(capsys, "explain", "--arch", "sm90", "--gpu", "h200")
    assert code == 2 and "not allowed with argument" in err


@pytest.mark.skipif(detect_arch() is not Arch.CPU, reason="the note is printed for a what-if, another arch than this one")
def test_a_bare_arch_says_which_cluster_a_real_gpu_would_match(capsys):
    code, out, err = run(capsys, "explain", "--arch", "sm90")
    assert code == 0, err
    assert "explaining sm90 as a what-if, no cluster" in out
    assert "a real H200 would match cluster `h200-mtp` (--gpu h200 applies it)" in out
    code, out, _ = run(capsys, "explain", "--arch", "sm90", "--cluster", "reference-only")
    assert code == 0 and "would match" not in out


def test_idle_is_refused_with_the_reason(capsys):
    code, _, err = run(capsys, "explain", "--forward-mode", "idle")
    assert code == 2 and "idle is a rank with no tokens this step: it runs no indexer op" in err


def test_gpus_decides_each_gpu_from_the_registry(capsys):
    code, out, err = run(capsys, "gpus", "--format", "json")
    assert code == 0, err
    rows = {row["gpu"]: row for row in json.loads(out)}
    assert list(rows) == [gpu.label for gpu in GPUS]
    h200 = rows["H200"]
    assert (h200["arch"], h200["cluster"]) == ("sm90", "h200-mtp")
    # A band that decides otherwise than the key, and a length sub-band otherwise than its band, is named.
    assert h200["decided"]["decode"] == (
        "deepgemm.sm90 (B <= 1: triton; B <= 1, rows > 12K: deepgemm.sm90)")
    assert h200["decided"]["MTP next_n 4"] == "deepgemm.sm90.n4"
    assert h200["verified"] == "measured on an H200"
    # The H200 overlay's top-k bands that decide otherwise than each key's own order are named beside it.
    assert h200["decided"]["top-k"] == (
        "decode: cuda.radix (B <= 1: sglang.topk_v2; 1 < B <= 8: sglang.topk_v2; B > 32, rows <= 12K: "
        "sglang.topk_v2), MTP next_n 2: cuda.radix (B <= 1: sglang.topk_v2; 1 < B <= 8, rows <= 12K: "
        "sglang.topk_v2; 8 < B <= 32, rows <= 12K: sglang.topk_v2; "
        "32 < B <= 128, rows <= 12K: sglang.topk_v2), MTP next_n 4: cuda.radix (B <= 1: sglang.topk_v2; "
        "1 < B <= 8, rows <= 12K: sglang.topk_v2; 8 < B <= 32, rows <= 12K: sglang.topk_v2; "
        "B > 64, rows <= 12K: sglang.topk_v2), extend: cuda.radix"
    )
    assert rows["B200"]["decided"]["decode"] == "deepgemm.sm100"
    assert "deepgemm.sm100: argument contract only" in rows["B200"]["verified"]
    assert rows["MI300X"]["fp8_dtype"] == "e4m3fnuz" and "rocm.fnuz: exact emulation" in rows["MI300X"]["verified"]
    assert rows["H100"]["cluster"] is None  # h200-mtp matches "NVIDIA H200*" only


def test_gpus_follows_the_registry(capsys, tmp_path):
    """Generated, not a table: a registry that sends sm100 to Triton changes the B200's row."""
    text = Path(README.parent / "registry.yaml").read_text()
    text = text.replace("use: [deepgemm.sm100, triton]", "use: [triton, deepgemm.sm100]")
    path = tmp_path / "registry.yaml"
    path.write_text(text.replace("measured: measured/h200-mtp.yaml", f"measured: {README.parent / 'measured/h200-mtp.yaml'}"))
    code, out, err = run(capsys, "gpus", "--format", "json", "--registry", str(path))
    assert code == 0, err
    b200 = next(row for row in json.loads(out) if row["gpu"] == "B200")
    assert b200["decided"]["decode"] == "triton" and b200["decided"]["extend"] == "triton"


def test_the_readme_table_is_the_commands_output(capsys):
    match = re.search(r"<!-- gpus:begin -->\n(.*?)\n<!-- gpus:end -->", README.read_text(), re.S)
    assert match, "README.md has no <!-- gpus:begin --> ... <!-- gpus:end --> table"
    code, out, err = run(capsys, "gpus", "--format", "markdown")
    assert code == 0, err
    assert match.group(1).strip() == out.strip(), (
        "README.md's GPU table differs from `python -m dispatch gpus --format markdown`; paste its output in"
    )


def test_backends_shows_how_each_backend_was_verified_per_arch(capsys):
    code, out, err = run(capsys, "backends", "--json")
    assert code == 0, err
    rows = {(row["name"], row["op"]): row for row in json.loads(out)}
    assert rows[("deepgemm.sm100", "paged_mqa_logits")]["verified"] == {"sm100": "argument contract only"}
    assert rows[("rocm.fnuz", "paged_mqa_logits")]["verified"] == {"gfx942": "exact emulation", "cpu": "CPU tests"}
    code, out, _ = run(capsys, "backends")
    assert "  verified: sm100: argument contract only" in out
