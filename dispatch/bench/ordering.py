"""How `tune` orders measured backends: for a key over all its shapes, per batch-size band over each
batch size's shapes alone, and per length sub-band over one batch size's shapes of one mean length
(dispatch/registry/measured_bands.py says which batches each serves). One rule for all, so a band is
exactly the order tune would write for a key measured at that batch size only. These functions take
the recorded per-shape medians, so an overlay's bands can be derived again from the times it holds."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dispatch.registry.measured import MEASURED_TIE as TIE, geometric_mean
from dispatch.registry.measured_bands import batch_size_of, length_bound, mean_len_of


def measured_order(names: Iterable[str], mean_us: Callable[[str], float], rule_order: list[str]) -> list[str]:
    """`names` fastest first by `mean_us`, where, at each place, the backend earliest in `rule_order`
    among those within TIE of the fastest still unplaced goes first. The band is against that fastest,
    never a neighbour, so ties do not chain (what the loader checks)."""
    rank = {name: i for i, name in enumerate(rule_order)}
    left = sorted(((name, mean_us(name)) for name in names), key=lambda pair: (pair[1], pair[0]))
    placed = []
    while left:
        fastest = min(mean for _, mean in left)
        tied = [pair for pair in left if pair[1] <= fastest * (1 + TIE)]
        first = min(tied, key=lambda pair: (rank.get(pair[0], len(rank)), pair[1]))
        placed.append(first[0])
        left.remove(first)
    return placed


def band_orders(shapes: list[dict], order: list[str], rule_order: list[str], step_shapes: list[dict] = ()) -> list[dict]:
    """The `bands` of a preference whose key's order is `order`, from its shapes as tune writes them
    ([{"shape": "B=8 N=1 L~8K ...", "median_us": {backend: us}}]): one band per batch size, ascending, each
    ordered by the geometric mean over that batch size's shapes. Where `step_shapes` (the whole step's
    times, same form) time every shape of a batch size, its band is ordered by those instead and says
    so (`ranked_by: step`). Inside a band, where the fastest differs between that batch size's measured
    lengths, `lengths`: one sub-band per mean length L, ascending, bounded by 3L/2 (length_sub_bands).
    None ([]) unless every shape names a batch size and there are at least two, or one with sub-bands;
    and none where every band's order is the key's, none is ranked by the step and none has sub-bands."""
    by_size = _grouped(shapes, batch_size_of)
    if by_size is None:
        return []
    stepped = step_times_by_size(shapes, step_shapes)
    step_by_label = {shape["shape"]: shape for shape in step_shapes}
    bands = []
    for size in sorted(by_size):
        ranking = [step_by_label[s["shape"]] for s in by_size[size]] if size in stepped else by_size[size]
        banded = _ordered(ranking, order, rule_order)
        lengths = length_sub_bands(ranking, order, rule_order, "step" if size in stepped else "op")
        bands.append({"batch_size_up_to": size, "order": banded, **({"ranked_by": "step"} if size in stepped else {}),
                      **({"lengths": lengths} if lengths else {})})
    if len(bands) < 2 and not any("lengths" in band for band in bands):
        return []
    if all(band["order"] == list(order) and "ranked_by" not in band and "lengths" not in band for band in bands):
        return []
    return bands


def length_sub_bands(shapes: list[dict], order: list[str], rule_order: list[str], ranked_by: str = "op") -> list[dict]:
    """One batch size's length sub-bands from its shapes (the times its band is ranked by): one per
    measured mean length L, ascending, `max_seq_len_up_to` 3L/2 (the longest request a batch of mean L
    holds, so every measured batch lands in its own sub-band), each ordered by that length's shapes.
    None ([]) unless every shape names a length, there are at least two, and the fastest differs
    between them: where one backend leads at every length the band's order serves them all."""
    by_length = _grouped(shapes, mean_len_of)
    if by_length is None or len(by_length) < 2:
        return []
    subs = [{"max_seq_len_up_to": length_bound(length), "order": _ordered(by_length[length], order, rule_order),
             **({"ranked_by": "step"} if ranked_by == "step" else {})} for length in sorted(by_length)]
    if len({sub["order"][0] for sub in subs}) < 2:
        return []
    return subs


def _grouped(shapes: list[dict], value_of: Callable[[str], int | None]) -> dict[int, list[dict]] | None:
    """The shapes by the value their label names (a batch size, a mean length), in order of first
    appearance; None when a label names none."""
    groups: dict[int, list[dict]] = {}
    for shape in shapes:
        value = value_of(shape["shape"])
        if value is None:
            return None
        groups.setdefault(value, []).append(shape)
    return groups


def _ordered(shapes: list[dict], order: list[str], rule_order: list[str]) -> list[str]:
    return measured_order(order, lambda name: geometric_mean([s["median_us"][name] for s in shapes]), rule_order)


def step_times_by_size(shapes: list[dict], step_shapes: list[dict]) -> dict[int, list[dict[str, float]]]:
    """{batch size: the step's times at each of its shapes} for the batch sizes whose every shape the
    step timed."""
    stepped = {shape["shape"]: shape["median_us"] for shape in step_shapes}
    sizes: dict[int, list[str]] = {}
    for shape in shapes:
        sizes.setdefault(batch_size_of(shape["shape"]), []).append(shape["shape"])
    return {size: [stepped[label] for label in labels] for size, labels in sizes.items()
            if size is not None and all(label in stepped for label in labels)}
