#!/usr/bin/env bash
# Issues 14-16 on one GPU: the rope kernels' GPU tests, the kernel benchmark and the end-to-end comparisons of the
# 3B, 8B and Qwen3.5 bench shapes with alternating repeats, everything under one artifacts dir.
#
#   bash scripts/gpu_rope_suite.sh OUT [STAGE ...]      STAGE: tests bench compare-3b compare-8b compare-qwen3_5
#                                                       (default: these five, in that order), or
#                                                       levers-3b levers-8b levers-qwen3_5 (fused against
#                                                       bf16-compiled: issues 14/15's fastest measured setup),
#                                                       warm-qwen3_5 (one untimed run: fla's first compile),
#                                                       longest-3b longest-8b longest-qwen3_5 (that setup's peak
#                                                       memory at two pack lengths, fitted: the longest pack
#                                                       within 137 GiB, scripts/fit_longest.py), curve-3b (30 steps
#                                                       of bf16-compiled against the 1-GPU path and its own repeat,
#                                                       scripts/distributed_parity.py: issue 15's numerics),
#                                                       curve-3b-compiled (the same, every layout compiled),
#                                                       compile-accuracy (one 3B-wide decoder layer compiled against
#                                                       eager and float64, scripts/compile_accuracy.py),
#                                                       levers-3b-eager-reductions and curve-3b-eager-reductions
#                                                       (bf16-compiled with train.compile_eager_reductions=all: its
#                                                       speed against bf16-compiled, its 30-step curve),
#                                                       levers-3b-eager-mean and curve-3b-eager-mean (the same, =mean),
#                                                       levers-3b-eager-rows and curve-3b-eager-rows (=rows),
#                                                       levers-3b-matmuls (bf16-compiled without its padded
#                                                       matmuls and Conv3d-free patch embedding, without the
#                                                       padding alone, with both, and with both and =all),
#                                                       ab-worker-plans-3b (scripts/ab_worker_plans.py: train.py's
#                                                       step with and without the loader workers' vision plans),
#                                                       curve-3b-levers (the 30-step curve of bf16-compiled
#                                                       with both matmul levers and train.compile_eager_reductions=
#                                                       EAGER_REDUCTIONS (default rows), launched twice, against the
#                                                       default path and its repeat: scripts/curve_spread.py pools
#                                                       the draws), levers-8b-eager-rows (the 8B shape's speed with
#                                                       =rows), levers-full-depth-eager-rows (the full-depth 3B shape,
#                                                       LLM and ViT checkpointing, bf16-compiled with =rows),
#                                                       levers-8b-eager-mean (the 8B shape's speed with =mean: its
#                                                       ViT blocks' layer norms go to aten as well),
#                                                       profile-3b-eager-reductions (scripts/profile_step.py on
#                                                       bf16-compiled with =none and with =all: where all's 4.9% goes;
#                                                       EAGER_REDUCTIONS="none" profiles one), levers-3b-compiled
#                                                       (bf16-compiled alone: this machine's step time beside a profile)
#   REPEATS=3 STEPS=12 WARMUP=5 SAMPLES=800 COMPARE_LIMIT=540 RUN_LIMIT=300 REPORT_TO=wandb \
#     bash scripts/gpu_rope_suite.sh ...
#   (the defaults; REPORT_TO=none skips the offline wandb runs, a few seconds per run)
#
# Each comparison runs every variant REPEATS times, alternating (A B A B ...), STEPS optimizer steps per run with the
# first WARMUP untimed, on SAMPLES built-in samples (800: twelve full 16k-token packs, then a short one that ends the
# epoch, which no run reaches). Runs log every 5 steps (the bench recipes), so WARMUP=5 starts the timing at a log.
# A run still going after RUN_LIMIT seconds is killed after printing its threads' stacks into its train.log. Each stage has its own time limit and a failing stage does not stop the others; `status.txt` lists them.
# A comparison cut short by its limit keeps comparison.json of the rounds (one run of every variant) it finished.
# Carried wheels in .whl/ (transformers 5.23, Liger-Kernel, ...) are installed into a private site dir first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-rope}
shift || true
STAGES=${*:-tests bench compare-3b compare-8b compare-qwen3_5}
REPEATS=${REPEATS:-3} STEPS=${STEPS:-12} WARMUP=${WARMUP:-5} SAMPLES=${SAMPLES:-800} COMPARE_LIMIT=${COMPARE_LIMIT:-540}
RUN_LIMIT=${RUN_LIMIT:-300}
REPORT_TO=${REPORT_TO:-wandb}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PY=python3
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/environment.txt"

step() {  # step NAME TIMEOUT_S COMMAND...: run one stage, log it, record its status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "[gpu-rope] $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" | tee -a "$OUT/status.txt"
}

