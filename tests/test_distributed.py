"""Two training processes on CPU (gloo, `accelerate launch` with the repo's DDP config, as on GPUs): data-parallel
training of the tiny model matches one process on the same global batch, a rank with a text-only pack does not
hang, resume continues exactly, and the export loads in one process.

The dataset is two samples that never share a pack (their lengths add up past the pack budget): one with an image,
one text-only. The loader deals packs by cost, so with two ranks every step gives rank 0 the image pack and rank 1
the text-only pack — the situation that hangs FSDP/ZeRO-3 trainers when the text-only rank skips the vision tower
(every rank must run the vision tower every step). One process with two accumulation steps sees the same two packs
per optimizer step.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from PIL import Image

from lifecycle import run_files
from verification.launch import free_port, run_logged

pytestmark = pytest.mark.slow  # the slow tier: `make test-all`

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-qwen2_5_vl.yaml"
LAUNCH_TIMEOUT_S = 150  # far above a healthy launch of these tiny runs; a collective mismatch hangs until this
STEPS = 4
COMMON = [
    "kernels.mrope=unfused",  # the fused kernels would run under the Triton interpreter, far slower
    "model.dtype=float32",
    "data.eval_fraction=0",
    "packing.max_tokens=200",  # image sample 102 tokens + text sample 128 tokens: never one pack
    f"train.max_steps={STEPS}",
    "train.warmup_steps=1",
    "train.lr=0.003",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
    "logging.every_steps=1",
    "logging.timing_warmup_steps=1",
    "logging.progress_bar=false",
    "logging.report_to=none",
]


def write_mixed_dataset(directory: Path) -> Path:
    """Two LLaVA records: a 224x224 image with a question (102 tokens, 256 ViT patches), and text only (128)."""
    directory.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (224, 224), (220, 40, 40)).save(directory / "red.png")
    records = [
        {
            "id": "image",
            "image": "red.png",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat color is the square?"},
                {"from": "gpt", "value": "The square is red."},
            ],
        },
        {
            "id": "text",
            "conversations": [
                {"from": "human", "value": "Name the words. " + "cat dog sun tree boat fish " * 12},
                {"from": "gpt", "value": "cat dog sun tree boat fish " * 4},
            ],
        },
    ]
    path = directory / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def launch(
    nproc: int, run_dir: Path, data: Path, cache: Path, *overrides: str, recipe: str = TINY, layout: str = "ddp"
) -> dict:
    """train.py on `recipe` in `nproc` processes (`accelerate launch` with recipes/accelerate/<layout>.yaml when
    nproc > 1); returns its summary.json."""
    train_args = [
        "train.py",
        "--config",
        recipe,
        *COMMON,
        f"data.path={data}",
        f"data.cache_dir={cache}",
        f"train.output_dir={run_dir}",
        *overrides,
    ]
    command = [sys.executable, *train_args]
    if nproc > 1:  # the repo's own DDP config: on a host without CUDA, train.py asks accelerate for gloo on the CPU
        launcher = ["-m", "accelerate.commands.launch", "--config_file", f"recipes/accelerate/{layout}.yaml"]
        command[1:1] = [*launcher, f"--num_processes={nproc}", f"--main_process_port={free_port()}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    run_processes(command, run_dir.parent / f"{run_dir.name}.log", f"{nproc}-process run")
    return run_files.read_summary(run_dir)


def run_processes(command: list[str], log_path: Path, what: str) -> str:
    """Run a (torchrun) command on CPU with the scripts' launcher and return its output; a failure, or a hang past
    LAUNCH_TIMEOUT_S (the whole process tree is then killed), fails the test with the end of the log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    outcome = run_logged(command, log_path, LAUNCH_TIMEOUT_S, env=env, new_session=True)
    output = log_path.read_text()
    if outcome.code is None:
        pytest.fail(f"{what} hung for {LAUNCH_TIMEOUT_S} s; log:\n{output[-3000:]}")
    if outcome.code != 0:
        pytest.fail(f"{what} failed (exit {outcome.code}); log:\n{output[-3000:]}")
    return output


