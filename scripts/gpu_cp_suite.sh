#!/usr/bin/env bash
# Issue 20 on two GPUs of one host: context parallelism's GPU tests, CP = 2 vs CP = 1 exactness in bf16, tokens/s
# per GPU at equal tokens per GPU, and the longest single sample at CP = 1 and CP = 2 (DDP and FSDP2).
#
#   bash scripts/gpu_cp_suite.sh OUT [STAGE ...]      STAGE: tests exact speed longest (default: all, in that order)
#   RECIPE=recipes/bench-qwen2_5_vl-3b-shape.yaml WORDS="40000 70000 100000" MEMORY_GIB=137 bash scripts/gpu_cp_suite.sh
#
# tests    the kernel check on one GPU and the per-family worker on two (fp32 within 1e-5, bf16 rounding rule).
# exact    one GPU twice (its run-to-run spread) and two GPUs at parallel.context=2, 10 steps each, the same packs
#          (the data-parallel size is 1 in both); compare per-step loss / grad_norm in <run>/metrics.jsonl.
# speed    16k-token packs on one GPU against 32k-token packs split over two (equal tokens per GPU): tokens/s per
#          GPU, MFU and peak memory in <run>/summary.json.
# longest  probe runs of scripts/make_long_samples.py samples of WORDS words (one per pack: packing.max_tokens =
#          2 x words + 512; ~1.44 tokens per word), 2 steps each with LLM and ViT checkpointing, at CP = 1, CP = 2
#          under DDP and CP = 2 under FSDP2; scripts/fit_longest.py fits each layout's peak memory against the
#          sample's tokens and predicts the longest sample within MEMORY_GIB (fit-<layout>.json). A sweep to
#          out-of-memory would pay quadratic attention time per try. status.txt lists every run's exit status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-cp}
shift || true
STAGES=${*:-tests exact speed longest}
RECIPE=${RECIPE:-recipes/bench-qwen2_5_vl-3b-shape.yaml}
WORDS=${WORDS:-40000 70000 100000}
MEMORY_GIB=${MEMORY_GIB:-137}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # training/distributed.py
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
COMMON="logging.report_to=none logging.every_steps=1 logging.timing_warmup_steps=3 checkpoint.export=false"
ONE="python3 train.py --config $RECIPE"
TWO="accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 train.py --config $RECIPE"

run() {  # run NAME TIMEOUT_S COMMAND...: one training run into $OUT/NAME, its status in status.txt
  local name=$1 limit=$2; shift 2
  echo "[gpu-cp] $name"
  timeout "$limit" "$@" $COMMON "train.output_dir=$OUT/$name" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/status.txt"
  return $rc
}

for stage in $STAGES; do
  case $stage in
    tests)
      timeout 300 python3 -m pytest -q -m gpu tests/test_context_parallel.py tests/test_context_parallel_distributed.py \
        >"$OUT/tests.log" 2>&1
      echo "tests rc=$?" | tee -a "$OUT/status.txt" ;;
    exact)
      run exact-cp1a 600 env CUDA_VISIBLE_DEVICES=0 $ONE train.max_steps=10
      run exact-cp1b 600 env CUDA_VISIBLE_DEVICES=0 $ONE train.max_steps=10
      run exact-cp2 600 $TWO train.max_steps=10 parallel.context=2 ;;
    speed)
      run speed-cp1 600 env CUDA_VISIBLE_DEVICES=0 $ONE train.max_steps=14
      run speed-cp2 600 $TWO train.max_steps=14 parallel.context=2 packing.max_tokens=32768 ;;
    longest)
      CKPT="model.gradient_checkpointing_llm=true model.gradient_checkpointing_vision=true"
      FSDP2="accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 2 train.py --config $RECIPE"
      for words in $WORDS; do
        data="$OUT/long-$words"
        [ -f "$data/data.jsonl" ] || python3 -m scripts.make_long_samples --out "$data" --words "$words" --count 4
        long="data.path=$data/data.jsonl data.eval_fraction=0 packing.max_tokens=$((2 * words + 512))"
        long="$long train.max_steps=2 logging.timing_warmup_steps=0 $CKPT"
        run "longest-cp1-$words" 600 env CUDA_VISIBLE_DEVICES=0 $ONE $long
        run "longest-cp2-$words" 600 $TWO parallel.context=2 $long
        run "longest-cp2fsdp2-$words" 600 $FSDP2 parallel.context=2 $long
      done
      for layout in cp1 cp2 cp2fsdp2; do
        python3 -m scripts.fit_longest --memory-gib "$MEMORY_GIB" --json "$OUT/fit-$layout.json" \
          "$OUT"/longest-"$layout"-* | tee -a "$OUT/status.txt"
      done ;;
    *) echo "unknown stage $stage (tests exact speed longest)"; exit 2 ;;
  esac
done
