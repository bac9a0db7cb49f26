"""Every recipe in recipes/ loads against the real config type; random-init ones build their model (tiny ones for
real, full-size shapes on the meta device); the accelerate launch configs parse."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from core.config import load_config
from core.families import MODEL_TYPES
from modeling import lora, parts
from modeling.build import build_model
from trainer import metrics

RECIPES = sorted(Path("recipes").glob("*.yaml"))
ACCELERATE = sorted(Path("recipes/accelerate").glob("*.yaml"))
TINY_PARAMS = 5_000_000  # a recipe whose model is smaller than this builds for real


def test_recipes_exist():
    """The recipe set the README promises is there: smoke, one tiny per family, real models, a benchmark shape."""
    names = {p.stem for p in RECIPES}
    assert {"smoke", "bench-qwen2_5_vl-3b-shape"} <= names
    assert {f"tiny-{t}" for t in MODEL_TYPES} <= names
    assert {"qwen2_5_vl-3b", "qwen2_5_vl-7b", "qwen3_vl-2b", "qwen3_vl-8b"} <= names
    assert any(n.startswith("qwen3_5-") for n in names)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads(recipe):
    """The recipe is valid against the typed config and random-inits its model from `model.config` (nothing to
    download); benchmark and real-size recipes say how much GPU memory they need."""
    cfg = load_config(str(recipe))
    assert cfg.model.name_or_path is None and cfg.model.config is not None
    if "tiny" not in recipe.stem.split("-") and recipe.stem != "smoke":
        assert "GPU memory" in recipe.read_text(), "state the GPU memory needed in a comment"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_random_init_recipe_builds(recipe):
    """Random-init recipes build: the model on the meta device (any size), its parts and FLOP profile; tiny
    models also for real, and one forward-free parameter count matches the meta build."""
    cfg = load_config(str(recipe))
    with torch.device("meta"):
        meta_model = build_model(cfg.model)
    profile = metrics.FlopProfile.from_model(meta_model)
    assert profile.llm_matmul_params > 0 and profile.vit_matmul_params > 0
    assert all(parts.part_modules(meta_model).values())
    n_params = sum(p.numel() for p in meta_model.parameters())
    if n_params < TINY_PARAMS:
        model = build_model(cfg.model)
        assert sum(p.numel() for p in model.parameters()) == n_params
        assert next(model.parameters()).dtype == getattr(torch, cfg.model.dtype)


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_config_parses(path):
    """`accelerate launch --config_file recipes/accelerate/<name>.yaml` accepts the file; fsdp2 is FSDP v2; a
    *-multinode config is its one-machine config but for several machines meeting at a static rendezvous (the
    launch command gives the machine rank and the first host, docs/cluster.md)."""
    config = load_config_from_file(str(path))
    expected = {"single_gpu": DistributedType.NO, "ddp": DistributedType.MULTI_GPU, "fsdp2": DistributedType.FSDP}
    layout = path.stem.removesuffix("-multinode")
    assert config.distributed_type == expected[layout]
    if layout == "fsdp2":
        assert config.fsdp_config["fsdp_version"] == 2
    if path.stem.endswith("-multinode"):
        one_machine = load_config_from_file(str(path.with_name(f"{layout}.yaml")))
        assert config.num_machines > 1 and config.num_processes % config.num_machines == 0
        assert config.rdzv_backend == "static" and config.main_process_ip is None
        assert config.fsdp_config == one_machine.fsdp_config
    else:
        assert config.num_machines == 1


# the full fine-tunes of real models (recipes/models/*.json at their published size)
FULL_RECIPES = [p for p in RECIPES if p.stem.startswith("qwen")]


@pytest.mark.parametrize("recipe", FULL_RECIPES, ids=lambda p: p.stem)
def test_full_fine_tune_recipes_size_their_checkpointing_to_the_gpu(recipe):
    """A real-size full fine-tune trains its ViT on 16k-token packs of large images (~56k patches): the activations of
    its blocks do not fit beside the states unless (mostly) checkpointed (the 3B ran out of an H200's memory without
    it), so both stacks are `auto`: the memory estimate picks how many blocks recompute on the GPU in use."""
    cfg = load_config(str(recipe))
    assert cfg.lora is None and cfg.packing.max_tokens == 16384
    assert cfg.model.gradient_checkpointing_llm == cfg.model.gradient_checkpointing_vision == "auto"


# each LoRA recipe and the full fine-tune recipe of the same model
LORA_RECIPES = {f"lora-{full}": full for full in ("qwen2_5_vl-7b", "qwen3_vl-8b", "qwen3_5-9b")}


@pytest.mark.parametrize(("recipe", "full"), sorted(LORA_RECIPES.items()))
def test_lora_recipes_train_their_full_recipes_model_on_one_gpu(recipe, full):
    """Each 7B/8B/9B LoRA recipe trains the checkpoint its full fine-tune recipe trains, with the same model section
    (dtype, LLM checkpointing) but for the ViT's checkpointing: its frozen ViT runs forward only and keeps no
    activations to trade. 16k-token packs; it launches on one GPU and labels its memory an estimate, or states the
    measured peak with the result file that holds it."""
    path = Path(f"recipes/{recipe}.yaml")
    cfg, full_cfg = load_config(str(path)), load_config(f"recipes/{full}.yaml")
    assert cfg.lora is not None and not (cfg.lora.vision or cfg.lora.trainable)
    assert not cfg.model.gradient_checkpointing_vision
    assert cfg.model == dataclasses.replace(full_cfg.model, gradient_checkpointing_vision=False)
    assert cfg.packing.max_tokens == 16384 and cfg.kernels == full_cfg.kernels
    text = path.read_text()
    measured = re.search(r"measured: .*\n?.*docs/results/[\w.-]+\.json", text)
    assert f"python train.py --config {path}" in text and ("estimate" in text or measured)


def test_tiny_lora_recipe_adapts_and_counts_its_flops():
    """recipes/lora-tiny.yaml builds for real with its adapters: only adapters and the parts it names train, and its
    FLOP profile counts weight gradients for those only."""
    cfg = load_config("recipes/lora-tiny.yaml")
    model = build_model(cfg.model)
    lora.apply_lora(model, cfg.lora, torch.float32)
    profile = metrics.FlopProfile.from_model(model)
    assert 0 < profile.llm_trained_params < profile.llm_matmul_params
    assert 0 < profile.vit_trained_params < profile.vit_matmul_params  # lora.vision: adapters in the ViT blocks
    assert profile.merger_trained_params == profile.merger_matmul_params  # lora.trainable: [merger]
