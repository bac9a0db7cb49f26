"""`python -m scripts.profile_step`: a tiny recipe profiled end to end on CPU (trace, table, JSON whose categories
add up), and verification/device_time.py's kernel-name categorisation and busy-time arithmetic on hand-made names
and intervals."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from verification import device_time

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-qwen2_5_vl.yaml"


TINY_OVERRIDES = ["data.num_samples=32", "packing.max_tokens=256", "model.dtype=float32"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m scripts.profile_step ARGS` from the repository root, its output captured as text."""
    command = [sys.executable, "-m", "scripts.profile_step", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.mark.slow
def test_profiles_a_tiny_recipe_on_cpu(tmp_path):
    """One warm-up + one profiled step write trace.json, profile.md and profile.json; the categories partition the
    device time (sum to it, percentages sum to 100), the top kernels are sorted and within the total, and the
    busy time is positive and no longer than the wall time."""
    out = tmp_path / "profile"
    argv = ["--config", TINY, "--steps", "1", "--warmup", "1", "--top", "5", "--out", str(out), *TINY_OVERRIDES]
    argv.append(f"data.cache_dir={tmp_path / 'cache'}")
    done = run_cli(*argv)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "profile.json").read_text())

    trace = json.loads((out / "trace.json").read_text())
    assert trace["traceEvents"], "the chrome trace holds no events"
    table = (out / "profile.md").read_text()
    assert "## Device time by category" in table and "| matmul |" in table

    categories = report["categories"]
    assert [c["category"] for c in categories] == [name for name, _ in device_time.CATEGORIES] + ["other"]
    assert sum(c["ms_per_step"] for c in categories) == pytest.approx(report["device_ms_per_step"])
    assert sum(c["pct"] for c in categories) == pytest.approx(100.0)
    assert all(0.0 <= c["pct"] <= 100.0 for c in categories)
    by_name = {c["category"]: c for c in categories}
    assert by_name["matmul"]["ms_per_step"] > 0 and by_name["rope"]["ms_per_step"] > 0  # the recipe is fused

    kernels = report["kernels"]
    assert len(kernels) == 5
    assert [k["total_ms"] for k in kernels] == sorted((k["total_ms"] for k in kernels), reverse=True)
    assert sum(k["pct"] for k in kernels) <= 100.0 + 1e-9
    assert 0 < report["busy_ms_per_step"] <= report["wall_ms_per_step"]
    assert 0 < report["busy_fraction"] <= 1.0
    assert report["launches_per_step"] >= sum(k["calls"] for k in kernels)


def test_rejects_a_step_count_below_one():
    """--steps 0 would profile nothing and divide by zero: refused at the command line."""
    done = run_cli("--config", TINY, "--steps", "0")
    assert done.returncode == 2 and "--steps must be at least 1" in done.stderr


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("_rope_kernel", "rope"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "matmul"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        (
            "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<CollectiveMainloop>>>",
            "attention",
        ),
        (
            "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__Tensorgmem",
            "attention",
        ),
        ("_vision_table_kernel", "rope"),
        ("_rope_kernel", "rope"),
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gated_delta"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norm"),
        ("void at::native::(anonymous namespace)::fused_adamMathFunctor", "optimizer"),
        ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float, 2>>", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "loss"),
        ("Memcpy HtoD (Pinned -> Device)", "copies_casts"),
        ("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>", "copies_casts"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
        ("void at::native::index_elementwise_kernel", "elementwise"),
        ("aten::mul", "elementwise"),
        ("aten::embedding_dense_backward", "other"),
    ],
)
def test_kernel_names_fall_in_their_category(name, category):
    """Representative CUDA kernel and CPU op names land in the category the breakdown documents (first match wins:
    fmha before cutlass, the foreach grad norm under optimizer, not norm)."""
    assert device_time.categorize(name) == category


def test_busy_time_is_the_union_of_intervals():
    """Overlapping intervals (another stream, nested ops) count once; gaps between them do not count."""
    event = device_time.DeviceEvent
    events = [event("a", 0, 10, 10), event("b", 5, 12, 7), event("c", 20, 25, 5), event("d", 21, 22, 1)]
    assert device_time.busy_us(events) == 17
    assert device_time.busy_us([]) == 0


