"""The training loop on CPU: end-to-end runs on the built-in data, exact resume, the export, loss normalisation,
the vision tower on text-only packs, and the MFU FLOP count against a hand count."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

import train
from core.config import load_config
from core.config_tree import ConfigError
from core.distributed import HostCollectives
from data.collate import label_rows
from data.pipeline import STEP_VISION
from lifecycle import checkpoint, trusted_resume
from modeling import parts
from modeling.build import build_model
from modeling.packed import enable_packed_forward
from tests.test_config import LAUNCH_REPORTING_IMPORTS
from tests.test_data_pipeline import forkserver_processes
from trainer import loop, metrics, optim, step, tracking

TINY = "recipes/tiny-qwen2_5_vl.yaml"
METRIC_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s_per_gpu",
    "text_tokens_per_s",
    "vision_tokens_per_s",
    "step_time_s",
    "mfu",
    "pack_efficiency",
    "peak_mem_gib",
}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """One processed-data and tiny-processor cache for every run of this module (same fingerprint → reused)."""
    return tmp_path_factory.mktemp("data-cache")


def run_args(out: Path, data_cache: Path, *overrides: str) -> list[str]:
    """train.py's overrides for the tiny model on a small slice of the built-in data, 4 steps."""
    return [
        f"train.output_dir={out}",
        f"data.cache_dir={data_cache}",
        "data.num_samples=48",
        "data.eval_fraction=0.1",
        "packing.max_tokens=512",
        "kernels.mrope=unfused",  # the fused kernels would run under the Triton interpreter here, far slower
        "train.max_steps=4",
        "train.warmup_steps=2",
        "train.eval_every=2",
        "train.eval_batches=1",
        "checkpoint.every_steps=2",
        "logging.every_steps=1",
        "logging.timing_warmup_steps=1",
        "logging.progress_bar=false",
        "logging.report_to=none",
        *overrides,
    ]


def run_train(out: Path, data_cache: Path, *overrides: str, resume: bool = False) -> dict:
    """train.main in-process on the tiny model and a small slice of the built-in data."""
    args = ["--config", TINY, *run_args(out, data_cache, *overrides)]
    try:
        return train.main(args + (["--resume"] if resume else []))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_cache) -> tuple[Path, dict]:
    """A 4-step run with wandb in offline mode (no login), checkpoints every 2 steps and the export."""
    out = tmp_path_factory.mktemp("run") / "full"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(out.parent))
        mp.setenv("WANDB_SILENT", "true")
        summary = run_train(out, data_cache, "logging.report_to=wandb", "checkpoint.keep_last=2")
    return out, summary


def test_cpu_run_writes_metrics_summary_config_and_wandb(finished_run):
    """A CPU run records every contract field per step, a summary with falling loss, the resolved config (its
    `auto` settings as they ran on the CPU: eager, fp32 module weights, collated inline), and offline wandb files,
    without any wandb login."""
    out, summary = finished_run
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert set(record) >= METRIC_KEYS
        assert record["tokens_per_s_per_gpu"] > 0 and 0 < record["pack_efficiency"] <= 1
        assert record["mfu"] is None  # no peak FLOP/s on CPU without logging.peak_tflops
    assert any("eval_loss" in r for r in read_metrics(out))
    assert summary["steps"] == 4 and summary["loss_end"] < summary["loss_start"]
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_s_per_gpu"] > 0 and summary["timed_steps"] == 3
    saved = load_config(str(out / "config.yaml"))
    assert saved.train.output_dir == str(out)
    assert (saved.train.compile, saved.train.master_weights, saved.data.num_workers) == (False, "module", 0)
    wandb_run = Path(summary["wandb_dir"])
    assert wandb_run.is_dir() and wandb_run.name.startswith("offline-run-") and wandb_run.parent == out / "wandb"


def test_a_longer_log_interval_still_records_every_step(finished_run, data_cache, tmp_path):
    """With logging.every_steps=3 (one device sync per interval) metrics.jsonl still has a record per step, each with
    that step's own loss, gradient norm, learning rate and pack efficiency, equal to the every-step run's; the rates
    come only on the logged steps (3, and 4: the last)."""
    out, _ = finished_run
    every_step = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    run = tmp_path / "every3"
    overrides = ("logging.every_steps=3", "train.eval_every=0", "checkpoint.every_steps=0", "checkpoint.export=false")
    summary = run_train(run, data_cache, *overrides)
    records = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        for key in ("loss", "grad_norm", "lr", "pack_efficiency"):
            assert record[key] == every_step[record["step"]][key], (record["step"], key)
    assert [r["step"] for r in records if "tokens_per_s_per_gpu" in r] == [3, 4]
    assert set(records[2]) >= METRIC_KEYS and set(records[3]) >= METRIC_KEYS
    assert summary["loss_start"] == every_step[1]["loss"] and summary["loss_end"] == every_step[4]["loss"]


