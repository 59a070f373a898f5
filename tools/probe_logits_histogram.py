"""Issue 23 item 4, measured: what a first-digit histogram written in the paged logits kernel's
epilogue costs the logits, against what it could save the top-k (the Triton top-k's bracket launch).

    PYTHONPATH=. python3 tools/probe_logits_histogram.py            # on a GPU; JSON to $OUT if set
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/probe_logits_histogram.py --smoke   # CPU check

Per shape (B requests, next_n, context L uniform in [L/2, 3L/2]), k = 2048: the Triton paged logits
kernel (guard and schedule built once per batch, outside the timing) without and with `histogram=`
(int32 [rows, 2048], zeroed inside the timed call as a serving step would), each replayed from a CUDA
graph, median of triton.testing.do_bench (L2 flushed before each); then the Triton top-k over those
logits with the profiler's per-kernel times (bracket, split, finish). The histogram is checked against
a torch count of the logits' first digits before anything is timed. "saves at most" is the bracket's
time minus the epilogue's cost: what a top-k that read the histogram instead of sampling could gain.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.triton.paged_mqa_logits import HIST_BINS, triton_paged_mqa_logits  # noqa: E402
from backends.triton.topk import launch, launch_config  # noqa: E402
from dispatch.contract.layout import Layout  # noqa: E402
from tools import probe_topk, tune_paged_mqa_logits  # noqa: E402

K = 2048
SHAPES = [(128, 4, 32768), (128, 1, 32768), (32, 2, 8192), (64, 4, 65536), (8, 1, 2048), (8, 4, 8192)]
SMOKE = "--smoke" in sys.argv
if SMOKE:
    K, SHAPES = 64, [(3, 2, 512)]
    tune_paged_mqa_logits.DEVICE = "cpu"
DEVICE = "cpu" if SMOKE else "cuda"


def first_digit_histogram(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    bits = logits.contiguous().view(torch.int32).long()
    digits = torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits | 0x80000000) >> 21
    visible = (torch.arange(logits.shape[1], device=logits.device)[None, :] < lengths[:, None]) & ~torch.isnan(logits)
    flat = torch.arange(logits.shape[0], device=logits.device)[:, None] * HIST_BINS + digits
    return torch.bincount(flat[visible], minlength=logits.numel() // logits.shape[1] * HIST_BINS).view(-1, HIST_BINS)


def probe_shape(batch_size: int, next_n: int, context: int) -> dict:
    batch = tune_paged_mqa_logits.Batch(batch_size, context // 2, context * 3 // 2, sets=1, seed=batch_size + next_n)
    inputs = batch.inputs(next_n, Layout.NATIVE, seed=next_n)[0]
    guard = batch.guards[id(inputs)]
    schedule = tune_paged_mqa_logits.schedule_for(inputs[3], batch.max_len, 64)
    rows = inputs[3].numel()
    out = torch.empty(rows, batch.max_len, device=DEVICE)
    histogram = torch.zeros(rows, HIST_BINS, dtype=torch.int32, device=DEVICE)

    def plain():
        triton_paged_mqa_logits(*inputs, guard=guard, schedule=schedule, out=out)

    def with_histogram():
        histogram.zero_()
        triton_paged_mqa_logits(*inputs, guard=guard, schedule=schedule, out=out, histogram=histogram)

    with_histogram()
    lengths = inputs[3].reshape(-1)
    config = launch_config(rows, batch.max_len, K)
    counted = torch.equal(histogram.long().cpu(), first_digit_histogram(out, lengths).cpu())
    result = {"shape": f"B{batch_size} N{next_n} L{context // 1024}K" if context >= 1024 else f"B{batch_size} N{next_n} L{context}", "rows": rows, "width": batch.max_len,
              "histogram_exact": counted,
              "logits_us": probe_topk.bench(plain, graph=True),
              "logits_hist_us": probe_topk.bench(with_histogram, graph=True),
              "topk_us": probe_topk.bench(lambda: launch(out, lengths, K, **config), graph=True),
              "topk_kernels_us": probe_topk.kernel_times(lambda: launch(out, lengths, K, **config))}
    bracket = sum(us for name, us in result["topk_kernels_us"].items() if "bracket" in name)
    result["epilogue_cost_us"] = result["logits_hist_us"] - result["logits_us"]
    result["bracket_us"] = bracket
    result["saves_at_most_us"] = bracket - result["epilogue_cost_us"]
    return result


def main() -> None:
    if not SMOKE:
        print(f"# {torch.cuda.get_device_name()}, k = {K}; us, CUDA-graph replays, L2 flushed")
    results = [probe_shape(*shape) for shape in SHAPES]
    print(f"{'shape':14s} {'logits':>8s} {'+hist':>8s} {'cost':>7s} {'top-k':>7s} {'bracket':>8s} {'saves<=':>8s} hist")
    for r in results:
        print(f"{r['shape']:14s} {r['logits_us']:8.1f} {r['logits_hist_us']:8.1f} {r['epilogue_cost_us']:7.1f} "
              f"{r['topk_us']:7.1f} {r['bracket_us']:8.1f} {r['saves_at_most_us']:8.1f} "
              f"{'exact' if r['histogram_exact'] else 'WRONG'}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_logits_histogram.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
