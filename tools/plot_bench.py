"""Draw a `python -m dispatch bench --json` report as a picture: time against mean context length,
one panel per (op, next_n), one line per backend and batch size.

    python tools/plot_bench.py bench.json -o BENCHMARKS-grid.png

Needs matplotlib (a development tool, not a dependency of dispatch: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

SHAPE = re.compile(r"B=(?P<batch>\d+) N=(?P<next_n>\d+) L~(?P<length>\d+)(?P<unit>K?)")


def shape_fields(label: str) -> tuple[int, int, int] | None:
    """(batch size, next_n, mean length) from a bench row's shape label, or None for other shapes."""
    match = SHAPE.search(label)
    if match is None:
        return None
    length = int(match["length"]) * (1024 if match["unit"] else 1)
    return int(match["batch"]), int(match["next_n"]), length


def series(report: dict) -> dict[tuple[str, int], dict[tuple[str, int], list[tuple[int, float]]]]:
    """{(op, next_n): {(backend, batch size): [(length, median us), ...] sorted by length}}."""
    panels: dict = defaultdict(lambda: defaultdict(list))
    for row in report["rows"]:
        fields = shape_fields(row["shape"])
        if fields is None or row.get("median_us") is None:
            continue
        batch, next_n, length = fields
        panels[(row["op"], next_n)][(row["backend"], batch)].append((length, row["median_us"]))
    for lines in panels.values():
        for points in lines.values():
            points.sort()
    return panels


def draw(report: dict, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = series(report)
    if not panels:
        raise SystemExit("the report has no timed rows with a B=/N=/L~ shape to draw")
    keys = sorted(panels)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4), squeeze=False)
    # One colour per backend, one line style per batch size, so both read at a glance.
    backends = sorted({backend for lines in panels.values() for backend, _ in lines})
    batches = sorted({batch for lines in panels.values() for _, batch in lines})
    colours = {backend: f"C{i}" for i, backend in enumerate(backends)}
    styles = {batch: ("-", "--", ":", "-.")[i % 4] for i, batch in enumerate(batches)}
    for axis, key in zip(axes[0], keys):
        lengths_seen = set()
        for (backend, batch), points in sorted(panels[key].items()):
            lengths, times = zip(*points)
            lengths_seen.update(lengths)
            axis.plot(lengths, times, marker="o", color=colours[backend], linestyle=styles[batch],
                      label=f"{backend} B={batch}")
        op, next_n = key
        axis.set(title=f"{op}, next_n={next_n}", xlabel="mean context length", ylabel="median us", xscale="log", yscale="log")
        ticks = sorted(lengths_seen)
        axis.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
        axis.minorticks_off()
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(fontsize=6)
    fig.suptitle(f"{report['machine']}, {report['date']}, torch {report['torch']}, triton {report['triton']}")
    fig.tight_layout()
    fig.savefig(output, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a `dispatch bench --json` file")
    parser.add_argument("-o", "--output", default="bench.png")
    args = parser.parse_args()
    with open(args.report) as handle:
        draw(json.load(handle), args.output)


if __name__ == "__main__":
    main()
