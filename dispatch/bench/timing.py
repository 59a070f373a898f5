"""Timing: CUDA events on a GPU (warm-up, median of repeats), the host clock on a CPU.

A captured CUDA graph is timed with the stream held behind a spin kernel while the host enqueues every
replay (time_graph): one event pair per replay times the device alone. Timed one replay at a time, a
call of a few microseconds measures the host instead: the start event runs as soon as it is recorded,
then the device waits for Python to launch the replay. The H200 tunes of 2026-12-01 timed one call at
a time and read 18-23 us for every top-k backend at B=8-32, where the graph replays of issue 23's table
gave 7-16."""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from typing import Callable

logger = logging.getLogger("dispatch")

# How a time was taken, as rows (`timing`) and tune's overlay (`timing`, dispatch.registry.measured) say it.
GRAPH = "graph"  # replays of a captured CUDA graph, the device's time
EAGER = "eager"  # each call launched from Python: the host clock on a CPU, CUDA events per call on a GPU
# Spin-kernel clock assumed when sizing the hold (cycles per second): no current GPU runs its SMs faster,
# so the hold is at least as long as asked (longer on a slower clock, which only waits more).
_HOLD_CLOCK_HZ = 2.5e9


def time_cuda(fn: Callable[[], object], *, repeats: int = 30, warmup: int = 5, budget_s: float | None = None) -> float:
    """Median seconds of fn() measured with CUDA events, one pair per call; with `budget_s`, fewer
    repeats (3 at least) where `repeats` calls would take longer than that (a slow reference)."""
    import torch

    if budget_s is not None:
        repeats = _within(budget_s, _one_call_cuda(fn), repeats)
        warmup = min(warmup, repeats)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def _one_call_cuda(fn: Callable[[], object]) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _within(budget_s: float, one_call_s: float, repeats: int) -> int:
    return max(3, min(repeats, int(budget_s / max(one_call_s, 1e-9))))


def time_host(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1, budget_s: float | None = None) -> float:
    """Median seconds of fn() on the host clock (CPU runs, and host-side dispatch overhead); `budget_s`
    as in time_cuda."""
    if budget_s is not None:
        start = time.perf_counter()
        fn()
        repeats = _within(budget_s, time.perf_counter() - start, repeats)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_rotating(
    fns: list[Callable[[], object]], *, on_gpu: bool, repeats: int, budget_s: float | None = None, what: str = ""
) -> tuple[float, str]:
    """(median seconds per call, method), cycling through several input sets so the L2 never holds
    the next one. On a GPU the calls are captured in one CUDA graph, as engines run the indexer, so
    the figure is the kernels' time, not Python's launch overhead; eager timing is the fallback, which
    the log names by `what` (the backend and shape)."""
    if on_gpu:
        graph = _captured(fns, what)
        if graph is not None:
            return time_graph(graph, repeats=repeats, budget_s=budget_s) / len(fns), GRAPH
    cycle = itertools.cycle(fns)

    def next_call() -> object:
        return next(cycle)()

    timer = time_cuda if on_gpu else time_host
    return timer(next_call, repeats=repeats, budget_s=budget_s), EAGER


def _captured(fns: list[Callable[[], object]], what: str = ""):
    """The calls captured in one CUDA graph, or None (said in the log) where a call cannot be captured
    (a host sync, a launch outside the capturing stream): that backend is then timed eagerly."""
    import torch

    for fn in fns:  # compile, JIT and allocate outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    except RuntimeError as error:
        logger.warning("timed eagerly%s: the call could not be captured in a CUDA graph: %s: %s",
                       f" ({what})" if what else "", type(error).__name__,
                       str(error).splitlines()[0] if str(error) else "")
        return None
    return graph


def time_graph(graph, *, repeats: int = 30, warmup: int = 3, budget_s: float | None = None) -> float:
    """Median seconds of one replay of a captured CUDA graph, each replay between its own pair of
    events, all enqueued behind a spin kernel that holds the stream until the host has launched them,
    so no replay waits for Python. Where the hold ran out first (gaps between the replays), it is
    doubled and the replays timed again, twice at most."""
    import torch

    if budget_s is not None:
        repeats = _within(budget_s, _one_call_cuda(graph.replay), repeats)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(warmup):  # the host's cost of launching one replay with its events, to size the hold
        torch.cuda.Event(enable_timing=True).record()
        graph.replay()
        torch.cuda.Event(enable_timing=True).record()
    launch_s = (time.perf_counter() - started) / warmup
    torch.cuda.synchronize()
    hold_s = 3 * repeats * launch_s + 50e-6
    for _ in range(3):
        samples, waited = _held_replays(graph, repeats, hold_s)
        if waited <= repeats // 10:
            break
        hold_s *= 2
    return statistics.median(samples)


# A device that waited longer than this between one replay's end event and the next one's start was
# waiting for the host (back to back, the two events are under a microsecond apart).
_HOST_WAIT_S = 3e-6


def _held_replays(graph, repeats: int, hold_s: float) -> tuple[list[float], int]:
    """(seconds of each replay, how many times the device waited for the host between two replays)."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    torch.cuda._sleep(int(hold_s * _HOLD_CLOCK_HZ))
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]
    gaps = [end.elapsed_time(start) / 1e3 for end, start in zip(ends, starts[1:])]
    return samples, sum(gap > _HOST_WAIT_S for gap in gaps)
