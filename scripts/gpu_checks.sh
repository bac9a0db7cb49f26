#!/usr/bin/env bash
# Every correctness check that needs a GPU, on one GPU (`make gpu-checks`, or `bash scripts/gpu_checks.sh OUT`):
# the GPU-marked tests, the kernel tests on CUDA tensors (real kernels, libdevice), packed == per-sample in bf16 for
# every family on images, on video-heavy data and with LoRA adapters, and the smoke run. Logs in OUT (default artifacts/gpu-checks).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-checks}
source scripts/gpu_common.sh

step gpu_tests 600 bash -c "$PY -m pytest -q -m gpu tests && $PY -m pytest -q tests/test_kernels.py tests/test_direct_launch.py"
for family in qwen2_vl qwen2_5_vl qwen3_vl qwen3_vl_moe qwen3_5 qwen3_5_moe; do
  step "verify_packing_$family" 120 $PY -m scripts.verify_packing --config "recipes/tiny-$family.yaml" \
    model.dtype=bfloat16
  step "verify_packing_video_$family" 120 $PY -m scripts.verify_packing --config "recipes/tiny-$family.yaml" \
    model.dtype=bfloat16 data.video_share=0.7 data.num_samples=200
  step "verify_packing_lora_$family" 120 $PY -m scripts.verify_packing --config "recipes/tiny-$family.yaml" \
    model.dtype=bfloat16 data.video_share=0.5 data.num_samples=200 lora.rank=8 lora.vision=true lora.merger=true
done
step smoke_test 300 $PY -m scripts.smoke_test
report