def test_idle_gaps_are_charged_to_the_host_phase_at_their_midpoint():
    """Gaps in the device timeline inside the profiled window go to the innermost step phase the host was in at
    the gap's midpoint (nested annotations: the inner one), or to "between phases"; busy time is never charged."""
    event = device_time.DeviceEvent
    events = [event("a", 10, 20, 10), event("b", 15, 30, 15), event("c", 50, 60, 10), event("d", 90, 100, 10)]
    phases = [("phase/data_wait", 0, 12), ("phase/model_forward", 25, 70), ("phase/vision_dummies", 35, 45)]
    rows = device_time.idle_by_phase(events, phases, window=(0, 110), steps=2)
    idle = {row["phase"]: row["idle_ms_per_step"] * 1e3 * 2 for row in rows}
    # gaps: 0-10 (mid 5: data_wait), 30-50 (mid 40: vision_dummies inside model_forward), 60-90 (mid 75: none),
    # 100-110 (mid 105: none)
    assert idle == {"data_wait": 10, "vision_dummies": 20, "between phases": 40}
    assert rows[0]["phase"] == "between phases" and rows[0]["gaps_per_step"] == 1.0
    assert device_time.idle_by_phase([event("a", 0, 10, 10)], [], window=(0, 10), steps=1) == []


def test_idle_gaps_are_charged_to_the_innermost_host_op_at_their_midpoint():
    """What the host ran while the GPU waited: the op or annotation that started last among those holding the gap's
    midpoint (a runtime call inside an aten op inside a phase: the runtime call), across threads' overlapping ops;
    a gap outside every op is "(no host op)"."""
    event = device_time.DeviceEvent
    events = [event("k1", 0, 10, 10), event("k2", 30, 40, 10), event("k3", 60, 70, 10), event("k4", 95, 100, 10)]
    host = [
        ("phase/vision_plan", 5, 45),
        ("aten::pin_memory", 12, 28),
        ("cudaHostAlloc", 15, 25),  # gap 10-30, mid 20
        ("phase/model_forward", 45, 90),
        ("aten::copy_", 46, 49),  # begun later than the phase but ended before the gap's midpoint (50)
        ("autograd thread op", 50, 58),  # another thread's op, begun after the phase: the innermost at 55
    ]
    rows = device_time.idle_by_host_op(events, host, window=(0, 100), steps=1)
    idle = {row["op"]: row["idle_ms_per_step"] * 1e3 for row in rows}
    # gaps: 10-30 (mid 20), 40-60 (mid 50: "autograd thread op" began at 50), 70-95 (mid 82.5: model_forward)
    assert idle == {"cudaHostAlloc": 20, "autograd thread op": 20, "phase/model_forward": 25}
    rows = device_time.idle_by_host_op([event("k", 0, 10, 10)], [("op", 0, 5)], window=(0, 20), steps=1)
    assert rows == [{"op": "(no host op)", "idle_ms_per_step": 0.01, "gaps_per_step": 1.0}]


def test_the_gap_sweep_finds_what_a_search_of_every_range_finds():
    """charge_gaps' sweep (each range pushed and dropped once) equals the plain definition: the range with the
    latest start among those holding the midpoint, on random overlapping ranges."""
    rng = random.Random(0)
    ranges = sorted(
        (
            (f"op{i}", start, start + rng.uniform(0, 30))
            for i, start in enumerate(rng.uniform(0, 200) for _ in range(300))
        ),
        key=lambda r: r[1],
    )
    gaps = sorted((start, start + rng.uniform(0.1, 5)) for start in (rng.uniform(0, 230) for _ in range(200)))
    expected: dict[str, float] = {}
    for gap_start, gap_end in gaps:
        middle = (gap_start + gap_end) / 2
        holding = [r for r in ranges if r[1] <= middle <= r[2]]
        name = max(holding, key=lambda r: r[1])[0] if holding else "none"
        expected[name] = expected.get(name, 0.0) + gap_end - gap_start
    rows = device_time.charge_gaps(gaps, ranges, steps=1, outside="none")
    assert {row["name"]: row["idle_ms_per_step"] * 1e3 for row in rows} == pytest.approx(expected)
    assert len(expected) > 20
