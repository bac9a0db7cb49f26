"""scripts/bench_recipes.py's planning, staging and report on stubbed runs (no training), and
scripts/bench_lm_head.py on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lifecycle import run_files
from scripts import bench_lm_head, bench_recipes
from trainer import step
from verification import throughput_compare as compare

ONE_GPU = [
    "qwen2_5_vl-3b",
    "qwen3_vl-2b",
    "qwen3_5-2b",
    "lora-qwen2_5_vl-7b",
    "lora-qwen3_vl-8b",
    "lora-qwen3_5-9b",
]
SPEED = {"shipped": 150.0, "eager-fp32": 100.0}  # tokens/s per GPU of the stub's runs
STEP1 = {"shipped": (2.0, 1.004), "eager-fp32": (2.003, 1.0)}  # (loss, gradient norm) at step 1


class StubRuns:
    """compare.run_variant's stand-in: writes a finished run directory (summary.json, metrics.jsonl) at once."""

    def __init__(self, fail: set[str] = frozenset(), wall_s: float = 100.0):
        self.calls: list[str] = []
        self.fail, self.wall_s = fail, wall_s

    def __call__(self, variant, repeat, args, model_type, out_dir, group, steps, warmup):
        key = f"{Path(out_dir).name}/{variant}/{repeat}"
        self.calls.append(key)
        if any(key.startswith(prefix) for prefix in self.fail):
            raise RuntimeError(f"variant {variant} run {repeat} failed (CUDA out of memory)")
        run_dir = Path(out_dir) / variant / f"run{repeat}"
        run_dir.mkdir(parents=True, exist_ok=True)
        loss, norm = STEP1[variant]
        run_files.append_metrics(run_dir, {"step": 1, "first_step_s": 30.0 + repeat, "compile_s": 20.0})
        for index in range(1, steps + 1):
            record = {"step": index, "loss": loss - 0.01 * index, "grad_norm": norm, "pack_efficiency": 0.9}
            run_files.append_metrics(run_dir, record)
        summary = {
            "tokens_per_s_per_gpu": SPEED[variant] + repeat,
            "timed_seconds": 10.0,
            "timed_steps": steps - warmup,
            "mfu": 0.5 * SPEED[variant] / 150.0,
            "peak_mem_gib": 80.0,
            "loss_end": loss - 0.01 * steps,
            "fused_rope": True,
        }
        run_files.write_summary(run_dir, summary)
        return compare.RunResult(variant, repeat, run_dir, summary, run_files.training_records(run_dir), self.wall_s)


def bench(tmp_path: Path, monkeypatch, runs: StubRuns, *args: str) -> tuple[int, dict]:
    monkeypatch.setattr(compare, "run_variant", runs)
    monkeypatch.setattr(bench_recipes, "provenance", lambda: {"commit": "stub"})
    out = tmp_path / "recipes.json"
    argv = ["--work", str(tmp_path / "work"), "--out", str(out), "--steps", "4", "--warmup", "1", *args]
    code = bench_recipes.main(argv)
    return code, json.loads(out.read_text())


def test_plan_alternates_the_variants_recipe_by_recipe():
    """Each recipe's runs come together, the variants alternating in every round (A B A B), one-GPU recipes with
    the single-GPU accelerate config and the 7B-9B ones under FSDP2 over two GPUs."""
    state = bench_recipes.State(Path("/nonexistent"))
    units = bench_recipes.plan([b for b in bench_recipes.BENCHES if b.stage == "one-gpu"], 2, state)
    assert [u.key for u in units[:4]] == [
        "qwen2_5_vl-3b/shipped/1",
        "qwen2_5_vl-3b/eager-fp32/1",
        "qwen2_5_vl-3b/shipped/2",
        "qwen2_5_vl-3b/eager-fp32/2",
    ]
    assert [u.bench.name for u in units[::4]] == ONE_GPU
    launches = {b.name: b.launcher for b in bench_recipes.BENCHES}
    assert "single_gpu.yaml" in launches["qwen3_5-2b"] and "--num_processes 2" in launches["qwen3_5-9b"]
    assert "fsdp2.yaml" in launches["qwen3_5-35b_a3b"]


