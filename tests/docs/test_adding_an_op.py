"""docs/adding-an-op.md's numbered list is the real list of non-test files a new op touches: each
names a file that exists (`<op>` read as an existing op's file), and there are at most 6 of them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOST_FILES = 6  # issue 21: adding an op touches at most 6 non-test files


def listed_files() -> list[str]:
    text = (ROOT / "docs" / "adding-an-op.md").read_text()
    return re.findall(r"^\d+\. `([^`]+)`", text, flags=re.MULTILINE)


def test_the_list_is_short_and_names_real_files():
    files = listed_files()
    assert 0 < len(files) <= MOST_FILES, files
    for name in files:
        if "<op>" in name:  # a new file: its siblings are the existing ops' files
            folder = ROOT / name.split("<op>")[0]
            assert folder.is_dir() and any(folder.glob("*.py")), name
        else:
            assert (ROOT / name).is_file(), f"docs/adding-an-op.md lists `{name}`, which does not exist"



def test_the_concepts_ops_table_is_the_op_files():
    """docs/concepts.md's ops table: one row per op file, in the order the indexer step runs them
    (CONTRACT.stage), each with its CONTRACT's layouts."""
    from dispatch.contract.ops import OP_CONTRACTS

    text = (ROOT / "docs" / "concepts.md").read_text()
    table = text[text.index("| op | what it computes | layouts |"):]
    rows = re.findall(r"^\| `(\w+)` \| .* \| ([^|]+) \|$", table.split("\n\n")[0], flags=re.MULTILINE)
    in_stage_order = sorted(OP_CONTRACTS.values(), key=lambda contract: contract.stage)
    assert [name for name, _ in rows] == [contract.name for contract in in_stage_order]
    for (name, layouts), contract in zip(rows, in_stage_order):
        assert re.findall(r"`(\w+)`", layouts) == [layout.value for layout in contract.layouts], name
