"""Draw a `python -m dispatch bench --json` report as a picture: per (op, next_n) one panel of time
against mean context length and, under it, one of each time's ratio to the fastest backend at that
(batch size, length); one colour per backend, one marker and line style per batch size, the legend
outside the panels.

    python tools/plot_bench.py bench.json -o docs/images/BENCHMARKS-grid.png

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


def ratios(lines: dict[tuple[str, int], list[tuple[int, float]]]) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """One panel's lines as ratios to the fastest backend at each (batch size, length): 1.0 is the
    fastest there; a point only one backend timed is 1.0 by definition."""
    fastest: dict[tuple[int, int], float] = {}
    for (_, batch), points in lines.items():
        for length, us in points:
            fastest[(batch, length)] = min(us, fastest.get((batch, length), us))
    return {
        line: [(length, us / fastest[(line[1], length)]) for length, us in points] for line, points in lines.items()
    }


def length_label(length: int) -> str:
    return f"{length // 1024}K" if length >= 1024 else str(length)


def draw(report: dict, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = series(report)
    if not panels:
        raise SystemExit("the report has no timed rows with a B=/N=/L~ shape to draw")
    keys = sorted(panels)
    fig, axes = plt.subplots(2, len(keys), figsize=(4.2 * len(keys) + 2.4, 7.2), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [3, 2]})
    # One colour per backend, one marker and line style per batch size, so both read at a glance.
    backends = sorted({backend for lines in panels.values() for backend, _ in lines})
    batches = sorted({batch for lines in panels.values() for _, batch in lines})
    colours = {backend: f"C{i}" for i, backend in enumerate(backends)}
    styles = {batch: (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ("-", "v"))[i % 5] for i, batch in enumerate(batches)}
    handles = {}
    for column, key in enumerate(keys):
        times, relative = axes[0][column], axes[1][column]
        ticks = sorted({length for points in panels[key].values() for length, _ in points})
        for (backend, batch), points in sorted(panels[key].items()):
            line, marker = styles[batch]
            look = {"color": colours[backend], "linestyle": line, "marker": marker, "markersize": 4}
            (handle,) = times.plot(*zip(*points), **look)
            relative.plot(*zip(*ratios(panels[key])[(backend, batch)]), **look)
            handles[f"{backend} B={batch}"] = handle
        op, next_n = key
        times.set(title=f"{op}, next_n={next_n}", ylabel="median us", xscale="log", yscale="log")
        relative.set(xlabel="mean context length", ylabel="x the fastest", xscale="log")
        relative.axhline(1.0, color="black", linewidth=0.8)
        for axis in (times, relative):
            axis.set_xticks(ticks, [length_label(t) for t in ticks])
            axis.minorticks_off()
            axis.grid(True, which="major", alpha=0.3)
    # One legend for the whole figure, right of the panels, so it never covers a point.
    fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7,
               frameon=False)
    fig.suptitle(f"{report['machine']}, {report['date']}, torch {report['torch']}, triton {report['triton']}")
    fig.tight_layout()
    fig.savefig(output, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a `dispatch bench --json` file")
    parser.add_argument("-o", "--output", default="bench.png")
    args = parser.parse_args()
    with open(args.report) as handle:
        draw(json.load(handle), args.output)


if __name__ == "__main__":
    main()
