"""DeepGEMM's SM90 schedule rule spelled out in plain Python (backends/deepgemm/guard_and_schedule.py says
where it was read), the reference its kernel and the recording stand-in are held to; and the marks of
the scheduler sources a stand-in ships so that the adapter computes the schedule itself."""

from __future__ import annotations

from pathlib import Path

from backends.deepgemm.guard_and_schedule import SPLIT_KV

_U32 = 2**32


def spelled_out(lens: list[list[int]], slots: int, clamp: bool) -> list[list[int]]:
    """The schedule rule one request and one slot at a time, in uint32 as DeepGEMM's kernel computes it."""
    batch, prefix, total = len(lens), [], 0
    for row in lens:
        length = row[-1] % _U32
        total = (total + ((length + SPLIT_KV - 1) % _U32) // SPLIT_KV) % _U32
        prefix.append(total)
    padded = prefix + [total]  # past the last request: no segments
    share, pivot = total // slots, slots - total % slots
    rows = []
    for slot in range(slots):
        start = (slot * share + (slot - pivot if slot > pivot else 0)) % _U32
        lo, hi = 0, batch
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if padded[mid] <= start else (lo, mid)
        request = min(lo, batch - 1) if clamp else lo
        before = padded[request - 1] if request > 0 else 0
        offset, own = (start - before) % _U32, (padded[request] - before) % _U32
        atom, split = (offset // own, offset % own) if own else (0, 0)
        rows.append([(request + atom) % _U32, split])
    rows.append([batch, 0])
    return [[v - _U32 if v >= 2**31 else v for v in row] for row in rows]  # as int32


def ship_scheduler_source(package_dir: Path, variant: str) -> Path:
    """A stand-in for the scheduler source a build ships: only the lines the adapter's check looks for
    (backends/deepgemm/guard_and_schedule.py's _RULE_SOURCES), of sgl-deep-gemm's or tokenspeed's."""
    from backends.deepgemm import guard_and_schedule as rule

    name, marks, _, _ = next(source for source in rule._RULE_SOURCES if source[2] == (variant == "tokenspeed"))
    path = package_dir.joinpath("include", "deep_gemm", "scheduler", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(marks + rule._COMMON_MARKS) + "\n")
    return path