compare() {  # compare NAME RECIPE VARIANTS [OVERRIDE ...]
  local name=$1 recipe=$2 variants=$3
  shift 3
  step "compare_$name" "$COMPARE_LIMIT" $PY -m scripts.compare_throughput --config "recipes/$recipe.yaml" \
    --variants "$variants" --repeats "$REPEATS" --steps "$STEPS" --warmup "$WARMUP" --run-timeout "$RUN_LIMIT" \
    --out "$OUT/compare_$name" \
    data.num_samples="$SAMPLES" data.num_workers=8 logging.report_to="$REPORT_TO" "$@"
}

longest() {  # longest NAME RECIPE "TOKENS ..." [OVERRIDE ...]: 2-step probes per pack length, then the linear fit
  local name=$1 recipe=$2 lengths=$3 tokens
  shift 3
  for tokens in $lengths; do
    step "longest_${name}_$tokens" 300 $PY train.py --config "recipes/$recipe.yaml" packing.max_tokens=$tokens \
      train.max_steps=2 logging.timing_warmup_steps=0 logging.every_steps=1 logging.report_to=none \
      train.master_weights=optimizer train.compile=true train.output_dir="$OUT/longest_$name/$tokens" "$@"
  done
  # only the probes that finished (one out of memory says the longest pack is below it)
  step "longest_${name}_fit" 60 bash -c "$PY -m scripts.fit_longest --memory-gib 137 \
    --json $OUT/longest_$name/fit.json \$(dirname \$(ls $OUT/longest_$name/*/summary.json))"
}

curve_eager_reductions() {  # curve_eager_reductions WHICH: curve-3b with train.compile_eager_reductions=WHICH
  local name=curve_3b_eager_$1
  [ "$1" = all ] && name=curve_3b_eager_reductions
  step "$name" 900 $PY -m scripts.distributed_parity --out "$OUT/$name.json" --gpus 2 \
    --recipes recipes/bench-qwen2_5_vl-3b-shape.yaml --layouts single,bf16-compiled --repeat-single --steps 30 \
    --no-resume --launch-timeout 400 data.num_samples=4000 data.num_workers=8 train.compile_eager_reductions="$1"
}