def test_evaluations_and_checkpoints_end_a_log_interval(data_cache, tmp_path):
    """With a log interval longer than the evaluation and checkpoint intervals, each of those steps is logged first:
    metrics.jsonl stays in step order (wandb drops a step older than one it has seen), and the checkpoint of step 2
    has every step through 2 written before it, for a resume."""
    run = tmp_path / "run"
    run_train(run, data_cache, "logging.every_steps=10", "train.eval_every=3", "checkpoint.every_steps=2")
    records = read_metrics(run)
    steps = [r["step"] for r in records]
    assert steps == sorted(steps)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "tokens_per_s_per_gpu" in r] == [2, 3, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 4]


@pytest.mark.slow
def test_timed_throughput_ends_with_the_last_step(data_cache, tmp_path, monkeypatch):
    """The summary's throughput covers the timed steps only: shutting the batch prefetcher down after the last step
    (which can wait on a loader worker) is not counted. A 6 s shutdown would dwarf the tiny model's steps."""
    from data.prefetch import Prefetcher

    close = Prefetcher.close

    def slow_close(self):
        time.sleep(6.0)
        close(self)

    monkeypatch.setattr(Prefetcher, "close", slow_close)
    run = tmp_path / "run"
    summary = run_train(run, data_cache, "checkpoint.export=false", "checkpoint.save_final=false", "train.eval_every=0")
    timed = [r for r in read_metrics(run) if r.get("step", 0) > 1 and "step_time_s" in r]
    interval_s = sum(r["step_time_s"] for r in timed)
    assert interval_s < 6.0  # the steps themselves are far shorter than the shutdown
    tokens = sum(r["tokens_per_s_per_gpu"] * r["step_time_s"] for r in timed)
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(tokens / interval_s, rel=0.25)


def test_resume_of_a_finished_run_keeps_its_results(finished_run, data_cache, tmp_path):
    """--resume on a run that already reached train.max_steps trains nothing and leaves summary.json as it was."""
    out, summary = finished_run
    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints" / "step_00000004", again / "checkpoints" / "step_00000004")
    (again / "summary.json").write_text(json.dumps(summary))
    assert run_train(again, data_cache, "checkpoint.export=false", resume=True) == summary
    assert json.loads((again / "summary.json").read_text()) == summary


def test_resume_gives_the_same_losses(finished_run, data_cache, tmp_path):
    """Stopping after step 2 and resuming with --resume reproduces steps 3-4 of the uninterrupted run exactly
    (model, optimizer, scheduler, RNG and data position all restored)."""
    out, _ = finished_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    run_train(resumed, data_cache, "checkpoint.export=false", resume=True)
    full = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    again = [r for r in read_metrics(resumed) if "loss" in r]
    assert [r["step"] for r in again] == [3, 4]
    for record in again:
        assert record["loss"] == full[record["step"]]["loss"]
        assert record["grad_norm"] == full[record["step"]]["grad_norm"]
        assert record["lr"] == full[record["step"]]["lr"]


def test_checkpoints_are_complete_pruned_and_torn_ones_ignored(finished_run, tmp_path):
    """Saves every 2 steps plus the final one, each with its COMPLETE marker and per-rank trainer state; `latest`
    skips a newer directory without the marker (a save that was killed); an empty run dir resumes nothing; a path
    that is no checkpoint is an error."""
    out, _ = finished_run
    saved = checkpoint.checkpoint_dirs(out)
    assert [p.name for p in saved] == ["step_00000002", "step_00000004"]
    assert all((p / "trainer_state_rank0.pt").is_file() for p in saved)
    host = HostCollectives(SimpleNamespace(num_processes=1))
    (out / "checkpoints" / "step_00000006").mkdir()
    assert trusted_resume.choose("latest", out, host, rank=0) == saved[-1]
    (out / "checkpoints" / "step_00000006").rmdir()
    assert trusted_resume.choose("latest", tmp_path, host, rank=0) is None
    with pytest.raises(trusted_resume.CheckpointError, match="not a complete checkpoint"):
        trusted_resume.choose(str(tmp_path), tmp_path, host, rank=0)


