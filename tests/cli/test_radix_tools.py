"""The `cuda.radix` timing tools' CPU-side parts: the phase-stamped copy of the kernel's source keeps every
line of it and stamps every point (so the tool fails loudly, never silently, when the kernel changes), and
the timing tool refuses a machine without a GPU, an unknown shape and an unknown CTA."""

import pytest

from tools import radix_phase_stamps, time_radix_variants


def test_the_stamped_copy_keeps_the_source_and_stamps_every_point():
    source = radix_phase_stamps.SOURCE.read_text()
    copy = radix_phase_stamps.stamped(source)
    for slot, _, _, _ in radix_phase_stamps.POINTS:
        assert f"  stamp({slot});\n" in copy
    assert 'm.def("stamps"' in copy and 'm.def("radix_topk"' in copy
    # Without the stamps, their array and the two exports, the copy is the source, byte for byte.
    undone = copy.replace(radix_phase_stamps.HEADER, "namespace {\n", 1)
    undone = undone.replace(radix_phase_stamps.EXPORTS, "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n", 1)
    assert "".join(line for line in undone.splitlines(keepends=True) if not line.startswith("  stamp(")) == source


def test_a_point_whose_line_is_gone_is_refused_by_name():
    source = radix_phase_stamps.SOURCE.read_text().replace("  if (cut != 0u) {\n", "  if (cut > 0u) {\n")
    with pytest.raises(ValueError, match=r"point 3 \(cut\)"):
        radix_phase_stamps.stamped(source)


def test_the_timing_tool_needs_a_gpu_and_known_shapes(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        time_radix_variants.main(["x.cu", "--shapes", "7x7K"])
    assert "unknown shapes ['7x7K']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        time_radix_variants.main(["x.cu", "--cta", "auto,2048"])
    assert "unknown --cta ['2048']" in capsys.readouterr().err
    monkeypatch.setattr(time_radix_variants.torch.cuda, "is_available", lambda: False)
    assert time_radix_variants.main(["x.cu", "--shapes", "64x12K"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_paged_slots_map_back_to_the_positions_they_came_from():
    """--pages checks a paged variant by mapping its physical slots back: every visible position of a row
    (its page row's shuffled blocks, padding block 0 after them) round-trips, -1 stays -1, and a slot in
    a block of another request's pages maps past the row (the check then fails it)."""
    import torch

    from backends.adapted_topk import page_slots  # the forward map the served finish uses

    gen = torch.Generator().manual_seed(7)
    block, pages = 4, [3, 1, 5]
    blocks = (torch.randperm(sum(pages), generator=gen) + 1).split(pages)
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    for r, mine in enumerate(blocks):
        table[r, : len(mine)] = mine.to(torch.int32)
    page_rows = torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32)  # two tokens on request 0, two on request 2
    positions = torch.full((5, 6), -1, dtype=torch.int64)
    for token, request in enumerate(page_rows.tolist()):
        width = pages[request] * block
        positions[token, : min(6, width)] = torch.randperm(width, generator=gen)[:6]
    slots = page_slots(positions, table, page_rows, block)
    back = time_radix_variants.positions_of_slots(slots, table, page_rows, block)
    assert torch.equal(back.long(), positions)
    foreign = slots.clone()
    foreign[2, 0] = int(blocks[0][0]) * block + 1  # request 0's block in request 1's row
    back = time_radix_variants.positions_of_slots(foreign.to(torch.int32), table, page_rows, block)
    assert int(back[2, 0]) == table.shape[1] * block and torch.equal(back[3:].long(), positions[3:])
