"""The registry example of docs/registry.md is one the loader accepts, beside a copy of the measured
overlay it names: a page that teaches the format must not teach a file `validate` refuses."""

from __future__ import annotations

import shutil
from pathlib import Path

from dispatch.cli.commands import main

ROOT = Path(__file__).resolve().parents[2]


def documented_registry() -> str:
    text = (ROOT / "docs" / "registry.md").read_text()
    start = text.index("```yaml\n") + len("```yaml\n")
    return text[start : text.index("```\n", start)]


def test_the_documented_registry_validates(tmp_path, capsys):
    (tmp_path / "measured").mkdir()
    shutil.copy(ROOT / "measured" / "h200-mtp.yaml", tmp_path / "measured" / "h200-mtp.yaml")
    (tmp_path / "registry.yaml").write_text(documented_registry())
    assert main(["validate", str(tmp_path / "registry.yaml")]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.startswith(f"ok: {tmp_path / 'registry.yaml'}: ")
