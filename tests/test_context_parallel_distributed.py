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
from pathlib import Path

import pytest

from core.families import MODEL_TYPES
from tests.test_distributed import (
    ROOT,
    WORKER_EXIT,
    assert_same_steps,
    launch,
    run_processes,
    step_records,
    write_mixed_dataset,
)

pytestmark = pytest.mark.slow  # the slow tier: `make test-all`

FAMILIES = MODEL_TYPES  # every family of the registry, so a new one cannot be missed

# Samples of odd lengths (none a multiple of 2·CP = 4, so every one is padded): images at a sample's start, middle
# and end, a text-only sample, a one-token sample, and a video.
WORKER = """
import json, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from core.config import load_config
from modeling.build import build_model
from modeling.packed import PACK_KWARG, enable_packed_forward
from trainer.step import TrainModule, to_device
from modeling import context_parallel
from verification.packing_check import GRAD_SCALE_FLOOR, SampleSpec, ieee_fp32, pack_samples, synthetic_sample

CUDA = {cuda!r}
dist.init_process_group("nccl" if CUDA else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
if CUDA:
    torch.cuda.set_device(device)
group = context_parallel.new_context_group(2, 2)
SPECS = [
    SampleSpec(0, ((4, 4),), text_after=9),
    SampleSpec(37),
    SampleSpec(1),
    SampleSpec(3, ((2, 4), (4, 2)), text_between=3),
    SampleSpec(5, videos=((2, 4, 4),), text_after=2),
    SampleSpec(2, ((4, 4),), text_after=0),
]

def module_for(family, on=device):
    model_cfg = load_config(f"{root}/recipes/tiny-{{family}}.yaml", ["model.dtype=float32"]).model
    model = build_model(model_cfg, seed=0).to(on)
    enable_packed_forward(model, "torch")
    return TrainModule(model).to(on)  # its dummy image buffers too

def precision(name):
    # bf16 as training computes it: fp32 weights under a bf16 autocast; fp32 in IEEE (no TF32 anywhere)
    return torch.autocast(device.type, dtype=torch.bfloat16) if name == "bf16" else ieee_fp32()

def relative(a, b, floor=1e-30):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=floor)).item()

def step(module, batch, name):
    # one training step's loss and gradients, and the logits of the same batch
    with precision(name):
        loss = module(to_device(batch, device))
        loss.backward()
        with torch.no_grad():
            logits = module.model(**module.model_inputs(to_device(batch, device)), use_cache=False).logits[0]
    return loss.detach().float(), logits.float()

def one_process(family, batch, name):
    module = module_for(family)
    loss, logits = step(module, batch, name)
    return loss, {{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}, logits

def context_parallel_run(family, shard, name):
    module = module_for(family)
    context_parallel.enable_context_parallel(module.model, group, PACK_KWARG)
    loss, logits = step(module, shard, name)
    dist.all_reduce(loss, group=group)
    grads = {{}}
    for n, p in module.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group)
        grads[n] = grad
    return loss, grads, logits

def errors(run, expected, rows, expected_rows):
    # relative errors of a run's loss, gradients and logits (its `rows` against the reference's `expected_rows`);
    # a near-cancelling gradient (Gated DeltaNet's A_log, dt_bias) is judged against the model's gradient scale
    loss, grads, logits = run
    floor = GRAD_SCALE_FLOOR * max(g.abs().max() for g in expected[1].values())
    grad_errors = {{n: relative(grads[n], g, floor) for n, g in expected[1].items()}}
    return dict(
        loss=relative(loss, expected[0]),
        grads=grad_errors,
        logits=relative(logits[rows], expected[2][expected_rows]),
    )

for family in {families!r}:
    generator = torch.Generator().manual_seed(0)
    probe = module_for(family, torch.device("cpu")).model
    samples = [synthetic_sample(probe.config, spec, generator) for spec in SPECS]
    batch = pack_samples(probe, samples)
    merge = probe.config.vision_config.spatial_merge_size
    shard = context_parallel.shard_pack(batch, rank, 2, pad_token_id=0, spatial_merge_size=merge)
    # this rank's real tokens and their rows in the whole pack
    lengths, padded = batch["sample_lengths"], [-(-n // 4) * 4 for n in batch["sample_lengths"]]
    original = torch.full((sum(padded),), -1, dtype=torch.long)
    start, padded_start = 0, 0
    for n, p in zip(lengths, padded):
        original[padded_start : padded_start + n] = torch.arange(start, start + n)
        start, padded_start = start + n, padded_start + p
    mine = original[shard["cp_local_index"]].to(device)
    real = mine >= 0

    reference = one_process(family, batch, "fp32")
    sharded = context_parallel_run(family, shard, "fp32")
    fp32 = errors(sharded, reference, real, mine[real])
    fsdp2_error = None
    if family == "qwen2_5_vl":  # FSDP2 over both ranks (which are also the context group): per-layer shards
        fsdp = module_for(family)
        context_parallel.enable_context_parallel(fsdp.model, group, PACK_KWARG)
        for unit in [m for m in fsdp.modules() if type(m).__name__ in fsdp._no_split_modules]:
            fully_shard(unit)
        fully_shard(fsdp)
        with ieee_fp32():
            (fsdp(to_device(shard, device)) * 2).backward()  # FSDP averages over the 2 ranks: x2 gives the sum
        fsdp2_error = max(relative(p.grad.full_tensor(), reference[1][n]) for n, p in fsdp.named_parameters())
    report = dict(
        family=family,
        rank=rank,
        loss=sharded[0].item(),
        expected_loss=reference[0].item(),
        grad_error=max(fp32["grads"].values()),
        logits_error=fp32["logits"],
        fsdp2_error=fsdp2_error,
        real_tokens=int(real.sum()),
        tokens=sum(lengths),
        missing=sorted(set(sharded[1]) - set(reference[1])),
        local_images=0 if shard["pixel_values"] is None else len(shard["cp_image_grid_thw"]),
        local_videos=0 if shard["pixel_values_videos"] is None else len(shard["cp_video_grid_thw"]),
    )
    if {bf16!r} and "moe" not in family:  # MoE: see test_context_parallel_equals_one_gpu_per_family_on_two_gpus
        # bf16: each quantity's error against the fp32 one-process run, context parallel vs one process
        cp2 = errors(context_parallel_run(family, shard, "bf16"), reference, real, mine[real])
        one = errors(one_process(family, batch, "bf16"), reference, mine[real], mine[real])
        own = dict(loss=one["loss"], logits=one["logits"], **one["grads"])
        got = dict(loss=cp2["loss"], logits=cp2["logits"], **cp2["grads"])
        worst = max(got, key=lambda q: got[q] / max(own[q], 1e-3))
        report["bf16_worst"] = dict(quantity=worst, error=got[worst], one_process_error=own[worst])
    print("RESULT " + json.dumps(report), flush=True)
"""


