"""The memory estimate (trainer/memory_estimate.py), train.py's check against the device (trainer/memory_check.py)
and scripts/estimate_memory.py: the breakdown's arithmetic, its direction under the settings that change memory, the
one-line refusal, and every recipe estimable from its model on the meta device."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from core.config import load_config
from modeling.build import build_model
from modeling.master_weights import cast_param_ids
from scripts import estimate_memory as cli
from trainer import activation_checkpointing
from trainer.memory_check import MemoryFitError, Target, check
from trainer.memory_estimate import CALIBRATION_FILE, GIB, block_activation_bytes, estimate_memory, meta_model

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-qwen2_5_vl.yaml"
TINY_MOE = "recipes/tiny-qwen3_vl_moe.yaml"
TINY_BF16 = ["model.dtype=bfloat16"]
STATE_PARTS = ("weights", "masters", "gradients", "optimizer")


@pytest.fixture(scope="module")
def tiny_counts() -> tuple[int, int]:
    """(parameters, matmul-weight parameters) of the tiny Qwen2.5-VL."""
    model = meta_model(load_config(TINY, TINY_BF16).model)
    cast = cast_param_ids(model)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if id(p) in cast)


def test_a_decoder_layers_activations_are_counted_tensor_by_tensor():
    """The tiny Qwen2.5-VL decoder layer (width 64, q 64, k and v 32 each, MLP 128), per token, eager: matmul inputs
    2·(64 [q,k,v] + 64 [o] + 64 [gate,up] + 128 [down]) = 640; kept outputs 2·(64+32+32+128+128) = 768; q, k, v
    again for the attention kernel 2·128 = 256; the gate's activation 2·128 = 256; two RMSNorms 8·64 each = 1024:
    2944 bytes. Compiled: no activation copy, norms at 4·64: 2944 − 256 − 512 = 2176."""
    layer = meta_model(load_config(TINY).model).model.language_model.layers[0]
    assert block_activation_bytes(layer, 64) == 2944
    assert block_activation_bytes(layer, 64, compiled=True) == 2176


def saved_bytes_per_token(block: torch.nn.Module, run) -> float:
    """Bytes autograd keeps per token for `run(tokens)` (a forward of `block` under CPU bf16 autocast): what the
    saved-tensor hooks see beyond `block`'s parameters, at 512 tokens less at 256, over 256 (the per-token slope)."""

    def saved(tokens: int) -> int:
        params, seen = {p.data_ptr() for p in block.parameters()}, {}

        def pack(tensor):
            if tensor.data_ptr() not in params:
                seen[tensor.data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            run(tokens)
        return sum(seen.values())

    return (saved(512) - saved(256)) / 256


@pytest.mark.parametrize("recipe", ["recipes/tiny-qwen2_5_vl.yaml", "recipes/tiny-qwen3_vl.yaml", TINY_MOE])
def test_the_count_is_what_autograd_keeps(recipe):
    """A decoder layer's and a ViT block's counted bytes per token are within 20% of what autograd saves in an eager
    bf16 forward (dense, MoE with its fp32 expert stacks of module mode). The count models the GPU path (fused rope,
    flash attention); the CPU's unfused rope keeps a little more, so the count is the lower one."""
    torch.manual_seed(0)
    cfg = load_config(recipe)
    model = build_model(dataclasses.replace(cfg.model, dtype="float32"))
    language, text, vision = model.model.language_model, model.config.text_config, model.config.vision_config

    def text_layer(tokens: int):
        x = torch.randn(1, tokens, text.hidden_size, requires_grad=True)
        positions = torch.arange(tokens)[None, None].expand(3, 1, tokens)
        rope = language.rotary_emb(x, positions)
        return language.layers[0](x, position_embeddings=rope, attention_mask=None, position_ids=positions)

    def vision_block(tokens: int):
        x = torch.randn(tokens, vision.hidden_size, requires_grad=True)
        angles = torch.randn(tokens, vision.hidden_size // vision.num_heads)
        cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
        return model.model.visual.blocks[0](x, cu_seqlens=cu_seqlens, position_embeddings=(angles.cos(), angles.sin()))

    top_k = getattr(text, "num_experts_per_tok", 0) or 0
    counted = block_activation_bytes(language.layers[0], text.hidden_size, top_k=top_k, expert_bytes=4)
    measured = saved_bytes_per_token(language.layers[0], text_layer)
    assert 0.8 <= counted / measured <= 1.0, (counted, measured)
    counted = block_activation_bytes(model.model.visual.blocks[0], vision.hidden_size)
    measured = saved_bytes_per_token(model.model.visual.blocks[0], vision_block)
    assert 0.8 <= counted / measured <= 1.0, (counted, measured)


@pytest.mark.parametrize(
    ("overrides", "processes", "on_cuda", "expected"),
    [
        # module mode: fp32 weights + autocast's bf16 copy of each matmul weight, fp32 gradients, AdamW moments
        (["train.master_weights=module"], 1, False, lambda n, c: {"weights": 4 * n + 2 * c, "masters": 0}),
        # optimizer mode: bf16 matmul weights with fp32 masters, the rest fp32
        (["train.master_weights=auto"], 1, True, lambda n, c: {"weights": 2 * c + 4 * (n - c), "masters": 4 * c}),
        # FSDP2 over 4: fp32 shards of everything
        (["train.master_weights=auto"], 4, True, lambda n, c: {"weights": n, "masters": 0, "optimizer": 2 * n}),
    ],
)
def test_the_states_are_bytes_per_parameter_by_master_weight_mode(tiny_counts, overrides, processes, on_cuda, expected):
    """weights, masters and AdamW's moments are the module docstring's bytes per parameter (8 per trained parameter
    for the moments, split over FSDP2's ranks), and the total is the sum of the parts."""
    params, cast = tiny_counts
    estimate = estimate_memory(load_config(TINY, TINY_BF16 + overrides), processes, on_cuda=on_cuda)
    want = {"optimizer": 8 * params / processes, **expected(params, cast)}
    for part, value in want.items():
        assert estimate.parts[part] == pytest.approx(value / GIB), part
    assert estimate.total_gib == pytest.approx(sum(estimate.parts.values()))
    assert estimate.peak_gib == pytest.approx(
        estimate.total_gib - estimate.parts["allocator"] - estimate.parts["runtime"]
    )


@pytest.fixture(scope="module")
def model_3b() -> torch.nn.Module:
    return meta_model(load_config("recipes/qwen2_5_vl-3b.yaml").model)


def test_the_estimate_grows_with_the_pack_and_shrinks_with_sharding_and_checkpointing(model_3b):
    """At the 3B's published size: a larger pack needs more, each checkpointed part less; FSDP2 over more GPUs
    needs less per GPU, and DDP (replicated) no less than one process."""
    recipe = "recipes/qwen2_5_vl-3b.yaml"
    checkpointed = ["model.gradient_checkpointing_llm=true", "model.gradient_checkpointing_vision=true"]

    def peak(*overrides, processes=1, sharding=None):
        cfg = load_config(recipe, [*checkpointed, *overrides])
        return estimate_memory(cfg, processes, sharding, model=model_3b).peak_gib

    packs = [peak(f"packing.max_tokens={tokens}") for tokens in (4096, 8192, 16384, 32768)]
    assert packs == sorted(packs) and len(set(packs)) == 4
    sharded = [peak(processes=n) for n in (1, 2, 4, 8)]
    assert sharded == sorted(sharded, reverse=True) and len(set(sharded)) == 4
    assert peak(processes=2, sharding="ddp") >= peak("train.master_weights=module")
    assert (
        peak()
        < peak("model.gradient_checkpointing_vision=false")
        < peak("model.gradient_checkpointing_vision=false", "model.gradient_checkpointing_llm=false")
    )


def test_lora_needs_a_fraction_of_the_full_fine_tune():
    """A LoRA run of the 7B (frozen bf16 base, adapters with AdamW) needs less than a third of its full fine-tune on
    one GPU; its trained parameters are under 1% of the model."""
    checkpointed = ["model.gradient_checkpointing_llm=true", "model.gradient_checkpointing_vision=true"]
    full = estimate_memory(load_config("recipes/qwen2_5_vl-7b.yaml", checkpointed), 1)
    lora = estimate_memory(load_config("recipes/lora-qwen2_5_vl-7b.yaml", checkpointed[:1]), 1)
    assert lora.total_gib < full.total_gib / 3
    assert lora.trainable_params < 0.01 * lora.total_params
    assert lora.parts["optimizer"] < 1.0 and lora.parts["activations_vision"] == 0  # the frozen ViT keeps nothing


RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*.yaml"))


def test_every_recipe_is_estimable_on_the_meta_device():
    """Every shipped recipe's estimate builds from its model on the meta device, one GPU and FSDP2 over 8 (`auto`
    checkpointing resolved for an 80 GB H100), with non-negative parts; the tiny recipes and the smoke run need under
    2 GiB, on a GPU or a CPU."""
    for recipe in RECIPES:
        cfg = load_config(recipe)
        model = meta_model(cfg.model)
        for processes in (1, 8):
            sharding = "none" if processes == 1 else "fsdp2"
            cfg, _ = activation_checkpointing.resolve(cfg, processes, sharding, True, 79.2, "an H100", model)
            estimate = estimate_memory(cfg, processes, model=model)
            assert all(gib >= 0 for gib in estimate.parts.values()) and estimate.total_gib > 0, recipe
        if "tiny" in recipe or "smoke" in recipe:
            for on_cuda in (True, False):
                assert estimate_memory(cfg, 1, on_cuda=on_cuda, model=model).total_gib < 2, recipe


def fake_accelerator(processes: int = 1, fsdp: bool = False) -> SimpleNamespace:
    kind = DistributedType.FSDP if fsdp else DistributedType.MULTI_GPU if processes > 1 else DistributedType.NO
    return SimpleNamespace(
        device=torch.device("cuda", 0), num_processes=processes, distributed_type=kind, is_main_process=True
    )


def test_a_run_that_cannot_fit_is_refused_with_the_overrides_that_fit(caplog):
    """The 7B full fine-tune on one 80 GB GPU: MemoryFitError, one line naming the estimate, the GPU and changes
    that each fit (LoRA, FSDP2 over more GPUs); `warn` logs that line and returns; `false` skips the check; the
    same recipe under FSDP2 over 8 fits."""
    h100 = Target(79.2, "each test GPU", True)
    checkpointed = ["model.gradient_checkpointing_llm=true", "model.gradient_checkpointing_vision=true"]
    cfg = load_config("recipes/qwen2_5_vl-7b.yaml", ["train.master_weights=auto", "train.compile=true", *checkpointed])
    with pytest.raises(MemoryFitError) as refused:
        check(cfg, fake_accelerator(), h100)
    line = str(refused.value)
    assert "\n" not in line and "79.2 GiB of each test GPU" in line
    assert "lora.rank=16" in line and "--num_processes 4" in line and "train.memory_check=warn" in line
    warn = load_config("recipes/qwen2_5_vl-7b.yaml", ["train.memory_check=warn", *checkpointed])
    with caplog.at_level(logging.WARNING, logger="trainer.memory_check"):
        assert check(warn, fake_accelerator(), h100).total_gib > h100.capacity_gib
    assert "train.memory_check=warn" in caplog.text
    assert (
        check(load_config("recipes/qwen2_5_vl-7b.yaml", ["train.memory_check=false"]), fake_accelerator(), h100) is None
    )
    assert check(cfg, fake_accelerator(8, fsdp=True), h100).total_gib < h100.capacity_gib


def test_train_py_stops_in_one_line_when_the_model_cannot_fit(tmp_path):
    """train.py on a model no machine holds (the tiny recipe at a 65,536 width: ~1 TB of states) exits non-zero
    before building anything, having printed one line: the error, no traceback."""
    huge = ["model.config.text_config.hidden_size=65536", "model.config.text_config.intermediate_size=262144"]
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            TINY,
            f"train.output_dir={tmp_path / 'run'}",
            "logging.report_to=none",
            *huge,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: the memory estimate is") and "train.memory_check=warn" in lines[0]
    assert not (tmp_path / "run").exists()


def test_compare_adds_the_estimate_beside_each_measured_peak(tmp_path, capsys):
    """--compare --out: each measured variant of a bench_recipes report gets a row with memory_estimate_gib (the
    estimate of the same recipe, overrides and launch) and memory_ratio = measured / estimate, in a new file; the
    result file itself is left as it was."""
    report = {
        "variants": {"shipped": {}, "eager-fp32": {"train.compile": "false", "train.master_weights": "module"}},
        "recipes": {
            "tiny": {
                "recipe": TINY,
                "launch": "accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 2",
                "overrides": ["packing.max_tokens=512"],
                "shipped": {"peak_mem_gib": 1.0},
                "eager-fp32": {"peak_mem_gib": 0.5},
            },
            "pending": {"recipe": TINY, "note": "no run"},
        },
    }
    path = tmp_path / "recipes-2026-12-05.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "comparison.json"
    cli.main(["--compare", str(path), "--out", str(out)])
    assert json.loads(path.read_text()) == report
    written = {row["run"]: row for row in json.loads(out.read_text())["rows"]}
    for variant, overrides in (("shipped", []), ("eager-fp32", ["train.compile=false", "train.master_weights=module"])):
        cfg = load_config(TINY, ["packing.max_tokens=512", *overrides])
        expected = estimate_memory(cfg, 2, "fsdp2").peak_gib
        row = written[f"tiny {variant}"]
        assert row["memory_estimate_gib"] == pytest.approx(expected, abs=0.01)
        assert row["memory_ratio"] == pytest.approx(row["peak_mem_gib"] / expected, rel=1e-2)
    assert "tiny shipped" in capsys.readouterr().out


def test_the_command_prints_the_breakdown_beside_the_gpu_memory_given(capsys):
    """`--gpu-memory-gib`: the breakdown, then the verdict against that memory, with the overrides that fit when it
    does not."""
    assert cli.main(["--config", "recipes/qwen2_5_vl-7b.yaml", "--gpu-memory-gib", "79.2"]) == 0
    out = capsys.readouterr().out
    assert "activations_vision" in out and "79.2 GiB: does not fit" in out and "fits with lora.rank=16" in out
    assert cli.main(["--config", "recipes/qwen2_5_vl-7b.yaml", "--gpus", "8", "--gpu-memory-gib", "79.2"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 over 8" in out and "79.2 GiB: fits" in out


def test_the_command_prints_what_auto_checkpointing_resolves_to_on_each_gpu(capsys):
    """A recipe with `auto` checkpointing (qwen3_vl-2b as shipped): for each GPU, the counts auto resolves to there,
    then the breakdown with them and the verdict; a 141 GB H200 recomputes fewer decoder layers than an 80 GB H100."""
    assert cli.main(["--config", "recipes/qwen3_vl-2b.yaml"]) == 0
    out = capsys.readouterr().out
    chosen = [int(n) for n in re.findall(r"(\d+) of 28 decoder layers recompute", out)]
    assert len(chosen) == 2 and chosen[1] < chosen[0]
    assert out.count("memory estimate per GPU") == 2 and out.count(": fits (") == 2


def test_the_calibration_command_prints_every_point(capsys):
    """--calibration: one row per point of trainer/memory_calibration.json, the excluded ones saying so."""
    assert cli.main(["--calibration"]) == 0
    out = capsys.readouterr().out
    points = json.loads(CALIBRATION_FILE.read_text())["points"]
    assert len(out.strip().splitlines()) == 1 + len(points)
    assert out.count("excluded: ") == sum(bool(p.get("excluded")) for p in points)
