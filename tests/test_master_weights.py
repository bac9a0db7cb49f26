"""`train.master_weights=optimizer` on CPU: the module computes on bf16 weights, the optimizer steps fp32 masters
(training/master_weights.py); numerics against the fp32-module mode, fp32 gradient accumulation, checkpoints that
hold the masters, an exact resume, and the DDP / FSDP2 / float32 decisions."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

import train
from core.config_tree import ConfigError
from training import checkpoint, loop, master_weights, optim
from training.config import load_config
from training.setup import build_accelerator, build_training

TINY = "recipes/tiny-qwen2_5_vl.yaml"


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def tiny_overrides(data_cache: Path, mode: str, *overrides: str) -> list[str]:
    """The tiny model in bf16 on a small slice of the built-in data, masters in `mode`."""
    return [
        f"data.cache_dir={data_cache}",
        "data.num_samples=48",
        "data.eval_fraction=0",
        "packing.max_tokens=512",
        "kernels.mrope=unfused",
        "model.dtype=bfloat16",
        f"train.master_weights={mode}",
        "logging.report_to=none",
        "logging.progress_bar=false",
        *overrides,
    ]


@contextlib.contextmanager
def training(data_cache: Path, mode: str, *overrides: str, recipe: str = TINY):
    """(config, accelerator, TrainingSetup) of train.py for a tiny model in bf16; accelerate's state reset after."""
    cfg = load_config(recipe, tiny_overrides(data_cache, mode, *overrides))
    try:
        accelerator = build_accelerator(cfg)
        yield cfg, accelerator, build_training(cfg, accelerator)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_module_is_bf16_and_the_optimizer_steps_fp32_masters(data_cache):
    """Every module parameter is bf16 (frozen ones too) while buffers such as the rotary frequencies stay fp32;
    the optimizer's parameters are the fp32 masters, one per trainable parameter, in optim.param_groups' groups
    with their names, learning rates and weight decay; clipping acts on the masters."""
    with training(data_cache, "optimizer", "model.freeze_vision=true", "train.lr_merger=0.01") as (cfg, _, setup):
        model = setup.module.model
        masters = setup.masters
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert all(b.dtype == torch.float32 for name, b in model.named_buffers() if name.endswith("inv_freq"))
        assert {m.dtype for m in masters.masters} == {torch.float32}
        assert [id(p) for p in model.parameters() if p.requires_grad] == [id(p) for p in masters.params]
        assert setup.grad_params is masters.masters
        expected = optim.param_groups(model, cfg.train)
        groups = setup.optimizer.param_groups
        assert [(g["name"], g["initial_lr"], g["weight_decay"]) for g in groups] == [
            (g["name"], g["lr"], g["weight_decay"]) for g in expected
        ]
        master_of = {id(p): m for p, m in zip(masters.params, masters.masters, strict=True)}
        for group, model_group in zip(groups, expected, strict=True):
            assert [id(m) for m in group["params"]] == [id(master_of[id(p)]) for p in model_group["params"]]


def test_bf16_weights_are_the_rounded_masters_after_every_step(data_cache):
    """After each optimizer step the bf16 weights equal the fp32 masters rounded to bf16, bit for bit; the masters
    keep what bf16 cannot hold (updates smaller than a bf16 ulp accumulate), and no bf16 gradient is left behind."""
    with training(data_cache, "optimizer", "train.lr=1e-5") as (cfg, accelerator, setup):
        steps = loop.Steps(accelerator, setup, cfg.train)
        for _ in range(3):
            steps.run()
            for param, master in zip(setup.masters.params, setup.masters.masters, strict=True):
                assert torch.equal(param, master.to(torch.bfloat16))
                assert param.grad is None and master.grad is None
        steps.close()
        assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in setup.masters.masters)


@pytest.mark.parametrize("recipe", sorted(str(p) for p in Path("recipes").glob("tiny-*.yaml")), ids=lambda p: p[13:-5])
def test_first_step_matches_the_fp32_module_mode(data_cache, recipe):
    """The issue's numerics rule, for every family: step 1's loss within 1e-2 and its gradient norm within 1e-2
    (relative) of the fp32-module run under autocast, on the same batches from the same initial weights (the bf16
    module also keeps the residual stream in bf16; the gaps measured on CPU are ~1e-4)."""
    results = {}
    for mode in ("module", "optimizer"):
        with training(data_cache, mode, recipe=recipe) as (cfg, accelerator, setup):
            steps = loop.Steps(accelerator, setup, cfg.train)
            result = steps.run()
            steps.close()
            results[mode] = ((result.loss_sum / result.label_count).item(), result.grad_norm.item())
    (loss_module, norm_module), (loss_optimizer, norm_optimizer) = results["module"], results["optimizer"]
    assert abs(loss_optimizer - loss_module) < 1e-2
    assert abs(norm_optimizer - norm_module) < 1e-2 * norm_module


