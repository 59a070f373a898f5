"""The project's documentation as the meta-tests read it: README.md, then every page under docs/
(sorted, so a failure names the same text on every machine)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def documentation_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def documentation_text() -> str:
    """Every documentation file's text, one after another."""
    return "\n".join(path.read_text() for path in documentation_files())
