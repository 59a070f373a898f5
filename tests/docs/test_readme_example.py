"""The README's engine example runs as written, on the CPU: its code block is extracted from README.md
and executed, and its top-k holds exactly each token's visible keys (fewer than k are visible, so all
of them), -1 padded."""

from __future__ import annotations

from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def engine_example() -> str:
    """The first python block of the section "Use it from an engine"."""
    text = README.read_text()
    section = text[text.index("## Use it from an engine") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```\n", start)]


def test_the_readme_engine_example_runs_and_selects_every_visible_key():
    names: dict[str, object] = {}
    exec(compile(engine_example(), f"{README}:engine example", "exec"), names)  # noqa: S102 (our own README)
    topk, seq_lens, N = names["topk"], names["seq_lens"], names["N"]
    assert topk.dtype == torch.int32 and topk.shape == (seq_lens.numel() * N, 2048)
    for row in range(topk.shape[0]):
        length = int(seq_lens[row // N])
        visible = length - N + row % N + 1  # token j of a request of total length L sees L - N + j + 1 keys
        chosen = topk[row][topk[row] >= 0]
        # A selection of positions, not a computed number: exact. Every visible key is kept (fewer than k).
        assert sorted(chosen.tolist()) == list(range(visible)), row
        assert (topk[row][visible:] == -1).all()


def test_the_example_states_every_tensors_shape_and_dtype():
    lines = engine_example().splitlines()
    for tensor in ("q", "weights", "positions", "cos_sin_cache", "kv_caches", "seq_lens", "page_table"):
        at = next(number for number, line in enumerate(lines) if line.startswith(f"{tensor} = "))
        # The comment at the end of its line, or on the line above it.
        comment = lines[at].partition("#")[2] or lines[at - 1].partition("#")[2]
        assert "[" in comment, f"the README example does not give {tensor}'s shape in a comment"