def step_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in run_files.training_records(run_dir)}


def assert_same_steps(run_dir: Path, reference: Path, grad_norm_rel: float = 1e-5) -> None:
    """`run_dir` logged the steps of `reference`, each with its loss (relative 1e-5) and gradient norm."""
    ours, theirs = step_records(run_dir), step_records(reference)
    assert sorted(ours) == sorted(theirs)
    for step in ours:
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], rel=1e-5), f"loss at step {step}"
        assert ours[step]["grad_norm"] == pytest.approx(theirs[step]["grad_norm"], rel=grad_norm_rel), step


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The three launches the tests read: two processes (with the export), one process accumulating two packs
    per step, and two processes resuming the first run from its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("distributed")
    data, cache = write_mixed_dataset(root / "data"), root / "cache"
    two, one, resumed = root / "two", root / "one", root / "resumed"
    # window = 2 packs in both layouts, so both see the same two packs per optimizer step
    launch(2, two, data, cache, "packing.balance_window_steps=1", "checkpoint.export=true")
    launch(1, one, data, cache, "packing.balance_window_steps=2", "train.grad_accum_steps=2", "checkpoint.export=false")
    checkpoint = two / "checkpoints" / "step_00000002"
    launch(
        2,
        resumed,
        data,
        cache,
        "packing.balance_window_steps=1",
        "checkpoint.export=false",
        f"checkpoint.resume={checkpoint}",
    )
    return {"two": two, "one": one, "resumed": resumed, "data": data, "cache": cache}


@pytest.mark.slow
def test_every_step_gives_one_rank_a_text_only_pack(runs):
    """The setup the other tests rely on: on each step of two ranks, rank 0's pack has an image and rank 1's pack
    is text only (so the two-process run below really exercised the dummy-image path)."""
    from core.config import load_config
    from core.families import hf_config
    from data.pipeline import build_data, load_processor

    overrides = [*COMMON, f"data.path={runs['data']}", f"data.cache_dir={runs['cache']}"]
    cfg = load_config(str(ROOT / TINY), [*overrides, "packing.balance_window_steps=1"])
    processor = load_processor(cfg.model, cfg.data)
    loaders = [build_data(cfg.data, cfg.packing, processor, hf_config(cfg.model), rank, 2)[0] for rank in (0, 1)]
    for rank, loader in enumerate(loaders):
        steps = list(loader.steps(0))
        assert len(steps) == 1
        patches = steps[0][rank].patches
        assert (patches > 0) if rank == 0 else (patches == 0)


@pytest.mark.slow
def test_two_processes_match_one_process_on_the_same_global_batch(runs):
    """Two ranks (one of them text-only every step) train without hanging, and their loss and gradient norm per
    step equal one process accumulating the same two packs: the loss is normalised by the global label count and
    the text-only rank's dummy image adds exactly nothing."""
    assert json.loads((runs["two"] / "summary.json").read_text())["num_processes"] == 2
    assert sorted(step_records(runs["two"])) == list(range(1, STEPS + 1))
    assert_same_steps(runs["two"], runs["one"], grad_norm_rel=1e-4)
    two = step_records(runs["two"])
    assert two[STEPS]["loss"] < two[1]["loss"]


@pytest.mark.slow
def test_resume_under_two_processes_continues_exactly(runs):
    """Two processes resumed from the step-2 checkpoint log the same losses for steps 3-4 as the uninterrupted run."""
    full, resumed = step_records(runs["two"]), step_records(runs["resumed"])
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-6), f"loss at step {step}"


