"""Context parallelism over two processes (gloo on CPU): CP=2 trains exactly what CP=1 trains.

- Model level, every family (the Qwen3.5 ones with their Gated DeltaNet layers on the torch path): the two ranks'
  losses and gradients (summed over the context group, as DDP's average times the world size does) and their logits
  equal one process's on the same pack, in fp32; for Qwen2.5-VL also under FSDP2 (torch's fully_shard per layer, as
  accelerate's FSDP2 path wraps).
- Training level (Qwen2.5-VL and Qwen3.5): `accelerate launch` with two processes and parallel.context=2 logs the
  same loss and gradient norm per step as one process on the same packs (the loss normalisation and DDP's averaging
  over context ranks).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.test_distributed import ROOT, launch, run_processes, step_records, write_mixed_dataset

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")

# Samples of odd lengths (none a multiple of 2·CP = 4, so every one is padded): images at a sample's start, middle
# and end, a text-only sample, a one-token sample, and a video.
WORKER = """
import dataclasses, json, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from training.config import load_config
from training.modeling import build_model
from training.packed import PACK_KWARG, enable_packed_forward
from training.step import TrainModule
from training import context_parallel
from verification.packing_check import GRAD_SCALE_FLOOR, SampleSpec, pack_samples, synthetic_sample

dist.init_process_group("gloo")
rank = dist.get_rank()
group = context_parallel.new_context_group(2, 2)
SPECS = [
    SampleSpec(0, ((4, 4),), text_after=9),
    SampleSpec(37),
    SampleSpec(1),
    SampleSpec(3, ((2, 4), (4, 2)), text_between=3),
    SampleSpec(5, videos=((2, 4, 4),), text_after=2),
    SampleSpec(2, ((4, 4),), text_after=0),
]

def module_for(family):
    model_cfg = load_config(f"{root}/recipes/tiny-{{family}}.yaml", ["model.dtype=float32"]).model
    model = build_model(model_cfg, seed=0)
    enable_packed_forward(model)
    return TrainModule(model)

def relative(a, b, floor=1e-30):
    return ((a - b).abs().max() / b.abs().max().clamp(min=floor)).item()

