"""Every relative link in the documentation (README.md, docs/) points at a file of the repository, and
every `#anchor` at a heading of the page it names, so moving a page cannot leave a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.documentation import ROOT, documentation_files

LINK = re.compile(r"\]\(([^)\s]+)\)")
# Pages that arrive with other work (the engine plugins) and are linked ahead of it, as the README
# says; once a page exists it is checked like any other.
ANNOUNCED = {"docs/engines/sglang.md", "docs/engines/vllm.md"}


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose_lines(file: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a `# comment` in a bash block is no heading)."""
    lines, fenced = [], False
    for line in file.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def links() -> list[tuple[str, str]]:
    found = []
    for page in documentation_files():
        for target in LINK.findall(page.read_text()):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
                found.append((str(page.relative_to(ROOT)), target))
    return found


def test_there_are_links_to_check():
    assert len(links()) > 20


@pytest.mark.parametrize("page, target", links(), ids=lambda value: value)
def test_every_relative_link_resolves(page, target):
    path, _, fragment = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    name = str(file.resolve().relative_to(ROOT.resolve()))
    if name in ANNOUNCED and not file.exists():
        return
    assert file.exists(), f"{page} links to {target}, which does not exist"
    if fragment and file.suffix == ".md":
        headings = {anchor(line.lstrip("#")) for line in prose_lines(file) if line.startswith("#")}
        assert fragment in headings, f"{page} links to {target}: no heading of {name} has that anchor"
