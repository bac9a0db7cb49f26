"""FSDP2 across process counts: train.py under recipes/accelerate/fsdp2.yaml, whose checkpoints hold the sharded state
dict accelerate writes through torch.distributed.checkpoint (DCP), preempted by SIGTERM on one number of processes
and requeued with `--allow-world-size-change` on another (two to one, one to two), over gloo on the CPU. The epoch
goes on with the packs the stopped launch had not taken (every sample trained once), the model and optimizer are the
saved ones (loaded, not re-initialised), and scripts.generate and scripts.chat read every checkpoint either launch
wrote. tests/test_requeue.py covers the same requeue under DDP, and the loader's position over any layout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image

from inference.loading import CHECKPOINT_MODEL_FILE, CHECKPOINT_SHARDS_DIR, load_run
from lifecycle import checkpoint, run_files
from scripts import chat, generate
from tests.test_distributed import COMMON, TINY
from verification.launch import free_port, run_logged

pytestmark = pytest.mark.slow  # the slow tier: `make test-all`

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 400  # a healthy launch of this tiny run takes ~30 s on 2 busy cores; a hang is killed at this
STEPS = 6
TEXT_RECORDS = 7  # beside one image record: 8 samples, each its own pack, so an epoch is 8 packs

# Launched by `accelerate launch --config_file recipes/accelerate/fsdp2.yaml`. accelerate makes a launch FSDP only
# over accelerators: on a CPU-only host it runs fsdp2.yaml's launch as plain data parallel (MULTI_CPU). FSDP2's
# fully_shard runs over gloo on the CPU (tests/test_distributed.py shards by hand that way), so the first lines make
# the launch FSDP as it is on GPUs; every FSDP setting (version 2, SHARDED_STATE_DICT, the wrap policy) still comes
# from fsdp2.yaml through the launcher's environment, and the rest is train.py as shipped. The recording lines write,
# per rank, the sample lengths of every step it trains, and rank 0 writes the full model and optimizer states as each
# checkpoint is saved and as a resume has loaded one; rank 0 sends the launcher SIGTERM as step `stop_at` starts.
LAUNCHED = """
import json, os, signal, sys
sys.path.insert(0, {root!r})
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _fsdp_on_cpu

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from lifecycle.checkpoint import Checkpointer
from trainer import loop

RANK, RECORD, STOP_AT = int(os.environ["RANK"]), {record!r}, {stop_at!r}
_step, _save, _load, _calls = loop.optimizer_step, Checkpointer.save, Checkpointer.load, []


def _recorded_step(*args):
    _calls.append(1)
    if len(_calls) == STOP_AT and RANK == 0:
        os.kill(os.getppid(), signal.SIGTERM)
    host_batches = args[5]
    with open(os.path.join(RECORD, f"lengths-rank{{RANK}}.jsonl"), "a") as lines:
        lines.write(json.dumps([length for batch in host_batches for length in batch["sample_lengths"]]) + "\\n")
    return _step(*args)


def _write_states(checkpointer, name):
    module, optimizer = checkpointer.accelerator._models[0], checkpointer.accelerator._optimizers[0].optimizer
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # collectives: every rank takes part
    states = {{
        "model": get_model_state_dict(module, options=options),
        "optimizer": get_optimizer_state_dict(module, optimizer, options=options),
    }}
    if RANK == 0:
        torch.save(states, os.path.join(RECORD, name))


def _recorded_save(self, step, *args):
    _write_states(self, f"saved-step{{step}}.pt")
    return _save(self, step, *args)


def _recorded_load(self, directory):
    step, state = _load(self, directory)
    _write_states(self, f"loaded-step{{step}}.pt")
    return step, state


loop.optimizer_step, Checkpointer.save, Checkpointer.load = _recorded_step, _recorded_save, _recorded_load

import train

if __name__ == "__main__":
    sys.exit(train.cli())
"""


def write_dataset(directory: Path) -> Path:
    """One record with a 224x224 image (102 tokens) and TEXT_RECORDS text records of distinct lengths (103-139
    tokens): no two fit one 200-token pack, and each sample's length names it."""
    directory.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (224, 224), (220, 40, 40)).save(directory / "red.png")
    records = [
        {
            "image": "red.png",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat color is the square?"},
                {"from": "gpt", "value": "The square is red."},
            ],
        }
    ]
    for repeats in range(8, 8 + TEXT_RECORDS):
        records.append(
            {
                "conversations": [
                    {"from": "human", "value": "Name the words. " + "cat dog sun tree boat fish " * repeats},
                    {"from": "gpt", "value": "cat dog sun tree boat fish " * 4},
                ]
            }
        )
    path = directory / "data.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def launch(nproc: int, run: Path, data: Path, record: Path, stop_at: int | None, *flags: str) -> tuple[int, str]:
    """LAUNCHED under `accelerate launch` with fsdp2.yaml and `nproc` CPU processes on the tiny STEPS-step run
    (checkpoints every 2 steps, no export); (the launcher's exit status, its log)."""
    record.mkdir(parents=True, exist_ok=True)
    script = run.parent / f"fsdp2_train_{nproc}.py"
    script.write_text(LAUNCHED.format(root=str(ROOT), record=str(record), stop_at=stop_at))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/fsdp2.yaml"]
    command += [f"--num_processes={nproc}", f"--main_process_port={free_port()}", str(script), "--config", TINY]
    command += [*COMMON, f"train.max_steps={STEPS}", f"data.path={data}", f"data.cache_dir={run.parent / 'cache'}"]
    command += [f"train.output_dir={run}", "packing.balance_window_steps=1", "checkpoint.export=false"]
    command += ["checkpoint.keep_last=3", *flags]  # the stopped launch's checkpoint stays for the last test
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = run.parent / f"launch-{len(list(run.parent.glob('launch-*.log')))}.log"
    outcome = run_logged(command, log, LAUNCH_TIMEOUT_S, env=env, new_session=True)
    assert outcome.code is not None, f"the {nproc}-process launch hung; log:\n{log.read_text()[-3000:]}"
    return outcome.code, log.read_text()


