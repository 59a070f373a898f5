"""`explain --engine vllm`: vLLM's own layout rule for a key, beside dispatch's decision. Pure: it needs
no vLLM installed (the rule is read from vLLM 0.33.0's source; the drift test checks it there)."""

import json

import pytest

from dispatch.cli.commands import main
from dispatch.engines.vllm.rules import vllm_choice
from dispatch.contract.key import DispatchKey


@pytest.mark.parametrize("arch,next_n,layout", [
    ("sm90", 1, "native"), ("sm90", 2, "native"), ("sm90", 3, "flatten"), ("sm90", 4, "native"),
    ("sm90", 5, "flatten"), ("sm100", 3, "varlen"), ("sm120", 2, "native"), ("sm120", 4, "flatten"),
    ("gfx942", 3, "flatten"),
])
def test_vllms_rule(arch, next_n, layout):
    mode = "decode" if next_n == 1 else "target_verify"
    fp8 = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    key = DispatchKey(arch=arch, forward_mode=mode, next_n=next_n, fp8_dtype=fp8)
    assert vllm_choice(key).layout == layout


def test_adaptive_verification_flattens_on_sm90():
    key = DispatchKey(arch="sm90", forward_mode="target_verify", next_n=4, fp8_dtype="e4m3fn")
    assert vllm_choice(key, adaptive_verification=True).layout == "flatten"


def test_explain_prints_both(capsys):
    assert main(["explain", "--arch", "sm90", "--forward-mode", "target_verify", "--next-n", "3",
                 "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "vllm would run: flatten (_use_flattening" in out
    assert "dispatch runs: triton (native, rule sm90-beyond-deepgemm)" in out


def test_explain_json_carries_the_engines_choice(capsys):
    assert main(["explain", "--arch", "sm90", "--next-n", "4", "--forward-mode", "target_verify",
                 "--engine", "vllm", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["engine"][0]["layout"] == "native" and document["decisions"]  # one row per op, as for sglang


def test_the_plugin_modules_import_no_vllm():
    """vLLM stays optional: the plugin's modules (and so the entry point's import) load without it."""
    import subprocess
    import sys

    code = ("import sys, dispatch.engines.vllm.plugin, dispatch.engines.vllm.op, dispatch.engines.vllm.rules, "
            "dispatch.engines.vllm.forward_plan, dispatch.engines.vllm.topk_writer, dispatch.engines.vllm.version; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