def test_wandb_mode_follows_login(monkeypatch, tmp_path):
    """wandb runs online with credentials, offline without (no prompt, no network), and WANDB_MODE always wins."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert tracking.wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert tracking.wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracking.wandb_mode() == "disabled"


def test_schedule_and_param_groups():
    """Linear warmup to the peak, cosine down to min_lr_ratio at max_steps; one group per part with its own LR,
    matrices decayed and vectors not, frozen parts absent."""
    assert optim.lr_multiplier(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert optim.lr_multiplier(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert optim.lr_multiplier(55, 10, 100, 0.1) == pytest.approx(0.55)
    assert optim.lr_multiplier(100, 10, 100, 0.1) == pytest.approx(0.1)
    cfg = load_config(TINY, ["train.lr_vision=1e-5", "train.weight_decay=0.1", "model.freeze_merger=true"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    parts.freeze(model, {"merger": True})
    groups = {g["name"]: g for g in optim.param_groups(model, cfg.train)}
    assert set(groups) == {"vision", "vision_no_decay", "llm", "llm_no_decay"}
    assert groups["vision"]["lr"] == 1e-5 and groups["llm"]["lr"] == cfg.train.lr
    assert groups["llm"]["weight_decay"] == 0.1 and groups["llm_no_decay"]["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in groups["llm"]["params"]) and all(
        p.ndim < 2 for p in groups["llm_no_decay"]["params"]
    )
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in groups.values() for p in g["params"]} == trainable


def test_trainable_counts_count_a_tied_lm_head_once():
    """The start-up log's parameters per part add up to the model's, with the lm_head tied to the embeddings (as in
    the 3B-class recipes), where the LLM part holds that matrix twice."""
    tied = ["model.config.tie_word_embeddings=true", "model.config.text_config.tie_word_embeddings=true"]
    with torch.device("meta"):
        model = build_model(load_config(TINY, tied).model)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    counts = parts.trainable_counts(model)
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())


def test_export_loads_and_generates(finished_run):
    """The export loads with AutoModelForImageTextToText + AutoProcessor and generates from an image prompt."""
    _, summary = finished_run
    model = AutoModelForImageTextToText.from_pretrained(summary["export_dir"])
    processor = AutoProcessor.from_pretrained(summary["export_dir"])
    assert model.dtype == torch.float32  # the tiny recipe's model.dtype
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[Image.new("RGB", (112, 112), "white")], return_tensors="pt")
    assert {"pixel_values", "image_grid_thw"} <= set(inputs)
    generated = model.generate(**inputs, min_new_tokens=3, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3


def test_a_local_checkpoint_trains_from_its_own_weights_and_processor(finished_run, tmp_path, data_cache):
    """A checkpoint directory (here the export) loads through model.name_or_path like a hub id: processor and
    weights come from it, and with a vanishing lr (1e-30) the next export holds the weights it started from."""
    from safetensors.torch import load_file

    _, summary = finished_run
    start = Path(summary["export_dir"])
    second = run_train(
        tmp_path / "from-export",
        data_cache,
        f"model.name_or_path={start}",
        "model.config=null",
        "train.max_steps=1",
        "train.lr=1e-30",
        "train.warmup_steps=0",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
    )
    before = load_file(start / "model.safetensors")
    after = load_file(Path(second["export_dir"]) / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:  # parameters at 0 may move by ~lr; any other start would be off by the weights' size
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-20)


EXPORT_LOADER = """
import sys
from PIL import Image
from transformers import AutoProcessor
processor = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}]
prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(text=[prompt], images=[Image.new("RGB", (112, 112), "white")], return_tensors="pt")
print(sorted(inputs))
"""


@pytest.mark.slow
def test_export_processor_loads_without_this_repository(finished_run, tmp_path):
    """In a fresh interpreter that cannot import this repository, the exported processor (the tiny image-only one,
    shipped as custom code) loads through AutoProcessor and still turns images into pixel_values."""
    _, summary = finished_run
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", EXPORT_LOADER, str(Path(summary["export_dir"]).resolve())],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'image_grid_thw'" in result.stdout and "'pixel_values'" in result.stdout


# ----- loss normalisation and the vision tower, on hand-made packs -----


@pytest.fixture(scope="module")
def tiny_module():
    cfg = load_config(TINY)
    model = build_model(cfg.model, seed=0)
    enable_packed_forward(model)
    return step.TrainModule(model)


def text_pack(samples: list[tuple[list[int], list[int]]]) -> dict:
    """A text-only packed batch from (input_ids, shift_labels) samples, per docs/architecture.md."""
    lengths = [len(ids) for ids, _ in samples]
    ids = torch.tensor([t for s, _ in samples for t in s])[None]
    labels = torch.tensor([t for _, s in samples for t in s])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])
    return {
        "input_ids": ids,
        "position_ids": positions.expand(4, 1, -1).clone(),
        "shift_labels": labels,
        "label_rows": label_rows(labels),
        "mm_token_type_ids": torch.zeros_like(ids, dtype=torch.int32),
        "pixel_values": None,
        "image_grid_thw": None,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "seq_idx": torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None],
        "num_label_tokens": int((labels != -100).sum()),
        "num_text_tokens": sum(lengths),
        "num_image_tokens": 0,
        "num_vision_patches": 0,
        "sample_lengths": lengths,
    }


def random_sample(gen: torch.Generator, length: int, targets: int) -> tuple[list[int], list[int]]:
    ids = torch.randint(10, 2048, (length,), generator=gen)
    labels = torch.full((length,), -100)
    labels[length - 1 - targets : length - 1] = ids[length - targets :]
    return ids.tolist(), labels.tolist()


def grads_after(module: step.TrainModule, micro_batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss_sum, count = step.accumulate_gradients(Accelerator(cpu=True), module, micro_batches)
    AcceleratorState._reset_state(reset_partial_state=True)
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return (loss_sum / count).item(), grads


def test_accumulation_equals_one_big_batch(tiny_module):
    """Gradients accumulated over micro-batches with very different label counts equal the gradient of one pack
    holding all their samples: the loss is normalised by the global label count, not averaged per micro-batch."""
    gen = torch.Generator().manual_seed(0)
    a = [random_sample(gen, 40, 30), random_sample(gen, 24, 2)]
    b = [random_sample(gen, 16, 3)]
    loss_split, grads_split = grads_after(tiny_module, [text_pack(a), text_pack(b)])
    loss_whole, grads_whole = grads_after(tiny_module, [text_pack(a + b)])
    assert loss_split == pytest.approx(loss_whole, rel=1e-5)
    assert grads_split.keys() == grads_whole.keys()
    for name, grad in grads_whole.items():
        torch.testing.assert_close(grads_split[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("recipe", sorted(Path("recipes").glob("tiny-*.yaml")), ids=lambda p: p.stem)
def test_text_only_pack_runs_the_vision_tower(recipe):
    """A text-only pack still sends a dummy image through the ViT and merger(s) of every family, so every vision
    parameter gets a gradient (exactly zero) and DDP/FSDP collectives match across ranks; the loss is unchanged."""
    model = build_model(load_config(str(recipe)).model, seed=0)
    enable_packed_forward(model)
    module = step.TrainModule(model)
    gen = torch.Generator().manual_seed(1)
    batch = text_pack([random_sample(gen, 20, 8), random_sample(gen, 12, 4)])
    loss, _ = grads_after(module, [batch])
    for part in ("vision", "merger"):
        modules = parts.part_modules(module.model)[part]
        for name, param in ((n, p) for m in modules for n, p in m.named_parameters()):
            assert param.grad is not None, f"{part} parameter {name} got no gradient"
            assert torch.count_nonzero(param.grad) == 0, name
    logits = module.model(**module.model_inputs(batch), use_cache=False).logits
    expected = torch.nn.functional.cross_entropy(logits[0].float(), batch["shift_labels"][0], ignore_index=-100)
    assert loss == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_runs_twice_whatever_the_pack_holds(family):
    """Text-only, image-only, video-only and mixed packs all make exactly two vision-tower calls (images, videos;
    dummies where a pack has none), so FSDP2's per-call all-gathers line up across ranks; the loss of a mixed pack
    is unchanged by the dummies (there are none)."""
    from verification.packing_check import SampleSpec, pack_samples, synthetic_sample

    model = build_model(load_config(f"recipes/tiny-{family}.yaml").model, seed=0)
    enable_packed_forward(model)
    module = step.TrainModule(model)
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    specs = {
        "text": (SampleSpec(9),),
        "image": (SampleSpec(3, ((2, 4),)),),
        "video": (SampleSpec(3, videos=((2, 2, 4),)),),
        "both": (SampleSpec(3, ((2, 4),), videos=((3, 4, 2),)), SampleSpec(5)),
    }
    for name, spec in specs.items():
        gen = torch.Generator().manual_seed(0)
        batch = pack_samples(model, [synthetic_sample(model.config, s, gen) for s in spec])
        calls.clear()
        module(batch).backward()
        assert len(calls) == 2, name


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_one_dummy_at_most_and_the_same_training(family):
    """vision_alignment="any_call" (one process, DDP) sends a dummy image only through a pack with no vision input,
    so an image-only pack makes one call instead of two, and the loss and every gradient are exactly those of
    every_kind (two calls per pack); a text-only pack still gives every vision parameter a gradient (exactly 0),
    which AdamW steps (momentum, decay) as it did before, where a missing gradient would be skipped."""
    from verification.packing_check import SampleSpec, pack_samples, synthetic_sample

    model = build_model(load_config(f"recipes/tiny-{family}.yaml").model, seed=0)
    enable_packed_forward(model)
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    specs = {"text": ((SampleSpec(9),), 1), "image": ((SampleSpec(3, ((2, 4),)),), 1)}
    specs["both"] = ((SampleSpec(3, ((2, 4),), videos=((3, 4, 2),)), SampleSpec(5)), 2)
    for name, (spec, expected_calls) in specs.items():
        gen = torch.Generator().manual_seed(0)
        batch = pack_samples(model, [synthetic_sample(model.config, s, gen) for s in spec])
        results = []
        for alignment in ("every_kind", "any_call"):
            model.zero_grad(set_to_none=True)
            calls.clear()
            loss = step.TrainModule(model, alignment)(batch)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.detach(), grads, len(calls)))
        (aligned_loss, aligned_grads, aligned_calls), (loss, grads, n_calls) = results
        assert (aligned_calls, n_calls) == (2, expected_calls), name
        assert torch.equal(loss, aligned_loss), name
        assert grads.keys() == aligned_grads.keys(), name
        for param_name, grad in grads.items():
            assert torch.equal(grad, aligned_grads[param_name]), (name, param_name)


# ----- MFU: the FLOP formula against a hand count -----


def test_pack_flops_matches_hand_count():
    """pack_flops on the tiny Qwen2.5-VL equals a hand count from its dimensions: 6·N per token for the decoder
    layers, 6·V·H per labelled row for the lm_head (tied or not), 6·N per patch for the ViT (merger per merged token),
    per-document attention 3·4·H·d·sᵢ² (Σ sᵢ², not T²), and ViT attention 3·4·H·d over full frames and over its
    2×2-merged-token windows."""
    cfg = load_config(TINY)
    with torch.device("meta"):
        model = build_model(cfg.model)
    text, vision = cfg.model.config["text_config"], cfg.model.config["vision_config"]
    h, inter, layers, vocab = (
        text["hidden_size"],
        text["intermediate_size"],
        text["num_hidden_layers"],
        text["vocab_size"],
    )
    kv_width = text["num_key_value_heads"] * h // text["num_attention_heads"]
    n_llm = layers * (2 * h * h + 2 * h * kv_width + 3 * h * inter)
    vw, vi, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    patch_dim = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    n_vit = vw * patch_dim + depth * (3 * vw * vw + vw * vw + 3 * vw * vi)
    merged_dim = vw * vision["spatial_merge_size"] ** 2
    n_merger = merged_dim * merged_dim + merged_dim * vision["out_hidden_size"]

    lengths, grid, labels = [10, 20], (1, 8, 12), 7  # 96 patches = 24 merged tokens in a 4x6 grid → 2x2 windows
    patches, merged = 96, 24
    window_pairs = (2 * 2 + 2 * 2) * (2 * 2 + 2 * 2 + 2 * 2) * 2**4  # Σa² · Σb² · m⁴
    full_layers = len(vision["fullatt_block_indexes"])
    expected = (
        6 * n_llm * sum(lengths)
        + 6 * vocab * h * labels
        + 3 * 4 * h * (10**2 + 20**2) * layers
        + 6 * n_vit * patches
        + 6 * n_merger * merged
        + 3 * 4 * vw * patches**2 * full_layers
        + 3 * 4 * vw * window_pairs * (depth - full_layers)
    )
    profile = metrics.FlopProfile.from_model(model)
    assert metrics.pack_flops(profile, lengths, [grid], labels) == pytest.approx(expected, rel=1e-12)

    with torch.device("meta"):
        tied = build_model(load_config(TINY, ["model.config.tie_word_embeddings=true"]).model)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    assert metrics.FlopProfile.from_model(tied) == profile

    parts.freeze(model, {"vision": True, "merger": True})  # frozen ViT: forward only; LLM: no weight gradients...
    frozen = metrics.FlopProfile.from_model(model)  # ...but the LLM still trains here, so it keeps 3x
    vit_terms = 6 * n_vit * patches + 6 * n_merger * merged
    vit_attn = 3 * 4 * vw * (patches**2 * full_layers + window_pairs * (depth - full_layers))
    frozen_expected = expected - (vit_terms + vit_attn) * 2 / 3
    assert metrics.pack_flops(frozen, lengths, [grid], labels) == pytest.approx(frozen_expected)


def test_peak_flops_table_and_override():
    """The override wins; CPUs have no peak (MFU not reported)."""
    assert metrics.peak_flops(torch.device("cpu")) is None
    assert metrics.peak_flops(torch.device("cpu"), override_tflops=100.0) == 100e12


@pytest.mark.gpu
def test_gpu_run_with_fused_rope_reports_mfu(data_cache, tmp_path):
    """On a GPU the tiny model trains in bf16 autocast with the fused rope kernels, and the summary reports MFU
    (the device is in the peak table or logging.peak_tflops is set) and peak memory."""
    summary = run_train(
        tmp_path / "gpu",
        data_cache,
        "kernels.mrope=fused",
        "model.dtype=bfloat16",
        "train.max_steps=6",
        "logging.timing_warmup_steps=2",
        "logging.peak_tflops=989",
        "checkpoint.export=false",
    )
    assert summary["fused_rope"] and summary["mfu"] is not None and summary["mfu"] > 0
    assert summary["peak_mem_gib"] > 0 and summary["loss_end"] < summary["loss_start"]


def test_non_finite_loss_stops_without_saving_nan_weights(data_cache, tmp_path, monkeypatch):
    """A non-finite loss at step 3 stops the run with a one-line error (non-zero exit status) naming the step: no
    checkpoint after step 2 and no export, and metrics.jsonl stays strict JSON with no record of the bad step."""
    original = loop.optimizer_step
    calls = []

    def poisoned_step(accelerator, module, *args):
        calls.append(1)
        loss_sum, label_count, grad_norm = original(accelerator, module, *args)
        if len(calls) == 3:
            with torch.no_grad():
                next(module.parameters()).fill_(float("nan"))
            loss_sum = loss_sum * float("nan")
        return loss_sum, label_count, grad_norm

    monkeypatch.setattr(loop, "optimizer_step", poisoned_step)
    out = tmp_path / "nan"
    try:
        message = train.cli(["--config", TINY, *run_args(out, data_cache)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert isinstance(message, str) and "non-finite at step 3" in message and "\n" not in message
    assert [p.name for p in checkpoint.checkpoint_dirs(out)] == ["step_00000002"]
    assert not (out / "final").exists() and not (out / "summary.json").exists()

    def refuse(token):
        raise ValueError(f"invalid JSON token {token}")

    records = [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 2


def copy_run_until(run_dir: Path, step: int, to: Path) -> Path:
    """A copy of a finished run's directory as a kill just before the checkpoint after `step` would leave it:
    config.yaml, every metrics line (steps after `step` included), checkpoints up to `step`, no export, no summary."""
    to.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run_dir / name, to / name)
    for saved in checkpoint.checkpoint_dirs(run_dir):
        if int(saved.name.removeprefix("step_")) <= step:
            shutil.copytree(saved, to / "checkpoints" / saved.name)
    return to


def test_resume_logs_each_step_once_and_summarizes_the_whole_run(finished_run, data_cache, tmp_path):
    """After a kill between checkpoints, --resume truncates metrics.jsonl to the checkpoint's step, so every step
    is logged once with the uninterrupted run's loss, and summary.json describes the whole run (its first loss, its
    step count, timed steps of both launches), not only the resumed launch."""
    out, full_summary = finished_run
    resumed = copy_run_until(out, 2, tmp_path / "resumed")
    summary = run_train(resumed, data_cache, "checkpoint.keep_last=2", resume=True)
    full = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    records = [r for r in read_metrics(resumed) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == [full[step]["loss"] for step in (1, 2, 3, 4)]
    assert summary["loss_start"] == full_summary["loss_start"] and summary["loss_end"] == full_summary["loss_end"]
    assert summary["steps"] == 4 and summary["timed_steps"] == 1 + 1  # step 2 (launch 1) + step 4 (launch 2)
    assert json.loads((resumed / "summary.json").read_text()) == summary


# Libraries a CPU run without generation has no use for: the scoring libraries (inference/scoring.py) and inductor's
# lowering tables (modeling/eager_reductions.py, read only when blocks compile)
UNUSED_ON_A_CPU_RUN = ("rouge_score", "sacrebleu", "nltk", "modeling.eager_reductions", "torch._inductor.lowering")


def launch_train(*args: str) -> tuple[str, list[str]]:
    """train.py launched in a fresh process with `args`: (its output, stdout then stderr; the UNUSED_ON_A_CPU_RUN
    modules it imported). Fails the test unless it exits 0."""
    command = [sys.executable, "-c", LAUNCH_REPORTING_IMPORTS.format(names=UNUSED_ON_A_CPU_RUN), *args]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    result = subprocess.run(command, cwd=Path(train.__file__).parent, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    reported = [line.split()[1:] for line in result.stderr.splitlines() if line.startswith("imported:")]
    assert len(reported) == 1, result.stderr[-3000:]
    return output, reported[0]


def test_train_py_speaks_in_its_own_format_and_imports_only_what_the_run_uses(finished_run, data_cache, tmp_path):
    """train.py, launched as a user launches it, logs on the main process in its own format (the message alone): what
    each `auto` setting resolved to, the checkpoint it resumed from, the export, and, relaunched on the finished run,
    that there is nothing left to do; no library's handler or format takes its log over (nothing configures logging
    when imported). A CPU run without generation imports no scoring library and no inductor lowering."""
    out, _ = finished_run
    resumed = copy_run_until(out, 2, tmp_path / "resumed")
    args = ["--config", TINY, *run_args(resumed, data_cache), "--resume"]
    output, imported = launch_train(*args)
    lines = output.splitlines()
    assert "train.compile=auto -> false (no CUDA)" in lines, output[-3000:]
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000002'} at step 2" in lines, output[-3000:]
    assert f"exported {resumed / 'final'}" in lines, output[-3000:]
    assert not [line for line in lines if re.match(r"(DEBUG|INFO|WARNING|ERROR):[\w.]+:", line)], output[-3000:]
    assert imported == [], imported
    output, _ = launch_train(*args)
    assert f"{resumed} already reached train.max_steps=4; raise it to train further" in output.splitlines(), output


def test_changed_config_on_resume_is_refused_or_used_and_recorded(finished_run, data_cache, tmp_path):
    """--resume with a setting that breaks exactness (train.lr, packing.max_tokens) is a ConfigError naming the
    keys and the --allow-config-change flag; config.yaml is never overwritten; with the flag the new lr is what the
    optimizer uses and what metrics.jsonl logs, recorded in config.resume-step<N>.yaml; a logging-only change passes."""
    out, _ = finished_run
    resumed = copy_run_until(out, 2, tmp_path / "changed")
    original_config = (resumed / "config.yaml").read_text()
    with pytest.raises(
        ConfigError, match=r"packing.max_tokens 512 -> 1024, train.lr 0.001 -> 0.002.*--allow-config-change"
    ):
        run_train(resumed, data_cache, "train.lr=0.002", "packing.max_tokens=1024", resume=True)
    args = ["--config", TINY, *run_args(resumed, data_cache, "train.lr=0.002"), "--resume", "--allow-config-change"]
    try:
        train.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert (resumed / "config.yaml").read_text() == original_config
    assert load_config(str(resumed / "config.resume-step00000002.yaml")).train.lr == 0.002
    full = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    again = {r["step"]: r for r in read_metrics(resumed) if "loss" in r}
    assert again[3]["lr"] == pytest.approx(2 * full[3]["lr"], rel=1e-12)
    quiet = copy_run_until(out, 2, tmp_path / "quiet")
    assert run_train(quiet, data_cache, "logging.every_steps=2", "checkpoint.export=false", resume=True)["steps"] == 4
    assert load_config(str(quiet / "config.resume-step00000002.yaml")).logging.every_steps == 2


KILL_DURING = {
    # accelerate has written the model and optimizer of the final checkpoint, not yet its trainer state or marker
    "checkpoint": "from lifecycle import checkpoint as target\n"
    "original = target.Checkpointer.save\n"
    "def patched(self, step, *args):\n"
    "    if step == 4:\n"
    "        self.accelerator.save_state(str(self.run_dir / 'checkpoints' / 'step_00000004'))\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return original(self, step, *args)\n"
    "target.Checkpointer.save = patched\n",
    # the export's weights are written, its processor not yet
    "export": "import transformers\n"
    "def patched(*args, **kwargs):\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "transformers.ProcessorMixin.save_pretrained = patched\n",
}


@pytest.mark.parametrize("moment", sorted(KILL_DURING))
@pytest.mark.slow
def test_kill_9_then_resume_ends_with_the_uninterrupted_weights(finished_run, data_cache, tmp_path, moment):
    """A run killed with SIGKILL during its last checkpoint write, or during its export, and relaunched with
    --resume ends complete (export loadable, summary.json of 4 steps, each step logged once) with exactly the final
    weights of an uninterrupted run."""
    from safetensors.torch import load_file

    out, full_summary = finished_run
    killed = tmp_path / moment
    child = (
        "import os, signal, sys\n"
        + KILL_DURING[moment]
        + "import train\n"
        + f"sys.exit(train.cli({['--config', TINY, *run_args(killed, data_cache)]!r}))\n"
    )
    process = subprocess.run([sys.executable, "-c", child], cwd=Path(train.__file__).parent, capture_output=True)
    assert process.returncode == -9, process.stderr.decode()[-2000:]
    assert not (killed / "final").exists() and not (killed / "summary.json").exists()
    summary = run_train(killed, data_cache, resume=True)
    assert summary["steps"] == 4 and summary["loss_start"] == full_summary["loss_start"]
    assert [r["step"] for r in read_metrics(killed) if "loss" in r] == [1, 2, 3, 4]
    expected = load_file(out / "final" / "model.safetensors")
    exported = load_file(killed / "final" / "model.safetensors")
    assert expected.keys() == exported.keys()
    assert all(torch.equal(expected[k], exported[k]) for k in expected)
    assert AutoProcessor.from_pretrained(killed / "final", trust_remote_code=True) is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.seed=-1"], r"config error: train.seed must be in \[0, 2\*\*32\)"),
        (["model.config=null", "model.name_or_path=/no/such/model"], "model.name_or_path=/no/such/model is not a"),
        (["model.config=null", "model.name_or_path=./no-model"], "model.name_or_path=./no-model is not a directory"),
        (["data.path=no/such/train.jsonl"], "data.path no/such/train.jsonl does not exist"),
        (["train.output_dir={file}/run"], "train.output_dir=.*/a-file/run cannot be created"),
        (["data.path={file}.json"], r"data error: data.path .*a-file.json is not valid JSON"),
    ],
)
def test_user_mistakes_are_one_line_errors(overrides, message, data_cache, tmp_path):
    """A bad seed, a model path or relative data path that does not exist (answered at once, without the Hub), an
    output directory that cannot be made and a broken JSON data file each end train.py with one line naming the key
    or file, not a traceback."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-file.json").write_text('[{"id": 1},')
    overrides = [o.format(file=tmp_path / "a-file") for o in overrides]
    try:
        result = train.cli(["--config", TINY, *run_args(tmp_path / "run", data_cache), *overrides])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert isinstance(result, str) and "\n" not in result
    assert re.search(message, result), result


