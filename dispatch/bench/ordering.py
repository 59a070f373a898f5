"""How `tune` orders measured backends: for a key over all its shapes, and per batch-size band over
each batch size's shapes alone (dispatch/registry/measured_bands.py says which batches a band serves).
One rule for both, so a band is exactly the order tune would write for a key measured at that batch
size only. These functions take the recorded per-shape medians, so an overlay's bands can be derived
again from the times it already holds."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dispatch.registry.measured import MEASURED_TIE as TIE, geometric_mean
from dispatch.registry.measured_bands import batch_size_of


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
    ([{"shape": "B=8 N=1 ...", "median_us": {backend: us}}]): one band per batch size, ascending, each
    ordered by the geometric mean over that batch size's shapes. Where `step_shapes` (the whole step's
    times, same form) time every shape of a batch size, its band is ordered by those instead and says
    so (`ranked_by: step`). None ([]) unless every shape names a batch size and there are at least two,
    and none where every band's order is the key's and none is ranked by the step (no noise)."""
    by_size: dict[int, list[dict[str, float]]] = {}
    for shape in shapes:
        size = batch_size_of(shape["shape"])
        if size is None:
            return []
        by_size.setdefault(size, []).append(shape["median_us"])
    if len(by_size) < 2:
        return []
    stepped = step_times_by_size(shapes, step_shapes)
    bands = []
    for size in sorted(by_size):
        times = stepped.get(size) or by_size[size]
        banded = measured_order(order, lambda name: geometric_mean([t[name] for t in times]), rule_order)
        bands.append({"batch_size_up_to": size, "order": banded, **({"ranked_by": "step"} if size in stepped else {})})
    if all(band["order"] == list(order) and "ranked_by" not in band for band in bands):
        return []
    return bands


def step_times_by_size(shapes: list[dict], step_shapes: list[dict]) -> dict[int, list[dict[str, float]]]:
    """{batch size: the step's times at each of its shapes} for the batch sizes whose every shape the
    step timed."""
    stepped = {shape["shape"]: shape["median_us"] for shape in step_shapes}
    sizes: dict[int, list[str]] = {}
    for shape in shapes:
        sizes.setdefault(batch_size_of(shape["shape"]), []).append(shape["shape"])
    return {size: [stepped[label] for label in labels] for size, labels in sizes.items()
            if size is not None and all(label in stepped for label in labels)}
