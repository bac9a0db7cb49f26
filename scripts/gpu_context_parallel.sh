#!/usr/bin/env bash
# Context parallelism on two GPUs of one host (`make gpu-cp`, or `bash scripts/gpu_context_parallel.sh OUT [STAGE ...]`):
#
#   tests    the chunked varlen kernel against the whole one on one GPU, and every family's CP = 2 against one GPU
#            over NCCL (fp32 within 1e-5, bf16 by the rounding rule)
#   exact    one GPU twice (its run-to-run spread) and two GPUs at parallel.context=2, 10 steps each on the same
#            packs; compare per-step loss / grad_norm in <run>/metrics.jsonl
#   speed    16k-token packs on one GPU against 32k-token packs split over two (equal tokens per GPU): tokens/s per
#            GPU, MFU and peak memory in <run>/summary.json
#   engines  our all-gather-KV attention against torch's ring context_parallel on one causal document
#            (scripts/bench_cp_attention.py)
#
#   RECIPE=recipes/bench-qwen2_5_vl-3b-shape.yaml bash scripts/gpu_context_parallel.sh OUT   (default: every stage)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-cp}
shift || true
STAGES=${*:-tests exact speed engines}
RECIPE=${RECIPE:-recipes/bench-qwen2_5_vl-3b-shape.yaml}
source scripts/gpu_common.sh
# The eager fp32-module path on both sides: one GPU would otherwise resolve train.master_weights=auto to bf16 weights
# and DDP to fp32 ones (trainer/defaults.py), and the comparison would measure that as well as context parallelism.
COMMON="logging.report_to=none logging.every_steps=1 logging.timing_warmup_steps=3 checkpoint.export=false"
COMMON="$COMMON train.compile=false train.master_weights=module kernels.patch_embed=conv"
ONE="env CUDA_VISIBLE_DEVICES=0 $PY train.py --config $RECIPE"
TWO="accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 train.py --config $RECIPE"

run() {  # run NAME COMMAND...: one training run into $OUT/NAME
  local name=$1; shift
  step "$name" 600 "$@" $COMMON "train.output_dir=$OUT/$name"
}

for stage in $STAGES; do
  case $stage in
    tests) step tests 300 $PY -m pytest -q -m gpu tests/test_context_parallel.py tests/test_context_parallel_distributed.py ;;
    exact)
      run exact-cp1a $ONE train.max_steps=10
      run exact-cp1b $ONE train.max_steps=10
      run exact-cp2 $TWO train.max_steps=10 parallel.context=2 ;;
    speed)
      run speed-cp1 $ONE train.max_steps=14
      run speed-cp2 $TWO train.max_steps=14 parallel.context=2 packing.max_tokens=32768 ;;
    engines) step engines 600 torchrun --standalone --nproc_per_node 2 -m scripts.bench_cp_attention \
        --out "$OUT/cp_attention.json" ;;
    *) echo "unknown stage $stage (tests exact speed engines)"; exit 2 ;;
  esac
done
report