@pytest.mark.slow
def test_export_of_the_two_process_run_loads_in_one_process(runs):
    """The final export of a two-process run loads with from_pretrained in a single process, every weight present."""
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(runs["two"] / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.model_type == "qwen2_5_vl"


@pytest.mark.slow
def test_master_weights_in_the_optimizer_is_refused_under_ddp(tmp_path):
    """train.master_weights=optimizer under two DDP processes ends every rank with a one-line config error that
    points to FSDP2 (DDP would all-reduce bf16 gradients), before any model is built."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/ddp.yaml"]
    command += ["--num_processes=2", f"--main_process_port={free_port()}", "train.py", "--config", TINY, *COMMON]
    command += [f"train.output_dir={tmp_path / 'run'}", "model.dtype=bfloat16", "train.master_weights=optimizer"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    outcome = run_logged(command, tmp_path / "run.log", LAUNCH_TIMEOUT_S, env=env, new_session=True)
    output = (tmp_path / "run.log").read_text()
    assert outcome.code not in (0, None), output[-3000:]
    refusal = "config error: train.master_weights=optimizer is not supported with 2 DDP processes"
    assert output.count(refusal) == 2 and "recipes/accelerate/fsdp2.yaml" in output, output[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fsdp_gradients_reduce_in_fp32_and_cpu_hosts_form_a_group(monkeypatch):
    """Under FSDP (as `accelerate launch` with fsdp2.yaml sets it) parameters are gathered in the compute dtype and
    gradients reduce-scattered in fp32, while the rest of the FSDP settings still come from the launcher; without
    CUDA the Accelerator is told to use the CPU (else no gloo group forms). Under DDP the gradients are views into
    DDP's buckets (no second fp32 copy of every gradient; the two-process runs above train with it)."""
    import torch

    from core.distributed import accelerator_kwargs

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    kwargs = accelerator_kwargs("bfloat16")
    assert kwargs["cpu"] == (not torch.cuda.is_available())
    (ddp,) = kwargs.pop("kwargs_handlers")
    assert ddp.to_kwargs() == {"gradient_as_bucket_view": True} and set(kwargs) == {"cpu"}
    for key, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
    }.items():
        monkeypatch.setenv(key, value)
    plugin = accelerator_kwargs("bfloat16")["fsdp_plugin"]
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.bfloat16,
    )
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False
    assert "fsdp_plugin" not in accelerator_kwargs("float32")


def test_launch_without_a_process_group_is_refused(monkeypatch):
    """Two launched processes that formed no process group (each would train alone) are an error, not a run."""
    from core.distributed import check_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="2 processes were launched"):
        check_world_size(1)
    check_world_size(2)
    monkeypatch.delenv("WORLD_SIZE")
    check_world_size(1)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_ends_with_a_barrier_then_a_pause_for_gloo_then_the_teardown(monkeypatch, processes):
    """Several processes end together (barrier), then release the GIL long enough for gloo's worker threads to free
    the barrier's work before the process group can be destroyed (core/distributed.py, GLOO_DRAIN_S), then tear
    down; one process tears down at once."""
    from core import distributed

    calls = []

    class Accelerator:
        num_processes = processes

        def wait_for_everyone(self):
            calls.append("barrier")

        def end_training(self):
            calls.append("teardown")

    monkeypatch.setattr(distributed.time, "sleep", lambda seconds: calls.append(("sleep", seconds)))
    distributed.finish(Accelerator())
    expected = ["barrier", ("sleep", distributed.GLOO_DRAIN_S), "teardown"] if processes > 1 else ["teardown"]
    assert calls == expected and distributed.GLOO_DRAIN_S > 0


