# Sourced by the scripts/gpu_*.sh runners: environment, our GPU hosts' own setup (scripts/gpu_env.sh), and `step`,
# which runs one stage with its own time limit, logs it to $OUT/NAME.log and records its exit status in
# $OUT/status.txt (a failing stage does not stop the others). Expects OUT to be set.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# NVLink multicast off for every collective library (core/distributed.py says why)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/gpu_env.sh
PY=python3
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))" \
  | tee "$OUT/environment.txt"
: >>"$OUT/status.txt"

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "[$(basename "$0")] $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" | tee -a "$OUT/status.txt"
}

report() {  # the tail of every log, then the status table
  for log in "$OUT"/*.log; do echo "=== $(basename "$log") (tail)"; tail -n 12 "$log"; done
  echo "=== status"
  cat "$OUT/status.txt"
}
