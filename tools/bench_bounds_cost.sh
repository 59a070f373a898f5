#!/usr/bin/env bash
# What the bounds checks cost on the GPU, in one call. First the bench the H200 ran before the bounds
# work (/work/briefs/gpu2/bench_before.txt, main at f37f925) with the same arguments, so the two tables
# compare row by row (per-layer logits call, CUDA-graph timed); then the per-batch page guard, which
# that per-layer timing leaves out by design (tools/time_page_guard.py).
#     tools/bench_bounds_cost.sh          # writes bench_bounds.txt and page_guard.txt into $OUT (or .)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python3 -m dispatch bench --op paged_mqa_logits --batch-sizes 32,128 --lengths 8192,32768 --next-n 1,4 \
    --repeats 20 | tee "$out/bench_bounds.txt"
PYTHONPATH=".:${PYTHONPATH:-}" python3 tools/time_page_guard.py | tee "$out/page_guard.txt"