def test_report_has_every_number_the_recipe_table_needs(tmp_path, monkeypatch):
    """A finished stage reports per recipe: tokens/s per GPU (median, min-max over the runs) for both variants, MFU,
    peak memory, the shipped/eager speedup against the 1.5x target, step 1's loss and gradient norm against the
    eager fp32 run and the rule, and the provenance; nothing pending."""
    code, report = bench(tmp_path, monkeypatch, StubRuns(), "--stage", "one-gpu")
    assert code == 0 and report["pending"] == [] and report["provenance"] == {"commit": "stub"}
    assert list(report["recipes"]) == ONE_GPU
    row = report["recipes"]["qwen2_5_vl-3b"]
    assert row["shipped"]["tokens_per_s_per_gpu"] == pytest.approx(151.5)
    assert (row["shipped"]["tokens_per_s_min"], row["shipped"]["tokens_per_s_max"]) == (151.0, 152.0)
    assert row["speedup_vs_eager_fp32"]["median"] == pytest.approx(151.5 / 101.5)
    assert row["shipped"]["mfu"] == 0.5 and row["shipped"]["peak_mem_gib"] == 80.0
    assert (row["shipped"]["first_step_s"], row["shipped"]["compile_s"]) == (31.0, 20.0)
    step1 = row["step1"]
    assert step1["loss_absolute_gap"] == pytest.approx(0.003) and step1["grad_norm_relative_gap"] == pytest.approx(4e-3)
    assert step1["within_rule"] and row["meets"] == {"speedup": False, "mfu": True, "step1_rule": True}
    assert row["launch"] == bench_recipes.ONE_GPU and row["model_config"] == {
        "base": "recipes/models/qwen2_5_vl-3b.json"
    }
    assert report["variants"]["eager-fp32"]["train.compile"] == "false"


def test_a_budget_stops_between_runs_and_the_next_call_resumes(tmp_path, monkeypatch):
    """With a budget shorter than a run, one call runs what fits, writes a report listing the pending runs and
    exits 3; the next call runs only those."""
    monkeypatch.setattr(bench_recipes, "FIRST_RUN_ESTIMATE_S", 0)
    runs = StubRuns(wall_s=100.0)
    code, report = bench(tmp_path, monkeypatch, runs, "--stage", "one-gpu", "--budget-s", "50")
    runs_in_stage = 4 * len(ONE_GPU)
    assert code == 3 and runs.calls == ["qwen2_5_vl-3b/shipped/1"] and len(report["pending"]) == runs_in_stage - 1
    assert report["recipes"]["qwen2_5_vl-3b"]["eager-fp32"] is None
    code, report = bench(tmp_path, monkeypatch, runs, "--stage", "one-gpu")
    assert code == 0 and report["pending"] == [] and len(runs.calls) == runs_in_stage == len(set(runs.calls))


def test_recipes_and_variants_choose_what_runs_now_and_the_report_keeps_every_run(tmp_path, monkeypatch):
    """--recipes and --variants run a subset; the report still lists the other variant's runs as pending, and a
    later call with the other variant completes the rows (speedup and step-1 rule) from both calls' runs. A LoRA
    recipe is held to the one-GPU LoRA MFU target."""
    runs = StubRuns()
    subset = ("--stage", "one-gpu", "--recipes", "qwen3_vl-2b,lora-qwen3_5-9b", "--repeats", "1")
    code, report = bench(tmp_path, monkeypatch, runs, *subset, "--variants", "shipped")
    assert code == 3 and runs.calls == ["qwen3_vl-2b/shipped/1", "lora-qwen3_5-9b/shipped/1"]
    assert sorted(report["pending"]) == ["lora-qwen3_5-9b/eager-fp32/1", "qwen3_vl-2b/eager-fp32/1"]
    lora = report["recipes"]["lora-qwen3_5-9b"]
    assert lora["mfu_target"] == bench_recipes.TARGETS["mfu_lora_one_gpu"] and "speedup_vs_eager_fp32" not in lora
    code, report = bench(tmp_path, monkeypatch, runs, *subset, "--variants", "eager-fp32")
    assert code == 0 and len(runs.calls) == 4 and report["recipes"]["qwen3_vl-2b"]["step1"]["within_rule"]
    with pytest.raises(bench_recipes.ConfigError, match="qwen3_5-9b"):
        bench(tmp_path, monkeypatch, runs, "--stage", "one-gpu", "--recipes", "qwen3_5-9b")