@pytest.mark.slow
def test_sigusr1_prints_every_threads_stack_and_the_run_goes_on(data_cache, tmp_path):
    """`kill -USR1` on a train.py process dumps its threads' Python stacks to stderr (the diagnosis of a run that
    stopped making progress) and the run still finishes; so does the signal to its loader workers' forkserver and
    the workers it forked, whose stacks show torch's worker loop."""
    import psutil

    args = run_args(tmp_path / "run", data_cache, "checkpoint.export=false", "train.max_steps=12", "data.num_workers=2")
    process = subprocess.Popen(
        [sys.executable, "train.py", "--config", TINY, *args],
        cwd=Path(train.__file__).parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics_file.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # training has started: the handler is in place, the epoch's workers are up
    workers = forkserver_processes(process.pid)
    process.send_signal(signal.SIGUSR1)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended since listed (a finished eval pass's worker)
            worker.send_signal(signal.SIGUSR1)
    stderr = process.communicate(timeout=300)[1]
    assert process.returncode == 0, stderr[-2000:]
    assert "Thread 0x" in stderr and 'File "' in stderr
    assert len(workers) > 1 and "_worker_loop" in stderr, stderr[-2000:]


@pytest.mark.slow
def test_inspect_data_config_error_is_one_line():
    """`python -m scripts.inspect_data` answers a config mistake with one line and exit status 1, like train.py."""
    process = subprocess.run(
        [sys.executable, "-m", "scripts.inspect_data", "--config", TINY, "train.seed=-1"],
        cwd=Path(train.__file__).parent,
        capture_output=True,
        text=True,
    )
    assert process.returncode == 1
    assert process.stderr.strip().splitlines() == ["config error: train.seed must be in [0, 2**32), got -1."]


def test_fused_rope_without_triton_says_it_runs_the_reference(data_cache, tmp_path, monkeypatch, caplog):
    """kernels.mrope=fused on a CPU without TRITON_INTERPRET runs the PyTorch reference: the log warns so and the
    summary's fused_rope is false, instead of claiming the Triton kernels ran."""
    from mrope_kernels import triton_rope

    monkeypatch.setattr(triton_rope, "RUNS_IN_INTERPRETER", False)
    with caplog.at_level(logging.INFO):
        summary = run_train(
            tmp_path / "ref", data_cache, "kernels.mrope=fused", "train.max_steps=1", "train.eval_every=0"
        )
    assert summary["fused_rope"] is False
    assert "plain-PyTorch reference, not the Triton kernels" in caplog.text
    assert "rope: reference (fused ops, PyTorch math)" in caplog.text


def test_dummy_vision_calls_per_alignment(tiny_model):
    """The dummy images a pack sends: alone or under DDP only when it has no vision input at all; under FSDP2 one
    per kind that some rank of the micro-step holds and this pack lacks (every kind without the step's flags), and
    one when no rank holds any; every_kind fills both kinds always."""
    model = tiny_model("qwen2_5_vl")
    image, video, none = {"pixel_values": 1}, {"pixel_values_videos": 1}, {}
    expect = {
        "any_call": [(image, None, 0), (video, None, 0), (none, None, 1)],
        "every_kind": [(image, (True, False), 1), (none, (False, False), 2), ({**image, **video}, None, 0)],
        "step_kinds": [
            (image, (True, False), 0),
            (image, (True, True), 1),
            (none, (True, False), 1),
            (none, (False, False), 1),
            (video, (True, True), 1),
            (none, None, 2),
        ],
    }
    for alignment, cases in expect.items():
        module = step.TrainModule(model, alignment)
        for batch, flags, calls in cases:
            batch = batch if flags is None else {**batch, STEP_VISION: flags}
            assert module.dummy_vision_calls(batch) == calls, (alignment, batch)
