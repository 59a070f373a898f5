"""The per-batch page guard's own cost on a GPU, which `bench` leaves out (it times one layer's call
with the plan built outside the timing, as an engine runs the plan once per batch for ~61 layers).

    PYTHONPATH=. python tools/time_page_guard.py [--layers 61]

Per shape and layout: the guard kernel's device time (CUDA events around a captured graph of it,
median), the same spread over the model's layers, and the host cost of build_plan with the engine's
pool size (the guard launched inside) and without it (the guard deferred to the first layer call).
"""

from __future__ import annotations

import argparse

import torch

from backends.shared.page_guard import PageGuard
from dispatch.bench.timing import time_cuda, time_host
from dispatch.bench.workload import LogitsShape, logits_inputs
from dispatch.contract.bounds import new_error_flags
from dispatch.contract.key import Fp8Dtype, ForwardMode, Op
from dispatch.contract.layout import Layout
from dispatch.step.paged_plan import PagedBatch, build_plan, layout_tensors
from dispatch.deciding.runtime import load_dispatcher


def guard_seconds(inputs, next_n: int, layout: Layout) -> float:
    lens, table = layout_tensors(layout, inputs.seq_lens, inputs.page_table, next_n)
    guard = PageGuard.allocate(lens, table, max(inputs.seq_lens_host), new_error_flags("cuda"))
    blocks = inputs.kv_cache.shape[0]
    guard.launch(blocks)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        guard.launch(blocks)
    return time_cuda(graph.replay, repeats=50, warmup=5)


def plan_host_seconds(dispatcher, inputs, next_n: int, pool: int | None) -> float:
    mode = ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY
    batch = PagedBatch(inputs.seq_lens, inputs.page_table, max(inputs.seq_lens_host), mode, next_n, num_kv_blocks=pool)

    def plan():
        return build_plan(dispatcher, batch, kv_fp8_dtype=Fp8Dtype.E4M3FN, pinned={Op.PAGED_MQA_LOGITS: "triton"},
                          allow_disabled=True)

    return time_host(plan, repeats=200, warmup=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    args = parser.parse_args()
    dispatcher = load_dispatcher()
    print(f"{'shape':34s} {'layout':8s} {'guard us':>9s} {'per layer us':>13s} "
          f"{'build_plan us (pool given)':>27s} {'(no pool)':>10s}")
    for batch_size in (32, 128):
        for length in (8192, 32768):
            for next_n in (1, 4):
                shape = LogitsShape(batch_size, next_n, length)
                inputs = logits_inputs(shape, Fp8Dtype.E4M3FN, "cuda", seed=0)
                with_pool = plan_host_seconds(dispatcher, inputs, next_n, inputs.kv_cache.shape[0])
                without = plan_host_seconds(dispatcher, inputs, next_n, None)
                for layout in (Layout.NATIVE, Layout.FLATTEN):
                    seconds = guard_seconds(inputs, next_n, layout)
                    print(f"{shape.label():34s} {layout.value:8s} {seconds * 1e6:9.2f} {seconds * 1e6 / args.layers:13.3f} "
                          f"{with_pool * 1e6:27.1f} {without * 1e6:10.1f}", flush=True)
                del inputs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
