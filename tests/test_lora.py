"""LoRA (modeling/lora.py): which layers get adapters and what trains, the frozen base in the compute dtype, the
adapted model's step-0 equality with its base, checkpoints of the trained tensors only, the merged and peft-format
exports, and a CPU training run of recipes/lora-tiny.yaml (loss, checkpoint, export, exact resume)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForImageTextToText, AutoProcessor

import train
from core.config import LoraConfig, load_config
from core.config_tree import ConfigError
from core.families import MODEL_TYPES
from modeling import lora, parts
from modeling.build import build_model
from modeling.lora import ADAPTER, apply_lora, full_state_dict, lora_layers, merged_state
from modeling.packed import enable_packed_forward, packed_model_inputs
from tests.tiers import tiered
from trainer import metrics
from verification.packing_check import SampleSpec, pack_samples, randomize_adapters

FAMILIES = MODEL_TYPES  # every family of the registry, so a new one cannot be missed
FAST_FAMILIES = ("qwen2_5_vl", "qwen3_5")  # one chunked-rope family, one Gated DeltaNet family; the rest in test-all
RECIPE = "recipes/lora-tiny.yaml"
PACK = (SampleSpec(0, ((4, 4),), text_after=9), SampleSpec(20), SampleSpec(3, ((2, 4),), text_after=5))


def adapted(model: nn.Module, dtype: torch.dtype = torch.float32, randomize: bool = True, **settings) -> nn.Module:
    """`model` with rank-4 adapters (`settings`: LoraConfig fields); with `randomize`, every lora_B drawn at random
    (peft initialises it to 0, so the adapters would change nothing and a check through them would pass vacuously)."""
    apply_lora(model, LoraConfig(rank=4, **settings), dtype)
    if randomize:
        randomize_adapters(model)
    return model


def packed_logits(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**packed_model_inputs(model, batch), use_cache=False).logits


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.rank=0"], "lora.rank must be >= 1"),
        (["lora.alpha=0"], "lora.alpha must be > 0"),
        (["lora.dropout=1"], r"lora.dropout must be in \[0, 1\)"),
        (["lora.target_modules=[]"], "non-empty list"),
        (["lora.trainable=[lora_A]"], "must be one of"),
        (["lora.trainable=[merger, merger]"], "lists a part twice"),
        (["lora.vision=true", "lora.trainable=[vision]"], "choose one"),
        (["lora.rank=4", "model.freeze_vision=true"], "Unset model.freeze_"),
        (["lora.trainable=[]", "train.lr_merger=1e-5"], "nothing of the merger trains under lora"),
        (["lora.rnak=4"], "Did you mean 'lora.rank'"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused(overrides, message):
    """A lora setting that cannot work, or contradicts another, is a ConfigError saying how to fix it."""
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)


def test_lora_is_off_unless_asked_and_any_lora_key_turns_it_on():
    """Without a lora section the run is a full fine-tune; one lora key turns LoRA on with the defaults
    (LLaMA-Factory's: rank 8, alpha 2 x rank, no dropout, every linear layer of the language model); `lora=null`
    turns it off."""
    assert load_config("recipes/tiny-qwen2_5_vl.yaml").lora is None
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", ["lora.dropout=0.0"]).lora
    assert (cfg.rank, cfg.scaling_alpha, cfg.target_modules, cfg.trainable) == (8, 16.0, "all-linear", [])
    assert load_config(RECIPE, ["lora=null"]).lora is None


def linear_layers(model: nn.Module, prefix: str) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith(prefix)}


def test_all_linear_adapts_every_linear_layer_of_the_language_model_and_only_adapters_train(tiny_model):
    """ "all-linear" puts an adapter on every nn.Linear of the language model (attention, Gated DeltaNet projections,
    shared experts and their gate) and on nothing else (no lm_head, no ViT, no merger; MoE routers and expert banks
    are not nn.Linear); only the adapters' A and B then train."""
    model = tiny_model("qwen3_5_moe")
    expected = linear_layers(model, "model.language_model.")
    report = apply_lora(model, LoraConfig(), torch.float32)
    assert set(report.targets) == set(lora_layers(model)) == expected
    leaves = {name.rsplit(".", 1)[-1] for name in expected}
    assert {"q_proj", "o_proj", "in_proj_qkv", "in_proj_a", "out_proj", "down_proj", "shared_expert_gate"} <= leaves
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{t}.{kind}.{ADAPTER}.weight" for t in expected for kind in ("lora_A", "lora_B")}
    assert report.adapter_params == sum(p.numel() for name, p in model.named_parameters() if name in trainable)


def test_vision_merger_named_targets_and_trained_parts(tiny_model):
    """lora.vision / lora.merger add the ViT blocks' and the mergers' linear layers; a list of names adapts the
    layers whose path ends with one; lora.trainable trains whole parts beside the adapters (the merger here), and
    their learning-rate group is the part's own."""
    model = tiny_model("qwen3_vl")
    text = {n for n in linear_layers(model, "model.language_model.") if n.endswith(("q_proj", "v_proj"))}
    vision = {n for n in linear_layers(model, "model.visual.blocks.") if n.endswith("qkv")}
    adapted(model, randomize=False, target_modules=["q_proj", "v_proj", "qkv"], vision=True, trainable=["merger"])
    assert set(lora_layers(model)) == text | vision
    merger = [p for m in parts.merger_parts(model) for p in m.parameters()]
    assert merger and all(p.requires_grad for p in merger)
    frozen_vision = [p for name, p in model.named_parameters() if name.startswith("model.visual.blocks.")]
    assert {p.requires_grad for p in frozen_vision} == {True, False}  # the adapters train, the base does not


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"target_modules": ["qproj"]}, r"matches no linear layer of the language model; its linear layers are named"),
        ({"target_modules": ["q_proj", "qkv"]}, r"names \['qkv'\], which match no linear layer"),
        ({"target_modules": ["q_proj"], "vision": True}, "matches no linear layer of the vision tower"),
    ],
)
def test_target_names_that_match_nothing_are_refused(tiny_model, settings, message):
    """A target name that matches no linear layer, or an adapted part where no name matches, is an error that lists
    the layer names there (before anything is changed)."""
    model = tiny_model("qwen2_5_vl")
    with pytest.raises(ValueError, match=message):
        apply_lora(model, LoraConfig(**settings), torch.float32)
    assert not lora_layers(model)