def test_accelerate_launch_cpu_with_several_processes_is_refused(monkeypatch):
    """`accelerate launch --cpu --num_processes 2` starts one process and no group: that is an error naming the
    command that starts two, not a silent one-process run; one process, or no accelerate parent, passes."""
    from core.distributed import LaunchError, check_world_size

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for launcher in (
        ["/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "train.py"],
        ["python", "-m", "accelerate.commands.launch", "--cpu", "--num_processes=2", "train.py"],
    ):
        with pytest.raises(LaunchError, match=r"asked for 2 processes but started one.*ddp\.yaml --num_processes 2"):
            check_world_size(1, launcher)
    check_world_size(1, ["/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "1", "train.py"])
    check_world_size(1, ["python", "train.py", "--num_processes", "2"])


WORKER_EXIT = """
dist.destroy_process_group()
# FSDP's meshes and the script's globals keep the process group alive past destroy_process_group, into interpreter
# shutdown, where a gloo worker thread still releasing a tensor can abort the process after the results are out
# (SIGABRT, "terminate called without an active exception"; seen with the context-parallel worker). Leave without
# that shutdown; an error before this point still exits non-zero.
import os
sys.stdout.flush()
os._exit(0)
"""
"""The end of a worker script that ran collectives: what it printed is out, and its exit status is 0."""


# FSDP2 through accelerate needs CUDA (on a CPU process group accelerate falls back to plain data parallel), so on
# CPU this worker shards the training module with torch's fully_shard as accelerate's FSDP2 path does: every module
# of a _no_split_modules class (decoder layers, ViT blocks) is its own unit, then the root. FSDP2 needs every rank to
# run the units in the same order, so a text-only rank must send its dummy image through the ViT where a real image
# would go: before the decoder layers.
FSDP2_WORKER = """
import dataclasses, json, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from data.pipeline import build_data, load_processor
from trainer.step import TrainModule
from core.config import load_config
from core.families import hf_config
from modeling.build import build_model
from modeling.packed import enable_packed_forward

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = load_config({recipe!r}, {overrides!r})
processor = load_processor(cfg.model, cfg.data)
packs = [next(iter(build_data(cfg.data, cfg.packing, processor, hf_config(cfg.model), r, 2)[0])) for r in (0, 1)]

def train_module():
    model = build_model(dataclasses.replace(cfg.model, dtype="float32"), seed=0)
    enable_packed_forward(model)
    return TrainModule(model)

labels = sum(pack["num_label_tokens"] for pack in packs)
reference = train_module()
for pack in packs:
    (reference(pack) / labels).backward()
sharded = train_module()
units = [m for m in sharded.modules() if type(m).__name__ in sharded._no_split_modules]
for unit in units:
    fully_shard(unit)
fully_shard(sharded)
(sharded(packs[rank]) * 2 / labels).backward()  # FSDP averages gradients over the 2 ranks
expected = dict(reference.named_parameters())
worst = max(
    ((p.grad.full_tensor() - expected[name].grad).abs().max() / expected[name].grad.abs().max().clamp(min=1e-12)).item()
    for name, p in sharded.named_parameters()
)
report = dict(rank=rank, units=len(units), patches=[p["num_vision_patches"] for p in packs], worst=worst)
print("RESULT " + json.dumps(report), flush=True)
"""


@pytest.mark.slow
def test_fsdp2_with_a_text_only_rank_matches_one_unsharded_model(runs, tmp_path):
    """Under FSDP2 (per-layer shards over gloo), a step where rank 1's pack is text only completes — its vision
    blocks still all-gather and reduce-scatter — and the sharded gradients equal one unsharded model's gradient
    over both packs (global label-count normalisation)."""
    overrides = [*COMMON, f"data.path={runs['data']}", f"data.cache_dir={runs['cache']}"]
    overrides.append("packing.balance_window_steps=1")
    overrides.append("data.num_workers=0")  # inline: loader workers import the main script, which has no main guard
    worker = tmp_path / "fsdp2_worker.py"
    worker.write_text(FSDP2_WORKER.format(root=str(ROOT), recipe=str(ROOT / TINY), overrides=overrides) + WORKER_EXIT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    output = run_processes(command, tmp_path / "fsdp2.log", "FSDP2 step")
    # ranks print concurrently, so two results can share a line: find each flat JSON object after its marker
    results = [json.loads(match) for match in re.findall(r"RESULT (\{[^{}]*\})", output)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["patches"][0] > 0 and result["patches"][1] == 0
        assert result["units"] >= 4  # 2 decoder layers + 2 ViT blocks of the tiny model
        assert result["worst"] < 1e-4, f"rank {result['rank']}: worst relative gradient error {result['worst']}"


LORA = "recipes/lora-tiny.yaml"  # adapters on the language model and the ViT blocks, the merger trained fully


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> dict[str, Path]:
    """LoRA launches of recipes/lora-tiny.yaml: two processes (with the export), one process accumulating the same
    two packs per step, and two processes resuming the first from its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("distributed-lora")
    data, cache = write_mixed_dataset(root / "data"), root / "cache"
    two, one, resumed = root / "two", root / "one", root / "resumed"
    launch(2, two, data, cache, "packing.balance_window_steps=1", "checkpoint.export=true", recipe=LORA)
    launch(1, one, data, cache, "packing.balance_window_steps=2", "train.grad_accum_steps=2", recipe=LORA)
    checkpoint = two / "checkpoints" / "step_00000002"
    launch(2, resumed, data, cache, "packing.balance_window_steps=1", f"checkpoint.resume={checkpoint}", recipe=LORA)
    return {"two": two, "one": one, "resumed": resumed}


@pytest.mark.slow
def test_lora_under_ddp_matches_one_process_and_resumes_exactly(lora_runs):
    """LoRA under DDP (one rank text-only every step, so its ViT adapters train through the dummy image): the loss and
    gradient norm per step equal one process accumulating the same packs; resuming the two processes from step 2
    gives the same losses; the checkpoints hold only the trained tensors; the merged export loads in one process."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    two, one, resumed = (step_records(lora_runs[name]) for name in ("two", "one", "resumed"))
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1)) and sorted(resumed) == [3, 4]
    for step in two:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), f"loss at step {step}"
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), f"grad norm at {step}"
    for step in resumed:
        assert resumed[step]["loss"] == pytest.approx(two[step]["loss"], rel=1e-6), f"resumed loss at step {step}"
    saved = load_file(lora_runs["two"] / "checkpoints" / "step_00000004" / "model.safetensors")
    assert saved and all(".lora_" in key or ".merger." in key for key in saved)
    _, info = AutoModelForImageTextToText.from_pretrained(lora_runs["two"] / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (lora_runs["two"] / "final" / "adapter" / "adapter_model.safetensors").is_file()


# FSDP2 with LoRA, sharded with torch's fully_shard as accelerate's FSDP2 path does (FSDP2_WORKER says why): the
# gradients of an fp32 step against one unsharded model; the sharded state dict (accelerate's checkpoint: DCP save
# and load) holds the trained tensors only and restores them into a fresh sharded model; and a frozen bf16 base with
# fp32 adapters in one unit shards and trains under accelerate's mixed precision (bf16 gathers, fp32 reduce).
FSDP2_LORA_WORKER = """
import dataclasses, json, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from data.pipeline import build_data, load_processor
from trainer.step import TrainModule
from core.config import load_config
from core.families import hf_config
from modeling.lora import ADAPTER, apply_lora, full_state_dict, lora_layers, merged_state
from modeling.build import build_model
from modeling.packed import enable_packed_forward

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = load_config({recipe!r}, {overrides!r})
processor = load_processor(cfg.model, cfg.data)
packs = [next(iter(build_data(cfg.data, cfg.packing, processor, hf_config(cfg.model), r, 2)[0])) for r in (0, 1)]
labels = sum(pack["num_label_tokens"] for pack in packs)

def train_module(dtype=torch.float32, seed=0):
    model = build_model(dataclasses.replace(cfg.model, dtype="float32"), seed=0)
    enable_packed_forward(model)
    torch.manual_seed(seed)
    apply_lora(model, cfg.lora, dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            weight = layer.lora_B[ADAPTER].weight
            weight.copy_(0.1 * torch.randn(weight.shape, generator=generator))
    return TrainModule(model)

def shard(module, **kwargs):
    for unit in [m for m in module.modules() if type(m).__name__ in module._no_split_modules]:
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
    return module

def worst_error(sharded, reference):
    expected = dict(reference.named_parameters())
    return max(
        ((p.grad.full_tensor().float() - expected[n].grad).abs().max() / expected[n].grad.abs().max()).item()
        for n, p in sharded.named_parameters() if p.requires_grad
    )

reference = train_module()
for pack in packs:
    (reference(pack) / labels).backward()
sharded = shard(train_module())
(sharded(packs[rank]) * 2 / labels).backward()  # FSDP averages gradients over the 2 ranks
trained = sorted(n for n, p in sharded.named_parameters() if p.requires_grad)
state = get_model_state_dict(sharded)
dcp.save({{"model": state}}, checkpoint_id={checkpoint!r})
fresh = shard(train_module(seed=1))
loaded = get_model_state_dict(fresh)
dcp.load({{"model": loaded}}, checkpoint_id={checkpoint!r})
set_model_state_dict(fresh, loaded)
restored = dict(fresh.named_parameters())
mismatched = [n for n, p in sharded.named_parameters() if not torch.equal(p.full_tensor(), restored[n].full_tensor())]

# the export: the full state dict gathered (frozen base included), the adapters merged, as the plain model's weights
with full_state_dict(sharded.model):
    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
export_loads = None
if rank == 0:
    plain = build_model(dataclasses.replace(cfg.model, dtype="float32"), seed=0)
    merged = merged_state({{k.removeprefix("model."): v for k, v in full.items()}}, sharded.model)
    export_loads = not plain.load_state_dict(merged).missing_keys

policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
mixed = shard(train_module(torch.bfloat16), mp_policy=policy)
(mixed(packs[rank]) * 2 / labels).backward()
dtypes = sorted({{str(p.dtype) for p in mixed.parameters()}})
report = dict(
    rank=rank, worst=worst_error(sharded, reference), state_keys=sorted(state) == trained, trained=len(trained),
    mismatched=mismatched, bf16_worst=worst_error(mixed, reference), dtypes=dtypes, export_loads=export_loads,
)
print("RESULT " + json.dumps(report), flush=True)
"""


@pytest.mark.slow
def test_lora_under_fsdp2_matches_one_model_and_checkpoints_the_adapters(tmp_path):
    """Under FSDP2 (per-layer shards over gloo) a LoRA step, one rank text-only, gives the unsharded model's adapter
    and merger gradients (fp32); the sharded state dict that accelerate's checkpoint saves through DCP is the trained
    tensors only and loads back strictly into a fresh sharded model, every tensor restored; the export's full state
    dict, gathered with the frozen base and merged, loads strictly into the plain model; and the bf16 frozen base
    beside fp32 adapters in one unit shards and trains under mixed precision (bf16 gathers, fp32 reduction), within
    bf16 rounding of the fp32 gradients."""
    data = write_mixed_dataset(tmp_path / "data")
    overrides = [*COMMON, f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}"]
    overrides += ["packing.balance_window_steps=1", "data.num_workers=0"]
    worker = tmp_path / "fsdp2_lora_worker.py"
    source = FSDP2_LORA_WORKER.format(
        root=str(ROOT), recipe=str(ROOT / LORA), overrides=overrides, checkpoint=str(tmp_path / "dcp")
    )
    worker.write_text(source + WORKER_EXIT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    output = run_processes(command, tmp_path / "fsdp2_lora.log", "FSDP2 LoRA step")
    results = [json.loads(match) for match in re.findall(r"RESULT (\{[^{}]*\})", output)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["worst"] < 1e-4, f"rank {result['rank']}: worst relative gradient error {result['worst']}"
        assert result["state_keys"] and result["trained"] > 0 and not result["mismatched"]
        assert result["export_loads"] is (True if result["rank"] == 0 else None)
        assert result["dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert result["bf16_worst"] < 5e-2, f"rank {result['rank']}: bf16 gradient error {result['bf16_worst']}"
