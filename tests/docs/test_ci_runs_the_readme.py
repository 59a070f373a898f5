"""CI runs what a user runs: `.ci/run`'s commands are the README's test command, in its order, and
nothing else (the README's first lines are the front door's promise)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_test_command() -> list[str]:
    block = re.search(r"# Set up, then run the tests[^\n]*\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no test command under '# Set up, then run the tests'"
    return [part.strip() for part in block.group(1).replace("\\\n", " ").split("&&")]


def ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in lines if line.startswith("python3 ")]
    return [line.replace(" --quiet", "") for line in commands]


def test_ci_runs_the_readme_test_command_and_nothing_else():
    assert ci_commands() == [" ".join(c.split()) for c in readme_test_command()]
