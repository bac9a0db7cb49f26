#!/usr/bin/env bash
# The shipped recipes measured as shipped (`make bench-recipes STAGE=...`, or `bash scripts/gpu_bench_recipes.sh OUT
# [STAGE]`): scripts/bench_recipes.py in the GPU runners' environment (scripts/gpu_common.sh: collective settings,
# carried wheels). STAGE one-gpu (one H200), two-gpu and moe (two H200s) or all (default). One call runs what fits
# BUDGET seconds (default 480: a call, its set-up and the copy stay inside a 10-minute limit), then writes the runs'
# state (artifacts/bench-recipes, as OUT/bench-recipes.tar.gz: one file, however deep the run directories) and the
# report (docs/results/recipes-<date>.json) into OUT; unpack the archive into artifacts/ and carry
# artifacts/bench-recipes into the next call to go on where this one stopped. Done when OUT/status.txt says
# bench_recipes rc=0 (3: runs pending).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-bench-recipes}
STAGE=${2:-all}
BUDGET=${BUDGET:-480}
source scripts/gpu_common.sh
# shellcheck disable=SC2086  # ARGS: further scripts/bench_recipes.py options, e.g. ARGS="--steps 20 --warmup 8"
step bench_recipes $((BUDGET + 60)) $PY -m scripts.bench_recipes --stage "$STAGE" --budget-s "$BUDGET" ${ARGS:-}
mkdir -p "$OUT/results"
tar -czf "$OUT/bench-recipes.tar.gz" -C artifacts bench-recipes 2>/dev/null
cp docs/results/recipes-*.json "$OUT/results/" 2>/dev/null
report
