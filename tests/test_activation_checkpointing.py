"""Activation checkpointing sized to the device: a partial count (the first N decoder layers / ViT blocks) changes no
result, and `auto` (trainer/activation_checkpointing.py) resolves to the cheapest counts whose estimate fits, on a
GPU, a CPU-only host and under LoRA, and says what it chose."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from core import config_tree
from core.config import load_config
from core.config_tree import ConfigError
from data.processing import IGNORE_INDEX
from modeling import parts
from modeling.packed import enable_packed_forward, packed_model_inputs
from trainer import activation_checkpointing, defaults
from trainer.memory_check import MemoryFitError, Target, check
from trainer.memory_estimate import estimate_memory, meta_model
from verification.packing_check import SampleSpec, label_loss, pack_samples

PACK = (SampleSpec(0, ((4, 4),), text_after=9), SampleSpec(20), SampleSpec(3, ((2, 4),), text_after=5))
AUTO = ["model.gradient_checkpointing_llm=auto", "model.gradient_checkpointing_vision=auto"]
H100, H200 = 79.2, 139.8


def loss_grads_and_calls(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict, list[int]]:
    """One pack's label loss, every parameter's gradient, and how often each decoder layer and ViT block ran its
    MLP (twice for a block that recomputes in the backward; the block's own hooks stay outside the checkpoint)."""
    blocks = [*model.model.language_model.layers, *model.model.visual.blocks]
    calls = [0] * len(blocks)
    hooks = [
        block.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, block in enumerate(blocks)
    ]
    logits = model(**packed_model_inputs(model, batch), use_cache=False).logits
    loss = label_loss(logits, batch["shift_labels"], int((batch["shift_labels"] != IGNORE_INDEX).sum()))
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, calls


def defaults_launch(device: str) -> SimpleNamespace:
    """What trainer/defaults.py and the memory check read of a one-process Accelerator."""
    return SimpleNamespace(
        device=torch.device(device), num_processes=1, distributed_type=DistributedType.NO, is_main_process=True
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_a_partial_count_trains_exactly_like_full_checkpointing(tiny_model, tiny_samples, family):
    """fp32 on the CPU: checkpointing the first decoder layer and the first ViT block (the second of each keeps its
    activations) gives the loss and every gradient of full checkpointing and of none, bit for bit; the first block of
    each stack runs its forward twice (the recompute), the second once."""
    results = {}
    for name, setting, count in (("all", True, 2), ("first", 1, 1), ("none", False, 0)):  # True == 1 as a key
        model = tiny_model(family)
        enable_packed_forward(model)
        assert parts.enable_gradient_checkpointing(model, llm=setting, vision=setting) == (count, count)
        model.train()
        batch = pack_samples(model, tiny_samples(model, PACK, seed=3))
        results[name] = loss_grads_and_calls(model, batch)
    assert results["first"][2] == [2, 1, 2, 1] and results["all"][2] == [2] * 4 and results["none"][2] == [1] * 4
    loss, grads, _ = results["first"]
    for other in ("all", "none"):
        assert torch.equal(loss, results[other][0])
        assert grads.keys() == results[other][1].keys()
        for name, grad in grads.items():
            assert torch.equal(grad, results[other][1][name]), (other, name)


def test_counts_are_checked_against_the_config_and_the_model():
    """A negative count is refused by the config in one line; a count above the stack's depth by the estimate and by
    the model, naming the key and the depth; `auto` must be resolved before either."""
    with pytest.raises(ConfigError, match="gradient_checkpointing_vision must be true, false, auto or a number"):
        load_config("recipes/tiny-qwen2_5_vl.yaml", ["model.gradient_checkpointing_vision=-1"])
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", ["model.gradient_checkpointing_llm=3"])
    with pytest.raises(ConfigError, match="gradient_checkpointing_llm=3: the model has 2"):
        estimate_memory(cfg)
    model = meta_model(cfg.model)
    with pytest.raises(ConfigError, match="gradient_checkpointing_llm=3: the model has 2"):
        parts.enable_gradient_checkpointing(model, llm=3, vision=False)
    with pytest.raises(ConfigError, match="not resolved"):
        estimate_memory(load_config("recipes/tiny-qwen2_5_vl.yaml", AUTO))


def test_auto_is_the_cheapest_pair_of_counts_that_fits():
    """On a model of 6 decoder layers and 6 ViT blocks, for device sizes between none and full checkpointing,
    `choose` returns what a search of every pair of counts finds: the least recompute cost among the pairs whose
    estimate is within the allowance (ties: the one found first, more ViT blocks), its estimate within it."""
    overrides = [
        *AUTO,
        "model.config.text_config.num_hidden_layers=6",
        "model.config.vision_config.depth=6",
        "model.config.vision_config.fullatt_block_indexes=[1,3,5]",
    ]
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", overrides)
    model = meta_model(cfg.model)
    llm_costs, vit_costs = activation_checkpointing.recompute_costs(cfg, model)

    def total(llm: int, vision: int) -> float:
        return estimate_memory(activation_checkpointing.with_counts(cfg, {"llm": llm, "vision": vision}), model=model)

    totals = {pair: total(*pair).total_gib for pair in itertools.product(range(7), range(7))}
    lowest, highest = totals[(6, 6)], totals[(0, 0)]
    assert lowest < highest
    for share in (0.2, 0.5, 0.8):
        capacity = (lowest + share * (highest - lowest)) / (1 - activation_checkpointing.AUTO_MARGIN)
        choice = activation_checkpointing.choose(cfg, 1, "none", True, capacity, model)
        allowed = activation_checkpointing.allowed_gib(capacity)
        fitting = [pair for pair, gib in totals.items() if gib <= allowed]
        cheapest = min(sum(llm_costs[:llm]) + sum(vit_costs[:vision]) for llm, vision in fitting)
        assert choice.fits and choice.estimate.total_gib <= allowed
        assert sum(llm_costs[: choice.counts[0]]) + sum(vit_costs[: choice.counts[1]]) == cheapest


@pytest.fixture(scope="module")
def qwen3_vl_2b():
    cfg = load_config("recipes/qwen3_vl-2b.yaml")
    return cfg, meta_model(cfg.model)


def test_the_shipped_recipe_recomputes_less_on_a_larger_gpu(qwen3_vl_2b):
    """qwen3_vl-2b.yaml as shipped (`auto` for both stacks): on an 80 GB H100 and a 141 GB H200 auto's estimate fits
    within the allowance; the H200 recomputes no more blocks of either stack than the H100, and fewer in all; one
    decoder layer fewer on the H100 would not fit."""
    cfg, model = qwen3_vl_2b
    h100 = activation_checkpointing.choose(cfg, 1, "none", True, H100, model)
    h200 = activation_checkpointing.choose(cfg, 1, "none", True, H200, model)
    assert h100.fits and h200.fits
    assert h200.counts[0] <= h100.counts[0] and h200.counts[1] <= h100.counts[1] and h200.counts != h100.counts
    if h100.counts[0]:
        fewer = {"llm": h100.counts[0] - 1, "vision": h100.setting("vision")}
        estimate = estimate_memory(activation_checkpointing.with_counts(cfg, fewer), model=model)
        assert estimate.total_gib > activation_checkpointing.allowed_gib(H100)


def test_auto_under_lora_sizes_the_llm_and_keeps_the_explicit_vit(caplog):
    """lora-qwen3_vl-8b.yaml (`auto` LLM, frozen ViT set to false): on an 80 GB H100 some but not all decoder layers
    recompute, the ViT's false is kept, and the one resolved key is logged with its count of the depth."""
    cfg = load_config("recipes/lora-qwen3_vl-8b.yaml")
    resolved, lines = activation_checkpointing.resolve(cfg, 1, "none", True, H100, "a test H100")
    assert 0 < resolved.model.gradient_checkpointing_llm < 36 and resolved.model.gradient_checkpointing_vision is False
    (line,) = lines
    assert line.startswith(f"model.gradient_checkpointing_llm=auto -> {resolved.model.gradient_checkpointing_llm} (")
    assert f"{resolved.model.gradient_checkpointing_llm} of 36 decoder layers recompute" in line


def test_when_nothing_fits_auto_checkpoints_everything_and_the_check_names_what_fits(qwen3_vl_2b):
    """On a 40 GiB device the shipped 2B fits with no count: auto checkpoints every block and says so; the memory
    check then refuses in one line naming single changes that fit (a smaller pack)."""
    cfg, model = qwen3_vl_2b
    resolved, lines = activation_checkpointing.resolve(cfg, 1, "none", True, 40.0, "a 40 GiB test GPU", model)
    assert resolved.model.gradient_checkpointing_llm is True and resolved.model.gradient_checkpointing_vision is True
    assert all("over the device: the memory check names what fits" in line for line in lines) and len(lines) == 2
    accelerator = defaults_launch("cuda")
    with pytest.raises(MemoryFitError, match=r"Each of these fits: .*packing.max_tokens="):
        check(resolved, accelerator, Target(40.0, "a 40 GiB test GPU", True))


def test_a_refusal_names_the_checkpointing_counts_that_fit(qwen3_vl_2b):
    """qwen3_vl-2b without LLM checkpointing on a device just too small for it: the refusal names the decoder-layer
    count that fits (what auto would choose there), not only full checkpointing."""
    cfg, model = qwen3_vl_2b
    explicit = activation_checkpointing.with_counts(cfg, {"llm": False, "vision": True})
    capacity = estimate_memory(explicit, model=model).total_gib - 1.0
    choice = activation_checkpointing.choose(
        activation_checkpointing.with_counts(explicit, {"llm": "auto"}), 1, "none", True, capacity, model
    )
    assert choice.fits and 0 < choice.counts[0] < 28
    accelerator = defaults_launch("cuda")
    with pytest.raises(MemoryFitError, match=f"model.gradient_checkpointing_llm={choice.counts[0]} "):
        check(explicit, accelerator, Target(capacity, "a test GPU", True))


def test_a_cpu_host_resolves_against_its_ram_and_the_config_records_the_choice(caplog):
    """On a CPU-only host the tiny recipe with `auto` fits the RAM without recomputing: both keys resolve to false,
    each logged as defaults.resolve logs its choices, and the config written to the run's config.yaml holds false."""
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", AUTO)
    with caplog.at_level(logging.INFO, logger=defaults.__name__):
        resolved = defaults.resolve(cfg, defaults_launch("cpu"))
    assert resolved.model.gradient_checkpointing_llm is False and resolved.model.gradient_checkpointing_vision is False
    assert "model.gradient_checkpointing_llm=auto -> false (0 of 2 decoder layers recompute" in caplog.text
    assert "RAM available" in caplog.text
    written = config_tree.to_dict(resolved)["model"]
    assert (written["gradient_checkpointing_llm"], written["gradient_checkpointing_vision"]) == (False, False)


@pytest.mark.slow
def test_two_processes_take_the_main_process_choice_and_record_it(tmp_path):
    """DDP over two CPU processes (gloo): `auto` resolves on both ranks against the RAM, every rank takes the main
    process's choice (one broadcast before the model is built: a rank left out would hang the launch), the run trains
    and its config.yaml records the resolved values."""
    from tests.test_distributed import launch, write_mixed_dataset

    data = write_mixed_dataset(tmp_path / "data")
    launch(2, tmp_path / "run", data, tmp_path / "cache", *AUTO, "train.max_steps=2", "checkpoint.export=false")
    written = config_tree.to_dict(load_config(str(tmp_path / "run" / "config.yaml")))["model"]
    assert (written["gradient_checkpointing_llm"], written["gradient_checkpointing_vision"]) == (False, False)