def test_a_model_is_adapted_once(tiny_model):
    """A second apply_lora on the same model is refused (it would wrap the adapters' layers again)."""
    model = adapted(tiny_model("qwen2_vl"), randomize=False)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LoraConfig(), torch.float32)


def test_frozen_base_is_held_in_the_compute_dtype(tiny_model):
    """In bf16 the frozen matmul weights (the adapted layers' bases, the untouched ViT, an untied lm_head) are bf16:
    2 bytes per base parameter; embeddings, norms, gates and the depthwise conv stay fp32, and what trains (adapters,
    the merger trained fully) stays fp32, the optimizer's masters."""
    model = tiny_model("qwen3_5")
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    adapted(model, torch.bfloat16, randomize=False, trainable=["merger"])
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    assert all(dtypes[name] == torch.float32 for name in trains)
    assert dtypes["model.language_model.layers.0.linear_attn.in_proj_qkv.base_layer.weight"] == torch.bfloat16
    assert dtypes["model.visual.blocks.0.attn.qkv.weight"] == torch.bfloat16
    assert dtypes["lm_head.weight"] == torch.bfloat16
    assert dtypes["model.language_model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.language_model.norm.weight"] == torch.float32
    assert dtypes["model.language_model.layers.0.linear_attn.A_log"] == torch.float32
    assert dtypes["model.language_model.layers.0.linear_attn.conv1d.weight"] == torch.float32


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=FAST_FAMILIES))
def test_step_zero_adapted_logits_equal_the_base_models(tiny_model, tiny_samples, family):
    """With peft's initialisation (lora_B = 0) the adapted model's logits on a pack equal its base model's bit for
    bit: in fp32, and in bf16 autocast with the frozen base held in bf16 against the fp32 base that autocast casts.
    MoE expert banks are the exception autocast makes: it leaves F.grouped_mm alone, so fp32 experts multiply in fp32
    and the bf16-held ones in bf16 (as under FSDP2); there the reference holds its experts in bf16 too."""
    base = tiny_model(family)
    enable_packed_forward(base)
    batch = pack_samples(base, tiny_samples(base, PACK))
    for dtype in (torch.float32, torch.bfloat16):
        reference = base
        if "moe" in family and dtype == torch.bfloat16:
            reference = copy.deepcopy(base)
            with torch.no_grad():
                for name, param in reference.named_parameters():
                    if ".experts." in name:
                        param.data = param.data.to(dtype)
        model = adapted(copy.deepcopy(base), dtype, randomize=False, vision=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            assert torch.equal(packed_logits(model, batch), packed_logits(reference, batch)), dtype


def trained_names(model: nn.Module, prefix: str = "") -> set[str]:
    return {prefix + name for name, p in model.named_parameters() if p.requires_grad}


def test_state_dict_holds_what_trains_and_loads_back_strictly(tiny_model):
    """The adapted model's state dict (under a wrapper, as accelerate sees it) is exactly its trainable tensors;
    loading it into a freshly adapted model is strict yet asks for no frozen tensor, and restores every trained one;
    a missing trained tensor is still an error; `full_state_dict` gives the whole model for the export."""
    model = adapted(tiny_model("qwen2_5_vl"), trainable=["merger"])
    wrapper = nn.ModuleDict({"model": model})
    state = wrapper.state_dict()
    assert set(state) == trained_names(model, "model.")
    fresh = nn.ModuleDict({"model": adapted(tiny_model("qwen2_5_vl"), randomize=False, trainable=["merger"])})
    assert not fresh.load_state_dict(state).missing_keys
    assert all(torch.equal(fresh.state_dict()[key], value) for key, value in state.items())
    incomplete = dict(state)
    dropped = incomplete.popitem()[0]
    with pytest.raises(RuntimeError, match=dropped.replace(".", r"\.")):
        fresh.load_state_dict(incomplete)
    with full_state_dict(model):
        whole = wrapper.state_dict()
    assert set(whole) == {f"model.{name}" for name, _ in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_merged_weights_and_the_peft_adapter_reproduce_the_adapted_model(tiny_model, tiny_samples, family, tmp_path):
    """merged_state folds every adapter into its base weight: the merged weights load strictly into the plain model
    (no adapter keys left), and the adapter written in peft's format loads onto the base with
    `PeftModel.from_pretrained`; both give the adapted model's logits (merger trained fully, ViT adapted)."""
    settings = {"vision": True, "trainable": ["merger"]}
    model = adapted(tiny_model(family), **settings)
    with torch.no_grad():
        for param in parts.merger_parts(model)[0].parameters():
            param.add_(0.05)  # the fully trained merger moved away from its initial weights
    sample = tiny_samples(model, PACK[:1])[0]
    inputs = {
        "input_ids": sample.input_ids[None],
        "mm_token_type_ids": sample.mm_token_type_ids[None],
        "pixel_values": sample.pixel_values,
        "image_grid_thw": sample.image_grid_thw,
    }
    with torch.no_grad():
        expected = model(**inputs).logits
        assert (expected - tiny_model(family)(**inputs).logits).abs().max() > 1e-2  # the adapters change the output
    with full_state_dict(model):
        state = model.state_dict()
    plain = tiny_model(family)
    plain.load_state_dict(merged_state(state, model))
    lora.export_adapter(tmp_path, state, model, LoraConfig(rank=4, **settings), None, torch.float32)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    deepstack = getattr(model.model.visual, "deepstack_merger_list", [])
    merger_paths = ["model.visual.merger", *(f"model.visual.deepstack_merger_list.{i}" for i in range(len(deepstack)))]
    assert config["modules_to_save"] == merger_paths
    with_adapter = PeftModel.from_pretrained(tiny_model(family), tmp_path)
    with torch.no_grad():
        for reloaded in (plain, with_adapter):
            torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=1e-5, atol=1e-5)


# ----- a training run of recipes/lora-tiny.yaml on the CPU -----


def run_args(out: Path, cache: Path, *overrides: str) -> list[str]:
    """train.py's arguments for the tiny LoRA recipe on a small slice of the built-in data, 4 steps, collated
    inline."""
    return [
        "--config",
        RECIPE,
        f"train.output_dir={out}",
        f"data.cache_dir={cache}",
        "data.num_samples=32",
        "data.eval_fraction=0",
        "data.num_workers=0",
        "packing.max_tokens=512",
        "kernels.mrope=unfused",  # the fused kernels would run under the Triton interpreter here, far slower
        "train.max_steps=4",
        "train.warmup_steps=1",
        "checkpoint.every_steps=2",
        "logging.every_steps=1",
        "logging.timing_warmup_steps=1",
        "logging.progress_bar=false",
        "logging.report_to=none",
        *overrides,
    ]


def run_train(out: Path, cache: Path, *overrides: str, resume: bool = False) -> dict:
    try:
        return train.main(run_args(out, cache, *overrides) + (["--resume"] if resume else []))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A 4-step LoRA run of recipes/lora-tiny.yaml: checkpoints after steps 2 and 4, the export. (run dir, data
    cache, summary)"""
    root = tmp_path_factory.mktemp("lora")
    out, cache = root / "run", root / "cache"
    return out, cache, run_train(out, cache)


def adapted_tiny_model_from(cfg) -> nn.Module:
    """A run's model as train.py builds it: the seeded random base with the recipe's adapters."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    apply_lora(model, cfg.lora, torch.float32)
    return model


def test_lora_run_trains_and_checkpoints_only_what_trains(lora_run):
    """The tiny LoRA recipe's loss falls over 4 steps, and each checkpoint's model file holds exactly the trained
    tensors (adapters, the merger) with their optimizer state, and no frozen base weight: a small fraction of the
    model."""
    out, _, summary = lora_run
    assert summary["steps"] == 4 and summary["loss_end"] < summary["loss_start"]
    model = adapted_tiny_model_from(load_config(str(out / "config.yaml")))
    for step in (2, 4):
        saved = load_file(out / "checkpoints" / f"step_{step:08d}" / "model.safetensors")
        assert set(saved) == trained_names(model, "model.")
        assert sum(t.numel() for t in saved.values()) < 0.2 * sum(p.numel() for p in model.parameters())
        optimizer = torch.load(out / "checkpoints" / f"step_{step:08d}" / "optimizer.bin", weights_only=False)
        assert len(optimizer["state"]) == len(saved)


def test_lora_export_is_the_merged_model_and_a_peft_adapter(lora_run):
    """final/ holds the merged model, which AutoModelForImageTextToText loads (every weight, no adapter key) and
    generates from an image prompt; final/adapter/ loads onto the run's base with PeftModel.from_pretrained and gives
    the merged model's logits."""
    out, _, summary = lora_run
    export = Path(summary["export_dir"])
    merged, info = AutoModelForImageTextToText.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    processor = AutoProcessor.from_pretrained(export)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[Image.new("RGB", (112, 112), "white")], return_tensors="pt")
    generated = merged.generate(**inputs, min_new_tokens=3, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3
    cfg = load_config(str(out / "config.yaml"))
    with_adapter = PeftModel.from_pretrained(build_model(cfg.model, seed=cfg.train.seed), export / "adapter")
    with torch.no_grad():
        expected = merged(**inputs).logits
        torch.testing.assert_close(with_adapter(**inputs).logits, expected, rtol=1e-5, atol=1e-5)
        base_logits = build_model(cfg.model, seed=cfg.train.seed)(**inputs).logits
        assert (base_logits - expected).abs().max() > 1e-3  # the trained adapter is in both


def test_lora_resume_gives_the_same_losses(lora_run, tmp_path):
    """Resuming from the step-2 checkpoint (the base rebuilt from its seed, the adapters, merger and optimizer state
    loaded) reproduces steps 3-4 of the uninterrupted run exactly."""
    out, cache, _ = lora_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    run_train(resumed, cache, "checkpoint.export=false", resume=True)
    assert losses(resumed) == {step: loss for step, loss in losses(out).items() if step > 2}


@pytest.mark.parametrize("moment", ["checkpoint", "export"])
@pytest.mark.slow
def test_lora_kill_9_then_resume_ends_with_the_uninterrupted_adapter(lora_run, tmp_path, moment):
    """A LoRA run killed with SIGKILL while writing its last checkpoint, or its export, and relaunched with --resume
    ends complete, each step logged once with the uninterrupted run's loss, and with exactly its final merged weights
    and adapter."""
    from tests.test_train import KILL_DURING

    out, cache, _ = lora_run
    killed = tmp_path / moment
    child = "import os, signal, sys\n" + KILL_DURING[moment] + "import train\n"
    child += f"sys.exit(train.cli({run_args(killed, cache)!r}))\n"
    process = subprocess.run([sys.executable, "-c", child], cwd=Path(train.__file__).parent, capture_output=True)
    assert process.returncode == -9, process.stderr.decode()[-2000:]
    assert not (killed / "final").exists()
    summary = run_train(killed, cache, resume=True)
    assert summary["steps"] == 4 and losses(killed) == losses(out)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        expected, written = load_file(out / "final" / name), load_file(killed / "final" / name)
        assert expected.keys() == written.keys() and all(torch.equal(expected[k], written[k]) for k in expected)


def test_adapter_only_export(tmp_path):
    """lora.merge_on_export=false: the export holds final/adapter/ and the processor, no merged weights."""
    from accelerate import Accelerator

    from core.distributed import HostCollectives
    from data.pipeline import load_processor
    from lifecycle import checkpoint
    from trainer import step

    cfg = load_config(RECIPE, [f"data.cache_dir={tmp_path / 'cache'}", "lora.merge_on_export=false"])
    model = adapted_tiny_model_from(cfg)
    try:
        accelerator = Accelerator(cpu=True)
        export = checkpoint.export(
            accelerator, step.TrainModule(model), load_processor(cfg.model, cfg.data), tmp_path / "final",
            cfg.model.dtype, HostCollectives(accelerator), cfg.lora,
        )  # fmt: skip
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert sorted(p.name for p in (export / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (export / "tokenizer.json").is_file() and not (export / "model.safetensors").exists()


# ----- MFU: what runs under LoRA and under the freeze options -----


def tiny_dimensions(cfg) -> dict[str, int]:
    """Hand counts of the tiny Qwen2.5-VL's matmul weights from its recipe: the decoder layers, the lm_head, the ViT,
    the merger, and the rank-r adapters on every linear layer of the decoder."""
    text, vision = cfg.model.config["text_config"], cfg.model.config["vision_config"]
    h, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    kv = text["num_key_value_heads"] * h // text["num_attention_heads"]
    vw, vi, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    merged_dim = vw * vision["spatial_merge_size"] ** 2
    r = cfg.lora.rank
    return {
        "llm": layers * (2 * h * h + 2 * h * kv + 3 * h * inter),
        "lm_head": text["vocab_size"] * h,
        # q, o: h -> h; k, v: h -> kv; gate, up: h -> inter; down: inter -> h; each adapter r·(in + out)
        "adapters": layers * r * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter)),
        "vit": vw * 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
        + depth * (3 * vw * vw + vw * vw + 3 * vw * vi),
        "merger": merged_dim * merged_dim + merged_dim * vision["out_hidden_size"],
        "attn_width": h,
        "vit_width": vw,
        "layers": layers,
        "vit_full": len(vision["fullatt_block_indexes"]),
        "vit_depth": depth,
    }


def test_pack_flops_count_what_runs_under_lora_and_under_freezing():
    """pack_flops counts each weight's forward, its input gradient where gradients flow through it and its weight
    gradient only if it trains. LoRA on the language model: 4·N for the frozen base (forward + input gradient),
    6·r·(in + out) per adapter, 4·V·H per labelled row for the frozen lm_head, forward only for the frozen ViT and
    merger, attention backward through the LLM only. model.freeze_llm: 4·N for the LLM (lm_head per labelled row),
    6·N for the ViT and merger that train, attention backward in both."""
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", ["lora.rank=4"])
    d = tiny_dimensions(cfg)
    lengths, grid, labels = [10, 20], (1, 8, 12), 7  # as tests/test_train.py: 96 patches, 24 merged tokens
    tokens, patches, merged = sum(lengths), 96, 24
    window_pairs = (2 * 2 + 2 * 2) * (2 * 2 + 2 * 2 + 2 * 2) * 2**4
    llm_attn = 4 * d["attn_width"] * (10**2 + 20**2) * d["layers"]
    vit_attn = 4 * d["vit_width"] * (patches**2 * d["vit_full"] + window_pairs * (d["vit_depth"] - d["vit_full"]))

    def profile(lora_cfg, frozen: dict[str, bool]):
        with torch.device("meta"):
            model = build_model(cfg.model)
        if lora_cfg is None:
            parts.freeze(model, frozen)
        else:
            apply_lora(model, lora_cfg, torch.float32)
        return metrics.FlopProfile.from_model(model)

    with_lora = profile(cfg.lora, {})
    assert with_lora.llm_matmul_params == d["llm"] + d["adapters"] and with_lora.llm_trained_params == d["adapters"]
    assert with_lora.lm_head_trained_params == 0
    expected = 4 * d["llm"] * tokens + 6 * d["adapters"] * tokens + 4 * d["lm_head"] * labels + 3 * llm_attn
    expected += 2 * d["vit"] * patches + 2 * d["merger"] * merged + vit_attn
    assert metrics.pack_flops(with_lora, lengths, [grid], labels) == pytest.approx(expected, rel=1e-12)

    frozen_llm = profile(None, {"llm": True})
    expected = 4 * d["llm"] * tokens + 4 * d["lm_head"] * labels + 3 * llm_attn
    expected += 6 * d["vit"] * patches + 6 * d["merger"] * merged + 3 * vit_attn
    assert metrics.pack_flops(frozen_llm, lengths, [grid], labels) == pytest.approx(expected, rel=1e-12)
