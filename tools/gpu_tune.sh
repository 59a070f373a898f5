#!/usr/bin/env bash
# Issue 14 on the H200: measure cluster h200-mtp's workload (registry.yaml) with `dispatch tune`, print the
# overlay, and show explain deciding by it. Under 3 minutes (estimated: the run prints its elapsed time).
# Wheels in .whl/gpu (pydantic, sgl-deep-gemm, ...) are installed first if present, as .ci/gpu does.
# The overlay is written to measured/h200-mtp.yaml (and copied to $OUT when set); commit it, then add
# `measured: measured/h200-mtp.yaml` to cluster h200-mtp in registry.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/gpu/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
overlay=measured/h200-mtp.yaml
date -u; nvidia-smi -L
# rc 1: a backend failed its check (the overlay is written, that backend never preferred); 124: out of time.
rc=0; timeout 175 python3 -m dispatch tune --cluster h200-mtp -o "$overlay" || rc=$?
echo "tune rc=$rc"
[ -f "$overlay" ] || exit 1
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/measured" && cp "$overlay" "$OUT/measured/"; fi
cat "$overlay"
# The shipped registry with the overlay included, as it will be once committed: validate, then explain.
registry=$(mktemp --suffix=.yaml)
sed "s|^  h200-mtp:\$|  h200-mtp:\n    measured: $PWD/$overlay|" registry.yaml > "$registry"
python3 -m dispatch validate "$registry"
for n in 1 2 4; do
  mode=$([ "$n" = 1 ] && echo decode || echo target_verify)
  python3 -m dispatch explain --registry "$registry" --cluster h200-mtp --forward-mode "$mode" --next-n "$n"
done
