"""Two machines on one host: one `accelerate launch` per machine rank with recipes/accelerate/ddp-multinode.yaml
(`--num_machines 2 --machine_rank r`, rendezvous on 127.0.0.1), one process each, gloo on the CPU, as a SLURM job
script runs them on two nodes (docs/cluster.md). The run directory is shared, as on a cluster's shared filesystem;
the data cache is shared (one machine builds it, the other waits) or node-local (each builds its own).

The runs are tests/test_cluster.py's: the tiny recipe, 4 steps, checkpoints at steps 2 and 4, the export; the
reference is one machine running the same two processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lifecycle import checkpoint, run_files
from tests.test_cluster import INLINE, LAUNCHED, assert_same_run, during_step, launch_two
from tests.test_train import TINY, run_args
from verification.launch import free_port, run_logged_together

pytestmark = pytest.mark.slow  # the slow tier: `make test-all`

ROOT = Path(__file__).resolve().parents[1]
MACHINES = 2
LAUNCH_TIMEOUT_S = 400  # a healthy two-machine launch takes ~40 s on 2 cores; a hang is killed at this


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory) -> Path:
    """The reference: one machine, two processes, the same run."""
    root = tmp_path_factory.mktemp("one-machine")
    code, output = launch_two(ROOT / "train.py", root / "run", root / "cache")
    assert code == 0, output[-3000:]
    return root / "run"


def caches(root: Path, layout: str) -> list[Path]:
    """Each machine's data.cache_dir: one directory for both (shared) or one each (node-local)."""
    return [root / "cache"] * MACHINES if layout == "shared" else [root / f"cache-node{r}" for r in range(MACHINES)]


def launcher_command(launcher: str, machine_rank: int, port: int) -> list[str]:
    """Machine `machine_rank`'s launcher of one process, meeting the others at 127.0.0.1:`port`: `accelerate launch`
    with recipes/accelerate/ddp-multinode.yaml, or `torchrun` (docs/cluster.md gives both)."""
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={MACHINES}", "--nproc_per_node=1"]
        command += [f"--node_rank={machine_rank}", "--rdzv_backend=static", "--master_addr=127.0.0.1"]
        return [*command, f"--master_port={port}"]
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    command += ["--config_file", "recipes/accelerate/ddp-multinode.yaml", f"--num_machines={MACHINES}"]
    command += [f"--num_processes={MACHINES}", f"--machine_rank={machine_rank}"]
    return [*command, "--main_process_ip=127.0.0.1", f"--main_process_port={port}"]


def launch_machines(
    script: Path, run: Path, cache_dirs: list[Path], *flags: str, launcher: str = "accelerate"
) -> tuple[list[int | None], str]:
    """`script` launched as a two-machine job: one launcher per machine rank, concurrently, with that machine's
    cache; (each launcher's exit status, their logs one after the other)."""
    port = free_port()
    commands = []
    for machine_rank, cache in enumerate(cache_dirs):
        command = [*launcher_command(launcher, machine_rank, port), str(script), "--config", TINY]
        commands.append([*command, *run_args(run, cache, INLINE), *flags])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    attempt = len(list(run.parent.glob(f"{run.name}-*-node0.log")))
    logs = [run.parent / f"{run.name}-{attempt}-node{r}.log" for r in range(MACHINES)]
    outcomes = run_logged_together(commands, logs, LAUNCH_TIMEOUT_S, env=env)
    output = "\n".join(f"----- machine {r} -----\n{log.read_text()}" for r, log in enumerate(logs))
    return [outcome.code for outcome in outcomes], output


@pytest.mark.parametrize(
    ("launcher", "cache"), [("accelerate", "shared"), ("accelerate", "node-local"), ("torchrun", "node-local")]
)
def test_two_machines_train_exactly_as_one_machine_of_the_same_world_size(one_machine, tmp_path, launcher, cache):
    """Two machine ranks of one process each (`accelerate launch` or `torchrun`) train the run of one machine with
    two processes: every step's loss, gradient norm and learning rate, and the exported weights, bit for bit. Only
    global rank 0 holds the shared run directory's lock (a second holder would refuse the run), and it is released
    at the end; each node-local cache was built on its machine."""
    cache_dirs = caches(tmp_path, cache)
    codes, output = launch_machines(ROOT / "train.py", tmp_path / "run", cache_dirs, launcher=launcher)
    assert codes == [0, 0], output[-6000:]
    assert_same_run(tmp_path / "run", one_machine)
    assert run_files.read_summary(tmp_path / "run")["num_processes"] == MACHINES
    assert (tmp_path / "run" / "run.lock").read_text() == ""
    assert "in use by another run" not in output
    for directory in set(cache_dirs):
        assert any(directory.rglob("*.arrow")), f"{directory} holds no processed data"


@pytest.mark.parametrize("cache", ["shared", "node-local"])
def test_sigterm_to_one_machines_launcher_stops_both_and_resume_is_exact(one_machine, tmp_path, cache):
    """SIGTERM to machine 1's launcher during step 2 (the main process's machine gets none): both machines' ranks
    agree on the step to stop after and name the signal alike, one complete checkpoint of it is saved,
    preempted.json names it, and both launchers exit non-zero. The same two-machine command with --resume ends equal
    to the one-machine run, bit for bit."""
    run, cache_dirs = tmp_path / "run", caches(tmp_path, cache)
    script = tmp_path / "signalled_train.py"
    signal_launcher = "os.kill(os.getppid(), signal.SIGTERM) if os.environ['RANK'] == '1' else None"
    script.write_text(LAUNCHED.format(root=str(ROOT), patch=during_step(2, signal_launcher)))
    codes, output = launch_machines(script, run, cache_dirs)
    assert None not in codes and all(code != 0 for code in codes), output[-6000:]
    stops = [line for line in output.splitlines() if "preempted: stopped by SIGTERM after step" in line]
    assert len(stops) == MACHINES and len(set(stops)) == 1, output[-6000:]
    record = json.loads((run / "preempted.json").read_text())
    assert record["step"] in (2, 3) and record["checkpoint"] == str(checkpoint.latest_checkpoint(run))
    assert [r["step"] for r in run_files.training_records(run)] == list(range(1, record["step"] + 1))
    codes, output = launch_machines(ROOT / "train.py", run, cache_dirs, "--resume")
    assert codes == [0, 0], output[-6000:]
    assert_same_run(run, one_machine)