def test_the_moe_recipe_runs_the_largest_layer_count_that_fits(tmp_path, monkeypatch):
    """A failed MoE run (out of memory) gives its layer count up; the next smaller one is planned and run, and
    the report states the reduction."""
    runs = StubRuns(fail={f"qwen3_5-35b_a3b-{bench_recipes.MOE_LAYERS[0]}layers/"})
    code, report = bench(tmp_path, monkeypatch, runs, "--stage", "moe")
    second = bench_recipes.MOE_LAYERS[1]
    assert code == 0 and list(report["failed"]) == [f"qwen3_5-35b_a3b-{bench_recipes.MOE_LAYERS[0]}layers/shipped/1"]
    row = report["recipes"]["qwen3_5-35b_a3b"]
    assert f"reduced to {second} of 40 decoder layers" in row["note"]
    assert f"model.config.text_config.num_hidden_layers={second}" in row["overrides"]
    types = next(o for o in row["overrides"] if "layer_types" in o)
    assert types.count("full_attention") == second // 4 and types.count("linear_attention") == 3 * second // 4


def test_lm_head_bench_puts_training_rows_back_and_counts_both_ways(monkeypatch):
    """bench_lm_head's every-row way covers every position of the batch, training's label_rows choice is back after
    each timed step (even one that fails), and the FLOP count of the lm_head differs only by the rows counted."""
    batch = {"shift_labels": torch.full((2, 5), -100)}
    assert torch.equal(bench_lm_head.every_row(batch), torch.arange(10))

    def failing_step(*args):
        assert step.labelled_rows is bench_lm_head.every_row
        raise RuntimeError("stub")

    monkeypatch.setattr(step, "optimizer_step", failing_step)
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    setup = SimpleNamespace(module=None, optimizer=None, scheduler=None, grad_params=[])
    with pytest.raises(RuntimeError, match="stub"):
        bench_lm_head.timed_step(setup, accelerator, [], "every_row", 1.0)
    assert step.labelled_rows is bench_lm_head.LABELLED_ROWS
    profile = SimpleNamespace(lm_head_params=10, lm_head_trained_params=10, llm_input_grads=True)
    assert bench_lm_head.lm_head_flops(profile, tokens=100, labels=15) == {"labelled_rows": 900.0, "every_row": 6000.0}
    frozen_head = SimpleNamespace(lm_head_params=10, lm_head_trained_params=0, llm_input_grads=True)  # LoRA: 4·V·H
    assert bench_lm_head.lm_head_flops(frozen_head, tokens=100, labels=15)["labelled_rows"] == 600.0


@pytest.mark.slow
def test_lm_head_bench_times_both_ways_on_the_tiny_model(tmp_path):
    """On the tiny recipe (CPU): both ways train every step of the same batches; the report has their step times,
    the labelled share of the packs and the lm_head FLOPs both ways."""
    out = tmp_path / "lm_head.json"
    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=24", "packing.max_tokens=512", "data.eval_fraction=0"]
    argv = ["--config", "recipes/tiny-qwen2_5_vl.yaml", "--steps", "2", "--warmup", "1", "--out", str(out)]
    result = bench_lm_head.main([*argv, *overrides, "kernels.mrope=unfused", f"train.output_dir={tmp_path / 'run'}"])
    assert json.loads(out.read_text())["step_time_s"] == result["step_time_s"]
    assert {way: spread["n"] for way, spread in result["step_time_s"].items()} == {"labelled_rows": 2, "every_row": 2}
    assert 0 < result["labelled_share"] < 1
    flops = result["lm_head_flops_per_pack"]
    assert flops["every_row"] > flops["labelled_rows"] > 0
