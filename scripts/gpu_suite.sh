#!/usr/bin/env bash
# Every GPU check and benchmark in one go, for a CUDA machine (`make gpu-suite`, or `bash scripts/gpu_suite.sh OUT`).
#
# With two or more GPUs the work runs as two parallel tracks (GPU 0: correctness + kernel/packing benchmarks;
# GPU 1: training runs); with one GPU the tracks run one after the other. Each step has its own time limit and a
# failing step does not stop the others. Logs and JSON land in OUT (default artifacts/gpu-suite); the last lines
# printed are a pass/fail table. Carried wheels in .whl/ (for machines without a package index) are installed
# into a private site dir first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PY=python3
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"

step() {  # step NAME TIMEOUT_S COMMAND...: run one step, log it, record its status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >>"$OUT/status.txt"
  return 0
}

correctness_and_kernels() {
  step gpu_tests 180 $PY -m pytest -q -m gpu tests
  step bench_mrope 150 $PY -m scripts.bench_mrope --out "$OUT/bench_mrope.json"
  for family in qwen2_vl qwen2_5_vl qwen3_vl qwen3_vl_moe qwen3_5 qwen3_5_moe; do
    step "verify_packing_$family" 60 $PY -m scripts.verify_packing --config "recipes/tiny-$family.yaml" \
      model.dtype=bfloat16
    step "verify_packing_video_$family" 60 $PY -m scripts.verify_packing --config "recipes/tiny-$family.yaml" \
      model.dtype=bfloat16 data.video_share=0.7 data.num_samples=200
  done
  step bench_packing 150 $PY -m scripts.bench_packing --out "$OUT/bench_packing.json"
}

training_runs() {
  step smoke_test 240 $PY -m scripts.smoke_test
  step train_3b_shape 280 $PY train.py --config recipes/bench-qwen2_5_vl-3b-shape.yaml data.num_workers=8
  step profile_3b_shape 150 $PY -m scripts.profile_step --config recipes/bench-qwen2_5_vl-3b-shape.yaml \
    --out "$OUT/profile_3b_shape" data.num_samples=600 data.num_workers=8
  step train_3b_video 300 $PY train.py --config recipes/bench-qwen2_5_vl-3b-video.yaml data.num_workers=8
  cp runs/smoke/summary.json "$OUT/smoke_summary.json" 2>/dev/null
  cp runs/bench-qwen2_5_vl-3b-shape/summary.json "$OUT/train_3b_shape_summary.json" 2>/dev/null
  cp runs/bench-qwen2_5_vl-3b-video/summary.json "$OUT/train_3b_video_summary.json" 2>/dev/null
}

: >"$OUT/status.txt"
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 correctness_and_kernels &
  CUDA_VISIBLE_DEVICES=1 training_runs &
  wait
else
  correctness_and_kernels
  training_runs
fi
for log in "$OUT"/*.log; do echo "=== $(basename "$log") (tail)"; tail -n 6 "$log"; done
echo "=== status"
cat "$OUT/status.txt"
