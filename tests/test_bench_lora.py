"""verification/lora_bench.py's launches (scripts/bench_lora.py), checked on the CPU without running them: each is
the model's shipped LoRA or full fine-tune recipe, at the released model's size."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from core import config_tree
from core.config import Config
from modeling.build import build_model
from modeling.lora import apply_lora
from tests.tiers import tiered
from verification.lora_bench import RECIPES, launch_command

# parameters of the released checkpoints (Qwen2.5-VL-7B-Instruct: 8.29B; Qwen3-VL-8B-Instruct: 8.77B; Qwen3.5-9B: a
# 9B-class model), with room for rounding details
PARAMETERS = {"7b": (8.2e9, 8.4e9), "8b": (8.6e9, 8.9e9), "9b": (8.5e9, 10.5e9)}


def launched_config(command: list[str]) -> Config:
    """The config train.py builds from a launch command (its recipe and dotted overrides)."""
    args = command[command.index("train.py") + 1 :]
    return config_tree.load(Config, args[1], args[2:])


@pytest.mark.parametrize("model", tiered(sorted(RECIPES), fast=["7b"]))
def test_each_launch_is_the_released_model_with_its_recipes_settings(model, tmp_path):
    """The LoRA launch runs one process with the LoRA recipe's lora section, dtype, checkpointing, pack budget and
    learning rate; the full launch runs fsdp2 on --full-gpus processes without adapters; both build the released
    model's full depth (its parameter count, on the meta device) and time only the steps after the warm-up."""
    lora_recipe, full_recipe = RECIPES[model]
    args = argparse.Namespace(steps=25, warmup=10, full_gpus=2, overrides=["train.compile=true"])
    lora_command = launch_command(model, "lora", tmp_path / "lora", args)
    full_command = launch_command(model, "full", tmp_path / "full", args)
    assert "accelerate.commands.launch" not in lora_command and "--num_processes=2" in full_command
    lora_cfg, full_cfg = launched_config(lora_command), launched_config(full_command)
    recipe = config_tree.load(Config, lora_recipe)
    assert lora_cfg.lora == recipe.lora and full_cfg.lora is None
    for cfg, source in ((lora_cfg, recipe), (full_cfg, config_tree.load(Config, full_recipe))):
        assert cfg.model.dtype == source.model.dtype and cfg.train.lr == source.train.lr
        assert cfg.model.gradient_checkpointing_llm == source.model.gradient_checkpointing_llm
        assert cfg.packing.max_tokens == source.packing.max_tokens == 16384
        assert cfg.train.compile and cfg.logging.timing_warmup_steps == 10 and cfg.train.max_steps == 25
        assert Path(cfg.train.output_dir).parent == tmp_path
    with torch.device("meta"):
        meta = build_model(lora_cfg.model)
    low, high = PARAMETERS[model]
    assert low < sum(p.numel() for p in meta.parameters()) < high
    report = apply_lora(meta, lora_cfg.lora, torch.bfloat16)
    assert report.targets and report.adapter_params < 0.01 * sum(p.numel() for p in meta.parameters())


def test_separate_calls_fill_one_results_file_and_a_failed_launch_is_reported(tmp_path, monkeypatch, capsys):
    """Each call runs its models' and modes' launches and keeps the file's other runs (one call per model and mode
    fits a machine's time limit), every run with its command, provenance and summary; a launch that fails is
    recorded with its log's tail and makes the call exit 1."""
    import json

    from verification import lora_bench as bench_lora
    from verification.launch import Outcome

    def fake_launch(command, log_path, timeout, new_session):
        log_path.write_text("the run's log\n")
        cfg = launched_config(command)
        if cfg.lora is None and "fail" in str(log_path):  # the full fine-tune of the second file
            return Outcome(code=1, wall_s=1.0)
        run_dir = Path(cfg.train.output_dir)
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"tokens_per_s_per_gpu": 5000.0, "mfu": 0.41}))
        return Outcome(code=0, wall_s=1.0)

    monkeypatch.setattr(bench_lora, "run_logged", fake_launch)
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--out", str(out), "--models", "7b", "--modes", "lora"]) == 0
    assert bench_lora.main(["--out", str(out), "--models", "7b", "--modes", "full"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["model"], r["mode"], r["gpus"]) for r in runs] == [("7b", "lora", 1), ("7b", "full", 2)]
    assert all(r["summary"]["mfu"] == 0.41 and r["provenance"]["source_sha256"] and r["command"] for r in runs)
    assert "41.0%" in capsys.readouterr().out
    failing = tmp_path / "fail" / "lora.json"
    failing.parent.mkdir()
    assert bench_lora.main(["--out", str(failing), "--models", "7b"]) == 1
    failed = {r["mode"]: r for r in json.loads(failing.read_text())["runs"]}
    assert "summary" in failed["lora"] and "the run's log" in failed["full"]["error"]