for stage in $STAGES; do
  case $stage in
    # every kernel test with CUDA tensors (real kernels, libdevice), then the patch's GPU tests
    tests) step gpu_tests 300 bash -c "$PY -m pytest -q tests/test_kernels.py tests/test_direct_launch.py && $PY -m pytest -q -m gpu tests/test_patch.py tests/test_fused_loss.py" ;;
    bench) step bench_mrope 420 $PY -m scripts.bench_mrope --sweep --out "$OUT/bench_mrope.json" ;;
    compare-3b) compare 3b bench-qwen2_5_vl-3b-shape fused,unfused,liger ;;
    compare-8b) compare 8b bench-qwen3_vl-8b-shape fused,unfused ;;
    compare-qwen3_5) compare qwen3_5 bench-qwen3_5-shape fused,unfused ;;
    levers-3b) compare levers_3b bench-qwen2_5_vl-3b-shape fused,bf16-compiled ;;
    levers-8b) compare levers_8b bench-qwen3_vl-8b-shape fused,bf16-compiled ;;
    # without LLM checkpointing, where bf16-compiled was fastest (105 GiB); fused without it is not yet measured
    levers-qwen3_5) compare levers_qwen3_5 bench-qwen3_5-shape fused,bf16-compiled model.gradient_checkpointing_llm=false ;;
    # one untimed bf16-compiled run first, so the timed repeats after it find fla's kernels compiled: on an empty
    # Triton cache its first step compiles and autotunes them for minutes (metrics.jsonl: first_step_s, compile_s)
    warm-qwen3_5) step warm_qwen3_5 600 $PY train.py --config recipes/bench-qwen3_5-shape.yaml train.max_steps=12 \
      data.num_samples="$SAMPLES" data.num_workers=8 logging.report_to=none model.gradient_checkpointing_llm=false \
      train.master_weights=optimizer train.compile=true train.output_dir="$OUT/warm_qwen3_5" ;;
    # two lengths below each shape's out-of-memory point as the 16k runs' peaks (77, 87, 105 GiB) extrapolate
    longest-3b) longest 3b bench-qwen2_5_vl-3b-shape "16384 24576" ;;
    longest-8b) longest 8b bench-qwen3_vl-8b-shape "16384 24576" ;;
    longest-qwen3_5) longest qwen3_5 bench-qwen3_5-shape "16384 20480" model.gradient_checkpointing_llm=false ;;
    curve-3b) step curve_3b 900 $PY -m scripts.distributed_parity --out "$OUT/curve_3b.json" --gpus 2 \
      --recipes recipes/bench-qwen2_5_vl-3b-shape.yaml --layouts single,bf16-compiled --repeat-single --steps 30 \
      --no-resume --launch-timeout 400 data.num_samples=4000 data.num_workers=8 ;;
    # the same with every layout compiled: the 1-GPU run then differs from bf16-compiled by the bf16 weights alone
    curve-3b-compiled) step curve_3b_compiled 900 $PY -m scripts.distributed_parity --out "$OUT/curve_3b_compiled.json" \
      --gpus 2 --recipes recipes/bench-qwen2_5_vl-3b-shape.yaml --layouts single,bf16-compiled --repeat-single \
      --steps 30 --no-resume --launch-timeout 400 data.num_samples=4000 data.num_workers=8 train.compile=true ;;
    levers-3b-eager-reductions) compare levers_3b_eager_reductions bench-qwen2_5_vl-3b-shape \
      bf16-compiled,bf16-compiled-eager-reductions ;;
    levers-3b-compiled) compare levers_3b_compiled bench-qwen2_5_vl-3b-shape bf16-compiled ;;
    levers-3b-eager-mean) compare levers_3b_eager_mean bench-qwen2_5_vl-3b-shape bf16-compiled,bf16-compiled-eager-mean ;;
    ab-worker-plans-3b) step ab_worker_plans_3b 300 $PY -m scripts.ab_worker_plans \
      --config recipes/bench-qwen2_5_vl-3b-shape.yaml --out "$OUT/ab_worker_plans_3b" --rounds 2 \
      data.num_samples=1800 data.num_workers=8 logging.report_to=none logging.progress_bar=false \
      train.master_weights=optimizer train.compile=true ;;
    levers-3b-eager-rows) compare levers_3b_eager_rows bench-qwen2_5_vl-3b-shape bf16-compiled,bf16-compiled-eager-rows ;;
    levers-3b-matmuls) compare levers_3b_matmuls bench-qwen2_5_vl-3b-shape \
      bf16-compiled-unpadded-conv-embed,bf16-compiled-unpadded,bf16-compiled,bf16-compiled-eager-reductions ;;
    curve-3b-levers) step curve_3b_levers_${EAGER_REDUCTIONS:-rows} 900 $PY -m scripts.distributed_parity \
      --out "$OUT/curve_3b_levers_${EAGER_REDUCTIONS:-rows}.json" --gpus 2 --recipes recipes/bench-qwen2_5_vl-3b-shape.yaml \
      --layouts single,bf16-compiled --repeat-single --repeat-fast --steps 30 --no-resume --launch-timeout 400 \
      --fast-override kernels.patch_embed=matmul --fast-override train.compile_eager_reductions="${EAGER_REDUCTIONS:-rows}" \
      data.num_samples=4000 data.num_workers=8 ;;
    levers-8b-eager-rows) compare levers_8b_eager_rows bench-qwen3_vl-8b-shape bf16-compiled,bf16-compiled-eager-rows ;;
    levers-full-depth-eager-rows) compare levers_full_depth_eager_rows bench-qwen2_5_vl-3b-shape bf16-compiled-eager-rows \
      model.config.text_config.num_hidden_layers=36 model.config.vision_config.depth=32 \
      'model.config.vision_config.fullatt_block_indexes=[7,15,23,31]' model.gradient_checkpointing_llm=true \
      model.gradient_checkpointing_vision=true ;;
    levers-8b-eager-mean) compare levers_8b_eager_mean bench-qwen3_vl-8b-shape bf16-compiled,bf16-compiled-eager-mean ;;
    curve-3b-eager-reductions) curve_eager_reductions all ;;
    curve-3b-eager-mean) curve_eager_reductions mean ;;
    curve-3b-eager-rows) curve_eager_reductions rows ;;
    profile-3b-eager-reductions) for which in ${EAGER_REDUCTIONS:-none all}; do
        step "profile_3b_eager_$which" 300 $PY -m scripts.profile_step --config recipes/bench-qwen2_5_vl-3b-shape.yaml \
          --steps 3 --warmup 5 --top 40 --out "$OUT/profile_3b_eager_$which" logging.report_to=none \
          checkpoint.export=false train.master_weights=optimizer train.compile=true \
          train.compile_eager_reductions=$which
      done ;;
    compile-accuracy) step compile_accuracy 300 $PY -m scripts.compile_accuracy --device cuda --hidden 2048 \
      --tokens 4096 ;;
    *) echo "unknown stage $stage (tests bench compare-3b compare-8b compare-qwen3_5 levers-3b levers-8b"\
      "levers-qwen3_5 warm-qwen3_5 longest-3b longest-8b longest-qwen3_5 curve-3b curve-3b-compiled"\
      "compile-accuracy levers-3b-eager-reductions curve-3b-eager-reductions levers-3b-eager-mean"\
      "curve-3b-eager-mean levers-8b-eager-mean profile-3b-eager-reductions levers-3b-compiled"\
      "levers-3b-eager-rows curve-3b-eager-rows ab-worker-plans-3b levers-3b-matmuls curve-3b-levers"\
      "levers-8b-eager-rows levers-full-depth-eager-rows)"; exit 2 ;;
  esac
done
for log in "$OUT"/*.log; do echo "=== $(basename "$log") (tail)"; tail -n 12 "$log"; done
echo "=== status"
cat "$OUT/status.txt"
