"""Timing: CUDA events on a GPU (warm-up, median of repeats), the host clock on a CPU."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable


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
    fns: list[Callable[[], object]], *, on_gpu: bool, repeats: int, budget_s: float | None = None
) -> tuple[float, str]:
    """(median seconds per call, method), cycling through several input sets so the L2 never holds
    the next one. On a GPU the calls are captured in one CUDA graph, as engines run the indexer, so
    the figure is the kernels' time, not Python's launch overhead; eager timing is the fallback."""
    if on_gpu:
        graph = _captured(fns)
        if graph is not None:
            return time_cuda(graph.replay, repeats=repeats, budget_s=budget_s) / len(fns), "graph"
    cycle = itertools.cycle(fns)

    def next_call() -> object:
        return next(cycle)()

    timer = time_cuda if on_gpu else time_host
    return timer(next_call, repeats=repeats, budget_s=budget_s), "eager"


def _captured(fns: list[Callable[[], object]]):
    import torch

    for fn in fns:  # compile, JIT and allocate outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    except RuntimeError:
        return None
    return graph
