"""Timing: CUDA events on a GPU (warm-up, median of repeats), the host clock on a CPU."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable


def time_cuda(fn: Callable[[], object], *, repeats: int = 30, warmup: int = 5) -> float:
    """Median seconds of fn() measured with CUDA events, one pair per call."""
    import torch

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


def time_host(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() on the host clock (CPU runs, and host-side dispatch overhead)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_rotating(fns: list[Callable[[], object]], *, on_gpu: bool, repeats: int) -> tuple[float, str]:
    """(median seconds per call, method), cycling through several input sets so the L2 never holds
    the next one. On a GPU the calls are captured in one CUDA graph, as engines run the indexer, so
    the figure is the kernels' time, not Python's launch overhead; eager timing is the fallback."""
    if on_gpu:
        graph = _captured(fns)
        if graph is not None:
            return time_cuda(graph.replay, repeats=repeats) / len(fns), "graph"
    cycle = itertools.cycle(fns)

    def next_call() -> object:
        return next(cycle)()

    return (time_cuda(next_call, repeats=repeats) if on_gpu else time_host(next_call, repeats=repeats)), "eager"


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