for family in {families!r}:
    reference = module_for(family)
    generator = torch.Generator().manual_seed(0)
    samples = [synthetic_sample(reference.model.config, spec, generator) for spec in SPECS]
    batch = pack_samples(reference.model, samples)
    loss = reference(batch)
    loss.backward()
    with torch.no_grad():
        logits = reference.model(**reference.model_inputs(batch), use_cache=False).logits[0]

    sharded = module_for(family)
    context_parallel.enable_context_parallel(sharded.model, group, PACK_KWARG)
    merge = sharded.model.config.vision_config.spatial_merge_size
    shard = context_parallel.shard_pack(batch, rank, 2, pad_token_id=0, spatial_merge_size=merge)
    local_loss = sharded(shard)
    local_loss.backward()
    with torch.no_grad():
        local_logits = sharded.model(**sharded.model_inputs(shard), use_cache=False).logits[0]
    # logits of this rank's real tokens against the reference's rows of the same tokens
    lengths, padded = batch["sample_lengths"], [-(-n // 4) * 4 for n in batch["sample_lengths"]]
    original = torch.full((sum(padded),), -1, dtype=torch.long)
    start, padded_start = 0, 0
    for n, p in zip(lengths, padded):
        original[padded_start : padded_start + n] = torch.arange(start, start + n)
        start, padded_start = start + n, padded_start + p
    mine = original[shard["cp_local_index"]]
    real = mine >= 0
    logits_error = relative(local_logits[real], logits[mine[real]])

    total = local_loss.detach().clone()
    dist.all_reduce(total, group=group)
    expected = dict(reference.named_parameters())
    # a near-cancelling gradient (Gated DeltaNet's A_log, dt_bias) is judged against the model's gradient scale
    floor = GRAD_SCALE_FLOOR * max(p.grad.abs().max() for p in expected.values() if p.grad is not None)
    grad_error, missing = 0.0, []
    for name, parameter in sharded.named_parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        dist.all_reduce(grad, group=group)
        if expected[name].grad is None:
            missing.append(name)
            continue
        grad_error = max(grad_error, relative(grad, expected[name].grad, floor))
    fsdp2_error = None
    if family == "qwen2_5_vl":  # FSDP2 over both ranks (which are also the context group): per-layer shards
        fsdp = module_for(family)
        context_parallel.enable_context_parallel(fsdp.model, group, PACK_KWARG)
        for unit in [m for m in fsdp.modules() if type(m).__name__ in fsdp._no_split_modules]:
            fully_shard(unit)
        fully_shard(fsdp)
        (fsdp(shard) * 2).backward()  # FSDP averages over the 2 ranks: x2 turns it into the context group's sum
        fsdp2_error = max(
            relative(p.grad.full_tensor(), expected[name].grad) for name, p in fsdp.named_parameters()
        )
    report = dict(
        fsdp2_error=fsdp2_error,
        family=family,
        rank=rank,
        loss=total.item(),
        expected_loss=loss.item(),
        grad_error=grad_error,
        logits_error=logits_error,
        real_tokens=int(real.sum()),
        tokens=sum(lengths),
        missing=missing,
        local_images=0 if shard["pixel_values"] is None else len(shard["cp_image_grid_thw"]),
        local_videos=0 if shard["pixel_values_videos"] is None else len(shard["cp_video_grid_thw"]),
    )
    print("RESULT " + json.dumps(report), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def model_results(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("context_parallel")
    worker = directory / "cp_worker.py"
    worker.write_text(WORKER.format(root=str(ROOT), families=FAMILIES))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    output = run_processes(command, directory / "cp.log", "context-parallel worker")
    return [json.loads(match) for match in re.findall(r"RESULT (\{[^{}]*\})", output)]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_context_parallel_equals_one_process_per_family(model_results, family):
    """CP=2 on two ranks equals CP=1 on the same pack (images, a video, odd sample lengths): the summed loss and
    every parameter's gradient summed over the context group within 1e-5 relative, and every real token's logits;
    the two ranks' real tokens are the pack's tokens, each once. The vision tower really is sharded: each rank
    encodes two of the four images, rank 0 the video and rank 1 a dummy in its place. Qwen3.5's Gated DeltaNet
    layers (gathered input, whole padded pack on every rank) included. A gradient's scale is at least
    GRAD_SCALE_FLOOR of the model's largest: A_log's and dt_bias's are near-cancelling sums that carry the fp32
    delta rule's rounding (~1e-5 of their own size here; with the delta rule computed in fp64, ~1e-7)."""
    results = sorted((r for r in model_results if r["family"] == family), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    assert [(r["local_images"], r["local_videos"]) for r in results] == [(2, 1), (2, 0)]
    assert sum(r["real_tokens"] for r in results) == results[0]["tokens"]
    for result in results:
        assert not result["missing"]
        assert result["loss"] == pytest.approx(result["expected_loss"], rel=1e-5)
        assert result["grad_error"] < 1e-5, f"rank {result['rank']}: gradient error {result['grad_error']}"
        assert result["logits_error"] < 1e-5, f"rank {result['rank']}: logits error {result['logits_error']}"
        if family == "qwen2_5_vl":  # the same step under FSDP2 (per-layer shards over both ranks)
            assert result["fsdp2_error"] < 1e-5, f"rank {result['rank']}: FSDP2 error {result['fsdp2_error']}"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_training_with_context_parallel_matches_one_process(tmp_path, family):
    """`accelerate launch` of two processes with parallel.context=2 (one data-parallel rank) logs the loss and
    gradient norm of one process training the same packs, step by step: the label count is summed over the context
    group and DDP's average over both ranks is turned back into the sum of their shares, Gated DeltaNet parameters
    (each rank's gradient from its own rows of the whole-pack layer) included."""
    data, cache = write_mixed_dataset(tmp_path / "data"), tmp_path / "cache"
    # Some packs are text only: one process and both ranks send a dummy image through the tower there, so the
    # vision parameters get zero gradients (which AdamW steps) in both runs alike (training/step.py).
    common = ["packing.balance_window_steps=1", "checkpoint.export=false", "checkpoint.every_steps=0"]
    recipe = f"recipes/tiny-{family}.yaml"
    context = launch(2, tmp_path / "cp2", data, cache, *common, "parallel.context=2", recipe=recipe)
    launch(1, tmp_path / "cp1", data, cache, *common, recipe=recipe)
    assert context["num_processes"] == 2
    cp2, cp1 = step_records(tmp_path / "cp2"), step_records(tmp_path / "cp1")
    assert sorted(cp2) == sorted(cp1)
    for step in cp2:
        assert cp2[step]["loss"] == pytest.approx(cp1[step]["loss"], rel=1e-5), f"loss at step {step}"
        assert cp2[step]["grad_norm"] == pytest.approx(cp1[step]["grad_norm"], rel=1e-5), f"grad norm at {step}"
        assert cp2[step]["tokens_per_s_per_gpu"] > 0


@pytest.mark.slow
def test_data_and_context_parallel_together_match_one_process(tmp_path):
    """Four processes, parallel.context=2: two data-parallel groups of two context ranks each get their own pack
    (dealt by rank // 2) and train exactly what one process accumulating both packs trains (loss normalised by the
    global label count, DDP averaging over all four ranks)."""
    data, cache = write_mixed_dataset(tmp_path / "data"), tmp_path / "cache"
    # collated inline: four ranks' DataLoader workers on a 2-core CI host have been seen to stall the run's exit
    common = ["checkpoint.export=false", "checkpoint.every_steps=0", "data.num_workers=0"]
    launch(4, tmp_path / "dp2cp2", data, cache, *common, "packing.balance_window_steps=1", "parallel.context=2")
    launch(1, tmp_path / "one", data, cache, *common, "packing.balance_window_steps=2", "train.grad_accum_steps=2")
    both, one = step_records(tmp_path / "dp2cp2"), step_records(tmp_path / "one")
    assert sorted(both) == sorted(one)
    for step in both:
        assert both[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), f"loss at step {step}"
        assert both[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-5), f"grad norm at {step}"
