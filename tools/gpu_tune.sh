#!/usr/bin/env bash
# Issue 14 on the H200: measure cluster h200-mtp's workload (registry.yaml) with `dispatch tune`, print the
# overlay, and show explain deciding by it, the paged keys and the extend key alike. The paged keys took
# 35 s on 2026-11-30; the extend key (4 batches, M 4K-16K, S up to 64K, the reference timed too) is
# estimated at 1-3 minutes more (the run prints its elapsed time as it goes).
# Wheels in .whl/gpu (pydantic, sgl-deep-gemm, ...) are installed first if present, as .ci/gpu does; then
# .device/peers/env.sh, where present (the git-ignored build of SGLang's and vLLM's top-k kernels from
# their published sources), is sourced so the engines' kernels are candidates too. Every time is taken
# in CUDA graphs, and the top-k at B <= 32 is ranked by the whole step (docs/tune.md).
# Arguments are passed on to tune (`bash tools/gpu_tune.sh --step-up-to 128` ranks every top-k band by the step).
# The overlay is written to measured/h200-mtp.yaml (and copied to $OUT when set), the path cluster
# h200-mtp includes; review it and commit it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/gpu/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
if [ -f .device/peers/env.sh ]; then
  set +u; source .device/peers/env.sh; set -u
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # this tree's dispatch first, whatever the peers' environment adds
  echo "peers: sourced .device/peers/env.sh"
fi
overlay=measured/h200-mtp.yaml
date -u; nvidia-smi -L
# rc 1: a backend failed its check (the overlay is written, that backend never preferred); 124: out of time
# (nothing written: the overlay is written once every key is measured).
rc=0; timeout 540 python3 -m dispatch tune --cluster h200-mtp -o "$overlay" "$@" || rc=$?
echo "tune rc=$rc"
[ "$rc" = 0 ] || [ "$rc" = 1 ] || exit "$rc"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/measured" && cp "$overlay" "$OUT/measured/"; fi
cat "$overlay"
# registry.yaml's cluster h200-mtp includes the overlay just written: validate, then explain every key.
python3 -m dispatch validate registry.yaml
for n in 1 2 4; do
  mode=$([ "$n" = 1 ] && echo decode || echo target_verify)
  python3 -m dispatch explain --registry registry.yaml --cluster h200-mtp --forward-mode "$mode" --next-n "$n"
done
python3 -m dispatch explain --registry registry.yaml --cluster h200-mtp --forward-mode extend --op all
# Issue 23 item 2: at each shape of its table, the decided top-k (by batch size and max_seq_len) against the
# fastest engine kernel this tune measured there; exit 1 where one is more than 3% behind.
table_rc=0; python3 tools/table_topk.py --registry registry.yaml --cluster h200-mtp || table_rc=$?
echo "table_topk rc=$table_rc"
