"""Multi-process helpers: the Accelerator arguments train.py needs beyond mixed precision, a guard against silently
independent processes, the collective settings every launcher of ours exports, small host-side agreements between
ranks (`HostCollectives`), and the end of a run.

`SAFE_COLLECTIVES_ENV` turns off NVLink SHARP / multicast in NCCL, torch symmetric memory and NVSHMEM: where a
container gets no multicast objects, collectives that try them fail or hang at start-up. The plain ring/tree
algorithms are what docs/performance.md's multi-GPU figures use.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

SAFE_COLLECTIVES_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# gloo's worker threads free a finished collective (and the Python-created tensors it still holds) only once they get
# the GIL. The process group is destroyed with the GIL held (the DDP reducer's reference goes when train.py's main()
# returns), and its destructor joins those threads: if one still holds the final barrier's work, neither moves (the
# main thread in ~ProcessGroupGloo joining, the worker in ~AsyncBarrierWork waiting for the GIL), most often on a
# loaded host with few cores. Sleeping before the teardown releases the GIL so the workers finish first.
GLOO_DRAIN_S = 0.2


def accelerator_kwargs(dtype: str) -> dict[str, Any]:
    """Extra `Accelerator(...)` arguments for a recipe whose `model.dtype` is `dtype` ("bfloat16", ...).

    - `cpu=True` when there is no CUDA device: otherwise accelerate forms no process group on a CPU-only host, and
      N launched processes each train their own copy on their own data without a word (gloo needs it said).
    - Under FSDP (`accelerate launch` with recipes/accelerate/fsdp2.yaml sets ACCELERATE_USE_FSDP): a plugin whose
      mixed precision gathers parameters in `dtype` but reduce-scatters gradients in fp32. accelerate's default
      reduces in the compute dtype, which rounds every gradient to bf16 before the fp32 optimizer sees it; the
      other FSDP settings still come from the config file (the plugin reads the FSDP_* variables the launcher set).
    - Under DDP: gradients as views into DDP's reduction buckets. By default DDP keeps its own fp32 copy of every
      gradient for the all-reduce (4 bytes per trainable parameter per rank) beside the gradients; with the views
      the optimizer reads the buckets. The reduction and its result are the same; only the copy goes. DDP allocates
      the buckets when it wraps the model, so they are there at the start of backward (where a single process has
      almost no gradients yet): a step whose peak is its activations there peaks the same either way; the copy's
      bytes go from the end of backward and the optimizer step.
    """
    from accelerate.utils import DistributedDataParallelKwargs

    kwargs: dict[str, Any] = {
        "cpu": not torch.cuda.is_available(),
        "kwargs_handlers": [DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    }
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and dtype != "float32":
        from accelerate.utils import FullyShardedDataParallelPlugin

        compute = COMPUTE_DTYPES[dtype]
        policy = {"param_dtype": compute, "reduce_dtype": torch.float32, "output_dtype": compute}
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(mixed_precision_policy=policy)
    return kwargs


class LaunchError(RuntimeError):
    """The processes a launcher started do not form the group the command asked for."""


CPU_DDP_COMMAND = "accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes N train.py ..."


def requested_processes(launcher_cmdline: list[str]) -> int | None:
    """The `--num_processes` of an `accelerate launch` command line, or None (not one, or it gives none)."""
    if not any(part.endswith("accelerate") or "accelerate.commands" in part for part in launcher_cmdline):
        return None
    for index, part in enumerate(launcher_cmdline):
        value = part.removeprefix("--num_processes=") if part.startswith("--num_processes=") else None
        if part == "--num_processes" and index + 1 < len(launcher_cmdline):
            value = launcher_cmdline[index + 1]
        if value is not None and value.isdigit():
            return int(value)
    return None


def _parent_cmdline() -> list[str]:
    import psutil

    try:
        return psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        return []


def check_world_size(num_processes: int, launcher_cmdline: list[str] | None = None) -> None:
    """Raise when the launcher started more processes (WORLD_SIZE) than the Accelerator joined (`num_processes`):
    each process would train alone and they would overwrite each other's run directory. Also raise when the
    `accelerate launch` that started this process asked for more processes than it started: with `--cpu` it
    starts one, silently, and sets no WORLD_SIZE (`launcher_cmdline`: the parent's command line by default)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != num_processes:
        raise LaunchError(
            f"{launched} processes were launched but accelerate formed a group of {num_processes}: on a CPU-only "
            "host pass cpu=True to Accelerator (core.distributed.accelerator_kwargs does), or launch one process."
        )
    requested = requested_processes(_parent_cmdline() if launcher_cmdline is None else launcher_cmdline)
    if "WORLD_SIZE" not in os.environ and requested is not None and requested > 1:
        raise LaunchError(
            f"accelerate launch asked for {requested} processes but started one (it does so with --cpu). For "
            f"{requested} processes on CPUs (gloo) run: {CPU_DDP_COMMAND.replace('N', str(requested), 1)}"
        )


class HostCollectives:
    """Small agreements between ranks on the host (a stop flag, an error message), over gloo with CPU tensors: they
    never wait on the device. One process needs no collective; on CPU the default group is gloo already; under NCCL
    a gloo group is made once. Construct it on every rank at the same point of the run (making a group is itself a
    collective)."""

    def __init__(self, accelerator):
        import torch.distributed as dist

        self.size = accelerator.num_processes
        self.group = None
        if self.size > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (one all-reduce of a CPU int)."""
        if self.size == 1:
            return flag
        import torch.distributed as dist

        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value[0])

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values


def finish(accelerator) -> None:
    """End the run on every rank together: a barrier (gloo hangs if a rank tears down early), a pause in which
    gloo's worker threads free its work (GLOO_DRAIN_S), then accelerate's teardown (trackers, process group)."""
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        time.sleep(GLOO_DRAIN_S)
    accelerator.end_training()