def trained_lengths(record: Path) -> list[int]:
    """The sample lengths of every step every rank trained, across launches."""
    lines = [line for path in sorted(record.glob("lengths-rank*.jsonl")) for line in path.read_text().splitlines()]
    return [length for line in lines for length in json.loads(line)]


def assert_equal_states(a, b, where: str = "") -> None:
    """Nested dicts and lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_equal_states(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_states(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("fsdp2-data"))


@pytest.fixture(scope="module", params=[(2, 1, 2), (1, 2, 4)], ids=["two-to-one", "one-to-two"])
def requeued(request, data, tmp_path_factory) -> dict:
    """A run of `first` FSDP2 processes stopped by SIGTERM as step `stop_at` starts (4 of the epoch's 8 packs
    taken), then relaunched with --resume --allow-world-size-change on `then` processes to step STEPS (the
    other 4): the run directory, the records and both launches' exit status and log."""
    first, then, stop_at = request.param
    root = tmp_path_factory.mktemp(f"fsdp2-{first}-to-{then}")
    run, record = root / "run", root / "record"
    stopped = launch(first, run, data, record, stop_at)
    resumed = launch(then, run, data, record, None, "--resume", "--allow-world-size-change")
    return {
        "first": first,
        "then": then,
        "stop_at": stop_at,
        "run": run,
        "record": record,
        "data": data,
        "logs": (stopped, resumed),
    }


def test_the_stopped_launch_saved_a_sharded_checkpoint_of_its_step(requeued):
    """The first launch stops after step `stop_at` with the preemption status (the launcher reports 1), having
    saved a complete checkpoint of that step in the sharded layout (DCP shards, no model.safetensors), whose marker
    records the process count that wrote it."""
    (code, output), _ = requeued["logs"]
    stop_at, run = requeued["stop_at"], requeued["run"]
    assert code == 1 and f"preempted: stopped by SIGTERM after step {stop_at}" in output, output[-3000:]
    saved = run / "checkpoints" / f"step_{stop_at:08d}"
    assert (saved / CHECKPOINT_SHARDS_DIR).is_dir() and not (saved / CHECKPOINT_MODEL_FILE).exists()
    assert json.loads((saved / checkpoint.COMPLETE).read_text())["num_processes"] == requeued["first"]


def test_the_requeue_trains_every_sample_of_the_epoch_once(requeued):
    """Across the two launches every step is logged once, and the steps' samples are the epoch's 8, each once (each
    sample's length names it): none the stopped launch trained comes again, none it left is dropped. The run ends
    with the new process count in its summary and in its last checkpoint's marker."""
    (_, _), (code, output) = requeued["logs"]
    run = requeued["run"]
    assert code == 0, output[-3000:]
    assert [r["step"] for r in run_files.training_records(run)] == list(range(1, STEPS + 1))
    lengths = trained_lengths(requeued["record"])
    assert len(lengths) == len(set(lengths)) == 1 + TEXT_RECORDS, sorted(lengths)
    assert run_files.read_summary(run)["num_processes"] == requeued["then"]
    last = run / "checkpoints" / f"step_{STEPS:08d}"
    assert json.loads((last / checkpoint.COMPLETE).read_text())["num_processes"] == requeued["then"]


def test_the_requeue_continues_from_the_saved_model_and_optimizer(requeued):
    """What the resumed launch holds right after loading the checkpoint, gathered whole (the model's parameters,
    the optimizer's step count and moments per parameter, its parameter groups), equals what the stopped launch
    held as it saved that checkpoint, bit for bit, though another number of processes holds the shards: the states
    are loaded, not re-initialised."""
    record, stop_at = requeued["record"], requeued["stop_at"]
    saved = torch.load(record / f"saved-step{stop_at}.pt", weights_only=False)
    loaded = torch.load(record / f"loaded-step{stop_at}.pt", weights_only=False)
    assert saved["optimizer"]["state"], "the saved optimizer holds no state: nothing was compared"
    assert_equal_states(loaded, saved)


def test_generate_and_chat_read_every_checkpoint_of_the_requeue(requeued, tmp_path):
    """scripts.generate and scripts.chat answer from the checkpoint each launch wrote (`latest`, by the new process
    count, and the stopped launch's, by the old), through DCP in one process: the model they build holds exactly the
    weights the training processes held as they saved it."""
    run, record, stop_at = requeued["run"], requeued["record"], requeued["stop_at"]
    for name, step in (("latest", STEPS), (str(run / "checkpoints" / f"step_{stop_at:08d}"), stop_at)):
        trained = torch.load(record / f"saved-step{step}.pt", weights_only=False)["model"]
        model = load_run(run, name).model.state_dict()
        assert model.keys() == {key.removeprefix("model.") for key in trained}
        assert all(torch.equal(model[key.removeprefix("model.")], value) for key, value in trained.items()), name
    out = tmp_path / "latest.jsonl"
    base = ["--run", str(run), "--data", str(requeued["data"]), "--max-new-tokens", "3"]
    try:
        assert generate.main([*base, "--checkpoint", "latest", "--out", str(out)]) == 0
        assert len(out.read_text().splitlines()) == 1 + TEXT_RECORDS
        question = ["--prompt", "Name a word.", "--max-new-tokens", "3"]
        assert chat.main(["--run", str(run), "--checkpoint", "latest", *question]) == 0
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
