"""`explain --engine sglang`: SGLang's own choice beside dispatch's (dispatch/engines/sglang/rules.py
imports no sglang, so these run with or without it)."""

from __future__ import annotations

import json

import pytest

from dispatch.cli.commands import main
from dispatch.engines.sglang.rules import sglang_choices
from dispatch.contract.key import Arch, DispatchKey, ForwardMode, Op

pytestmark = pytest.mark.engines


def choice(arch, mode, next_n):
    key = DispatchKey(arch=arch, forward_mode=mode, next_n=next_n, fp8_dtype="e4m3fnuz" if arch is Arch.GFX942 else "e4m3fn")
    return sglang_choices(key, [Op.PAGED_MQA_LOGITS])[0]


@pytest.mark.parametrize(("arch", "next_n", "layout"), [
    (Arch.SM90, 2, "flatten"), (Arch.SM90, 4, "flatten"), (Arch.SM100, 2, "native"), (Arch.SM100, 4, "native"),
])
def test_target_verify_native_only_on_sm100(arch, next_n, layout):
    picked = choice(arch, ForwardMode.TARGET_VERIFY, next_n)
    assert picked.layout == layout
    if layout == "native":
        assert "ctx_2d.shape == (B, next_n)" in picked.why  # the implicit check, named


def test_draft_extend_and_other_platforms():
    assert choice(Arch.SM100, ForwardMode.DRAFT_EXTEND, 4).layout == "flatten"
    assert "aiter" in choice(Arch.GFX942, ForwardMode.DECODE, 1).choice
    assert "#31480" in choice(Arch.SM120, ForwardMode.DECODE, 1).why


def test_cli_prints_both(capsys):
    assert main(["explain", "--arch", "sm90", "--forward-mode", "target_verify", "--next-n", "4", "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert "sglang 0.5.23 by its own rules" in out and "DeepGEMM fp8_paged_mqa_logits, flatten" in out
    assert main(["explain", "--arch", "sm100", "--forward-mode", "target_verify", "--next-n", "2", "--engine",
                 "sglang", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["engine"][0]["layout"] == "native" and document["decisions"][0]["op"] == "paged_mqa_logits"