def run_worker(directory: Path, cuda: bool, bf16: bool) -> list[dict]:
    """Run the worker on two processes (gloo on CPU, NCCL on two GPUs); every rank's RESULT records."""
    worker = directory / "cp_worker.py"
    worker.write_text(WORKER.format(root=str(ROOT), families=FAMILIES, cuda=cuda, bf16=bf16) + WORKER_EXIT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    output = run_processes(command, directory / "cp.log", "context-parallel worker")
    decoder = json.JSONDecoder()  # records of both ranks may share a line
    return [decoder.raw_decode(output, match.end())[0] for match in re.finditer("RESULT ", output)]


@pytest.fixture(scope="module")
def model_results(tmp_path_factory) -> list[dict]:
    return run_worker(tmp_path_factory.mktemp("context_parallel"), cuda=False, bf16=False)


def check_fp32(results: list[dict], family: str) -> None:
    """CP=2's summed loss, gradients and real tokens' logits equal one process's within 1e-5 relative, and the
    ranks really share the pack: each holds its dealt images (two each; rank 0 the video, rank 1 a dummy in its
    place) and the two ranks' real tokens are the pack's tokens, each once."""
    results = sorted((r for r in results if r["family"] == family), key=lambda r: r["rank"])
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
@pytest.mark.parametrize("family", FAMILIES)
def test_context_parallel_equals_one_process_per_family(model_results, family):
    """CP=2 on two ranks equals CP=1 on the same pack (images, a video, odd sample lengths): the summed loss and
    every parameter's gradient summed over the context group within 1e-5 relative, and every real token's logits;
    the two ranks' real tokens are the pack's tokens, each once. The vision tower really is sharded: each rank
    encodes two of the four images, rank 0 the video and rank 1 a dummy in its place. Qwen3.5's Gated DeltaNet
    layers (gathered input, whole padded pack on every rank) included. A gradient's scale is at least
    GRAD_SCALE_FLOOR of the model's largest: A_log's and dt_bias's are near-cancelling sums that carry the fp32
    delta rule's rounding (~1e-5 of their own size here; with the delta rule computed in fp64, ~1e-7)."""
    check_fp32(model_results, family)


@pytest.mark.gpu
def test_context_parallel_equals_one_gpu_per_family_on_two_gpus(tmp_path, monkeypatch):
    """The same worker on two GPUs over NCCL: fp32 (IEEE, no TF32) within 1e-5 for every family as on the CPU, and
    bf16 as training computes it (fp32 weights, bf16 autocast, the varlen kernel): CP=2's error of every quantity
    (loss, logits, each parameter's gradient) against the fp32 run is within ROUNDING_FACTOR of one GPU's own bf16
    error (at least 1e-3), the repo's rounding rule. MoE families are held to fp32 only: in bf16 a router choice may
    flip between any two runs whose sums round differently, which is not a context-parallel effect."""
    import torch

    from core.distributed import SAFE_COLLECTIVES_ENV
    from verification.packing_check import ROUNDING_FACTOR

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    for key, value in SAFE_COLLECTIVES_ENV.items():
        monkeypatch.setenv(key, value)
    results = run_worker(tmp_path, cuda=True, bf16=True)
    for family in FAMILIES:
        check_fp32(results, family)
    dense = [r for r in results if "moe" not in r["family"]]
    assert len(dense) == 8
    for result in dense:
        worst = result["bf16_worst"]
        allowed = ROUNDING_FACTOR * max(worst["one_process_error"], 1e-3)
        assert worst["error"] <= allowed, f"{result['family']} rank {result['rank']} bf16: {worst}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, layout", [("qwen2_5_vl", "ddp"), ("qwen3_5", "ddp"), ("qwen2_5_vl", "fsdp2")], ids="-".join
)
def test_training_with_context_parallel_matches_one_process(tmp_path, family, layout):
    """`accelerate launch` of two processes with parallel.context=2 (one data-parallel rank) logs the loss and
    gradient norm of one process training the same packs, step by step: the label count is summed over the context
    group and DDP's (FSDP2's) average over both ranks is turned back into the sum of their shares, Gated DeltaNet
    parameters (each rank's gradient from its own rows of the whole-pack layer) included. Under FSDP2 the two
    context ranks also shard the model's states between them, with activation checkpointing on."""
    data, cache = write_mixed_dataset(tmp_path / "data"), tmp_path / "cache"
    # Some packs are text only: one process and both ranks send a dummy image through the tower there, so the
    # vision parameters get zero gradients (which AdamW steps) in both runs alike (trainer/step.py).
    common = ["packing.balance_window_steps=1", "checkpoint.export=false", "checkpoint.every_steps=0"]
    recipe = f"recipes/tiny-{family}.yaml"
    if layout == "fsdp2":
        common += ["model.gradient_checkpointing_llm=true", "model.gradient_checkpointing_vision=true"]
    context = launch(2, tmp_path / "cp2", data, cache, *common, "parallel.context=2", recipe=recipe, layout=layout)
    launch(1, tmp_path / "cp1", data, cache, *common, recipe=recipe)
    assert context["num_processes"] == 2
    assert_same_steps(tmp_path / "cp2", tmp_path / "cp1")
    assert all(record["tokens_per_s_per_gpu"] > 0 for record in step_records(tmp_path / "cp2").values())


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
    assert_same_steps(tmp_path / "dp2cp2", tmp_path / "one")


@pytest.mark.slow
def test_lora_training_with_context_parallel_matches_one_process(tmp_path):
    """LoRA (recipes/lora-tiny.yaml: adapters in the decoder layers and ViT blocks, the merger trained fully) under
    `accelerate launch` of two processes with parallel.context=2 logs one process's loss and gradient norm step by
    step: the adapters' gradients, each rank's from its own rows, sum to the whole pack's."""
    data, cache = write_mixed_dataset(tmp_path / "data"), tmp_path / "cache"
    common = ["packing.balance_window_steps=1", "checkpoint.export=false", "checkpoint.every_steps=0"]
    recipe = "recipes/lora-tiny.yaml"
    context = launch(2, tmp_path / "cp2", data, cache, *common, "parallel.context=2", recipe=recipe)
    launch(1, tmp_path / "cp1", data, cache, *common, recipe=recipe)
    assert context["num_processes"] == 2
    assert_same_steps(tmp_path / "cp2", tmp_path / "cp1")
