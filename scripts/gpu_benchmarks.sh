#!/usr/bin/env bash
# The benchmarks on one GPU (`make gpu-bench`, or `bash scripts/gpu_benchmarks.sh OUT [STAGE ...]`), each writing its
# JSON into OUT (default artifacts/gpu-bench):
#
#   kernels           rope kernels against HF eager, torch.compile, Liger and the copy floor, with the launch-shape
#                     sweep (scripts/bench_mrope.py)
#   packing           packed varlen vs padded batches vs sdpa with a packed mask (scripts/bench_packing.py)
#   rope-3b rope-8b rope-qwen3_5
#                     end to end, fused rope against transformers' (and Liger's, on the 3B shape) on the bench
#                     shapes, alternating repeats (scripts/compare_throughput.py)
#   fast-3b fast-8b fast-qwen3_5
#                     the same shapes, eager fp32 masters against bf16 weights + compile
#   curve-3b          30 steps of bf16 weights + compile against the eager path and its repeat, launched twice:
#                     its run-to-run spread test (scripts/distributed_parity.py, then scripts/curve_spread.py)
#   warm-qwen3_5      one untimed Qwen3.5 run, so later runs find fla's kernels compiled and autotuned
#   profile-3b        where the 3B shape's step time goes (scripts/profile_step.py)
#   lm-head-3b lm-head-qwen3_5
#                     the step with the loss over the labelled rows against over every row (scripts/bench_lm_head.py;
#                     run warm-qwen3_5 first on a fresh machine)
#   lora-7b lora-8b lora-9b
#                     the model's LoRA recipe on one GPU beside its full fine-tune on 2 GPUs (fsdp2), full depth,
#                     random init: tokens/s, MFU, peak memory (scripts/bench_lora.py; the full fine-tune
#                     needs 2 GPUs: LORA_MODES=lora on one)
#
# Default stages: kernels packing rope-3b rope-8b warm-qwen3_5 rope-qwen3_5.
#   REPEATS=3 STEPS=12 WARMUP=5 SAMPLES=800 COMPARE_LIMIT=540 RUN_LIMIT=300 bash scripts/gpu_benchmarks.sh OUT ...
# Each comparison runs every variant REPEATS times, alternating, STEPS optimizer steps per run with the first WARMUP
# untimed, on SAMPLES built-in samples. A comparison cut short by its limit keeps the rounds it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-bench}
shift || true
STAGES=${*:-kernels packing rope-3b rope-8b warm-qwen3_5 rope-qwen3_5}
REPEATS=${REPEATS:-3} STEPS=${STEPS:-12} WARMUP=${WARMUP:-5} SAMPLES=${SAMPLES:-800} COMPARE_LIMIT=${COMPARE_LIMIT:-540}
RUN_LIMIT=${RUN_LIMIT:-300}
source scripts/gpu_common.sh

compare() {  # compare NAME RECIPE VARIANTS [OVERRIDE ...]
  local name=$1 recipe=$2 variants=$3
  shift 3
  step "compare_$name" "$COMPARE_LIMIT" $PY -m scripts.compare_throughput --config "recipes/$recipe.yaml" \
    --variants "$variants" --repeats "$REPEATS" --steps "$STEPS" --warmup "$WARMUP" --run-timeout "$RUN_LIMIT" \
    --out "$OUT/compare_$name" data.num_samples="$SAMPLES" data.num_workers=8 "$@"
}

for stage in $STAGES; do
  case $stage in
    kernels) step bench_mrope 420 $PY -m scripts.bench_mrope --sweep --out "$OUT/bench_mrope.json" ;;
    packing) step bench_packing 300 $PY -m scripts.bench_packing --out "$OUT/bench_packing.json" ;;
    rope-3b) compare rope_3b bench-qwen2_5_vl-3b-shape fused,unfused,liger ;;
    rope-8b) compare rope_8b bench-qwen3_vl-8b-shape fused,unfused ;;
    rope-qwen3_5) compare rope_qwen3_5 bench-qwen3_5-shape fused,unfused ;;
    fast-3b) compare fast_3b bench-qwen2_5_vl-3b-shape fused,bf16-compiled ;;
    fast-8b) compare fast_8b bench-qwen3_vl-8b-shape fused,bf16-compiled ;;
    fast-qwen3_5) compare fast_qwen3_5 bench-qwen3_5-shape fused,bf16-compiled model.gradient_checkpointing_llm=false ;;
    curve-3b) step curve_3b 900 $PY -m scripts.distributed_parity --out "$OUT/curve_3b.json" --gpus 2 \
        --recipes recipes/bench-qwen2_5_vl-3b-shape.yaml --layouts single,bf16-compiled --repeat-single --repeat-fast \
        --steps 30 --no-resume --launch-timeout 400 data.num_samples=4000 data.num_workers=8
      step curve_3b_spread 60 $PY -m scripts.curve_spread "$OUT/curve_3b.json" --json "$OUT/curve_3b_spread.json" ;;
    warm-qwen3_5) step warm_qwen3_5 600 $PY train.py --config recipes/bench-qwen3_5-shape.yaml train.max_steps=12 \
        data.num_samples="$SAMPLES" data.num_workers=8 logging.report_to=none train.output_dir="$OUT/warm_qwen3_5" ;;
    lora-7b | lora-8b | lora-9b) step "lora_${stage#lora-}" 1500 $PY -m scripts.bench_lora --out "$OUT/bench_lora.json" \
        --models "${stage#lora-}" --modes "${LORA_MODES:-lora,full}" data.num_samples="$SAMPLES" \
        data.num_workers=8 ;;
    lm-head-3b) step lm_head_3b 300 $PY -m scripts.bench_lm_head --config recipes/bench-qwen2_5_vl-3b-shape.yaml \
        --out "$OUT/lm_head_3b.json" data.num_samples=600 data.num_workers=8 ;;
    lm-head-qwen3_5) step lm_head_qwen3_5 600 $PY -m scripts.bench_lm_head --config recipes/bench-qwen3_5-shape.yaml \
        --out "$OUT/lm_head_qwen3_5.json" data.num_samples=600 data.num_workers=8 ;;
    profile-3b) step profile_3b 300 $PY -m scripts.profile_step --config recipes/bench-qwen2_5_vl-3b-shape.yaml \
        --out "$OUT/profile_3b" data.num_samples=600 data.num_workers=8 logging.report_to=none ;;
    *) echo "unknown stage $stage (kernels packing rope-3b rope-8b rope-qwen3_5 fast-3b fast-8b fast-qwen3_5"\
      "curve-3b warm-qwen3_5 profile-3b lm-head-3b lm-head-qwen3_5 lora-7b lora-8b lora-9b)"; exit 2 ;;
  esac
done
report