def test_micro_batch_gradients_accumulate_in_fp32(data_cache):
    """Two micro-batches' backward passes leave each master gradient equal to the fp32 sum of the two gradients
    computed separately, exactly, and sums that bf16 could not hold prove the adding happened in fp32; the bf16
    parameters hold no gradient after a backward pass."""
    with training(data_cache, "optimizer") as (*_, setup):
        loader = iter(setup.train_loader)
        batches = [next(loader), next(loader)]

        def master_grads(micro_batches: list[dict]) -> list[torch.Tensor]:
            setup.optimizer.zero_grad(set_to_none=True)
            for batch in micro_batches:
                setup.module(batch).backward()
                assert all(p.grad is None for p in setup.masters.params)
            return [m.grad.clone() for m in setup.masters.masters]

        first, second = master_grads(batches[:1]), master_grads(batches[1:])
        together = master_grads(batches)
    for a, b, both in zip(first, second, together, strict=True):
        assert both.dtype == torch.float32
        assert torch.equal(both, a + b)
    assert any(not torch.equal(both, both.to(torch.bfloat16).float()) for both in together)


def run(out: Path, data_cache: Path, *overrides: str, resume: bool = False) -> dict:
    args = ["--config", TINY, *tiny_overrides(data_cache, "optimizer", f"train.output_dir={out}", *overrides)]
    args += ["train.max_steps=4", "train.warmup_steps=2", "train.grad_accum_steps=2", "checkpoint.every_steps=2"]
    args += ["logging.every_steps=1"]
    try:
        return train.main(args + (["--resume"] if resume else []))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def saved_masters(directory: Path) -> dict[str, torch.Tensor]:
    return torch.load(directory / master_weights.STATE_NAME, weights_only=True)


def test_checkpoints_hold_fp32_masters_and_resume_is_exact(data_cache, tmp_path):
    """Every checkpoint holds the fp32 masters by parameter name (beside the bf16 model weights, their rounding); a
    run (two micro-batches per step) stopped after step 2 and resumed ends with the uninterrupted run's masters,
    optimizer moments and losses bit for bit; the export holds the masters rounded to model.dtype and loads."""
    full = tmp_path / "full"
    run(full, data_cache)
    final_checkpoint = checkpoint.latest_checkpoint(full)
    masters = saved_masters(final_checkpoint)
    weights = load_file(final_checkpoint / "model.safetensors")
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    for name, master in masters.items():
        assert torch.equal(weights[f"model.{name}"], master.to(torch.bfloat16)), name
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())

    resumed = tmp_path / "resumed"
    step_2 = full / "checkpoints" / "step_00000002"
    shutil.copytree(step_2, resumed / "checkpoints" / step_2.name)
    shutil.copy(full / "config.yaml", resumed / "config.yaml")
    run(resumed, data_cache, "checkpoint.export=false", resume=True)
    again = saved_masters(checkpoint.latest_checkpoint(resumed))
    assert again.keys() == masters.keys()
    assert all(torch.equal(again[name], masters[name]) for name in masters)
    moments = torch.load(final_checkpoint / "optimizer.bin", weights_only=True)["state"]
    moments_again = torch.load(checkpoint.latest_checkpoint(resumed) / "optimizer.bin", weights_only=True)["state"]
    assert all(torch.equal(moments[i]["exp_avg_sq"], moments_again[i]["exp_avg_sq"]) for i in moments)

    def losses(run_dir: Path) -> dict[int, float]:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    assert losses(resumed) == {step: loss for step, loss in losses(full).items() if step > 2}

    exported = dict(AutoModelForImageTextToText.from_pretrained(full / "final").named_parameters())
    assert all(torch.equal(exported[name], master.to(torch.bfloat16)) for name, master in masters.items())


def test_which_runs_keep_masters_in_the_optimizer():
    """Mode "optimizer" takes effect on one process with bf16; it changes nothing with float32 (the weights are the
    masters) or under FSDP2 (which already computes on bf16 parameters with fp32 masters); under DDP it is a
    ConfigError pointing to FSDP2, since DDP would all-reduce bf16 gradients; float16 is refused by the config."""

    def accelerator(kind: DistributedType, processes: int) -> SimpleNamespace:
        return SimpleNamespace(distributed_type=kind, num_processes=processes)

    optimizer_mode = load_config(TINY, ["model.dtype=bfloat16", "train.master_weights=optimizer"])
    assert master_weights.enabled(optimizer_mode, accelerator(DistributedType.NO, 1))
    assert not master_weights.enabled(load_config(TINY, ["model.dtype=bfloat16"]), accelerator(DistributedType.NO, 1))
    fp32 = load_config(TINY, ["model.dtype=float32", "train.master_weights=optimizer"])
    assert not master_weights.enabled(fp32, accelerator(DistributedType.NO, 1))
    assert not master_weights.enabled(optimizer_mode, accelerator(DistributedType.FSDP, 2))
    with pytest.raises(ConfigError, match=r"not supported with 2 DDP processes.*recipes/accelerate/fsdp2.yaml"):
        master_weights.enabled(optimizer_mode, accelerator(DistributedType.MULTI_GPU, 2))
    with pytest.raises(ConfigError, match=r"supports model\.dtype=bfloat16 only"):
        load_config(TINY, ["model.dtype=float16", "train.master_weights=optimizer"])
