#!/usr/bin/env bash
# Speed levers one at a time on a shipped recipe, back to back on one GPU (docs/performance.md#levers):
#   bash scripts/gpu_levers.sh OUT RECIPE NAME=OVERRIDES [NAME=OVERRIDES ...]
# e.g. bash scripts/gpu_levers.sh artifacts/levers qwen3_vl-2b "fa2=kernels.attention=fa2 train.fp8=false" \
#        "fa4=kernels.attention=fa4 train.fp8=false"
# Each variant trains the recipe for 22 steps (6 untimed) on 1,000 built-in samples with no held-out split,
# checkpoint or export, through train.py as a user launches it; its summary (tokens/s per GPU, MFU, peak memory,
# loss after 22 steps) goes to OUT/levers-RECIPE.jsonl with the overrides and the tree's provenance, its log to
# OUT/RECIPE-NAME.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1 RECIPE=$2
shift 2
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
COMMON="train.max_steps=22 logging.timing_warmup_steps=6 data.num_samples=1000 data.eval_fraction=0
train.eval_every=0 checkpoint.every_steps=0 checkpoint.save_final=false checkpoint.export=false logging.report_to=none
logging.every_steps=2 logging.progress_bar=false train.memory_check=warn"
for variant in "$@"; do
  name=${variant%%=*} overrides=${variant#*=}
  run_dir=artifacts/levers/$RECIPE-$name
  rm -rf "$run_dir"
  start=$SECONDS
  # shellcheck disable=SC2086  # COMMON and the variant's overrides are word lists
  python3 train.py --config "recipes/$RECIPE.yaml" train.output_dir="$run_dir" $COMMON $overrides \
    >"$OUT/$RECIPE-$name.log" 2>&1
  rc=$?
  python3 - "$run_dir" "$RECIPE" "$name" "$overrides" "$rc" "$((SECONDS - start))" >>"$OUT/levers-$RECIPE.jsonl" <<'PY'
import json, sys
from pathlib import Path
from verification.provenance import provenance
run_dir, recipe, name, overrides, rc, wall = sys.argv[1:]
summary_file = Path(run_dir) / "summary.json"
summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
record = {"recipe": recipe, "variant": name, "overrides": overrides.split(), "rc": int(rc), "wall_s": int(wall)}
print(json.dumps({**record, "summary": summary, "provenance": provenance()}))
keys = ("tokens_per_s_per_gpu", "mfu", "peak_mem_gib", "loss_end")
print(recipe, name, f"rc={rc} {wall}s", *(f"{k}={(summary or {}).get(k)}" for k in keys), file=sys.stderr)
PY
done
