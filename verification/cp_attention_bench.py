"""Head-to-head of context-parallel text attention engines on one long causal document (attention alone, 2 GPUs).

The case context parallelism exists for: ONE causal document of `--lengths` tokens (default 32k, 64k, 128k) split
over the ranks, bf16, Qwen2.5-VL-3B text attention (16 query heads, 2 kv heads, head dim 128: GQA). Engines:

- one_gpu: the reference. Every rank runs causal SDPA (flash) on the whole sequence, alone (no collective): what one
  GPU does without context parallelism; its outputs and gradients are what the engines are compared against.
- ours_allgather_kv: the repo's own path, called as the model calls it: `shard_pack` / `context_shard`
  (modeling/context_parallel.py: zig-zag shards, the key-prefix index) and the registered attention function
  `packed_attention_forward` with the `ContextShard` (modeling/packed.py: all-gather of k and v, reduce-scatter of
  dk and dv in backward, one varlen flash call; flash-attn's when installed, else torch's `varlen_attn`).
- torch_cp_allgather / torch_cp_alltoall: torch's `torch.distributed.tensor.experimental.context_parallel` (ring
  attention over SDPA, `is_causal=True`, its head-tail load balancer, which is the same zig-zag layout), with
  `set_rotate_method("allgather")` / `("alltoall")`. q, k, v go in as the context's buffers (torch shards them) and
  SDPA is called with `enable_gqa=True`; if that fails, k and v are repeated to the 16 query heads first (noted in
  the JSON: the ring then moves 8x the kv bytes). The reference takes the same fallback.

Per engine and length: fwd ms and fwd+bwd ms (CUDA events, after `--warmup` steps; per repeat the slowest rank;
median, min and max over `--repeats`), the peak memory a fwd+bwd step adds on the rank (MiB, max over ranks), and
the max abs difference of the output and of dq, dk, dv against the reference's shard of this rank (max over ranks).
An engine that raises (an API missing from this torch, say) is recorded with its error and the run goes on. Writes
JSON to --out and prints a table. Estimated (not yet run) at 1-2 minutes on two H200s with the defaults (lengths
32k, 64k, 128k, warmup 3, repeats 10), most of it the 128k row and the one-GPU reference.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 2 -m scripts.bench_cp_attention --out artifacts/bench/cp_attention.json

On CPU (gloo, fp32, tiny shapes) it runs too, for the tests: torch's engine then fails (its ring has no CPU SDPA op)
and is recorded as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from modeling import attention_engines, context_parallel, packed
from verification.provenance import provenance

REFERENCE = "one_gpu"
ENGINES = ("ours_allgather_kv", "torch_cp_allgather", "torch_cp_alltoall")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GRADS = ("dq", "dk", "dv")

Step = Callable[[bool], tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]]
"""step(backward) → (out (1, H, T, D), (dq, dk, dv) or None): one forward, and with backward=True its backward."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    parser.add_argument("--lengths", default="32768,65536,131072", help="comma-separated total tokens")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=int, default=300, help="collective timeout (a hung rank fails the run)")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    args.engines = [x.strip() for x in args.engines.split(",") if x.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    if not args.lengths or min(args.lengths) <= 0:
        parser.error("--lengths needs positive lengths")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def check_lengths(lengths: list[int], world_size: int) -> None:
    """Both engines need every rank's shard whole: lengths a multiple of 2·world_size (torch's load balancer needs
    it; ours would pad, which would make the engines compute different sequences)."""
    bad = [n for n in lengths if n % (2 * world_size)]
    if bad:
        raise ValueError(f"lengths {bad} are not multiples of 2 x {world_size} ranks")


def local_index(length: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's positions in the sequence, the repo's zig-zag (modeling/context_parallel.py: chunks r and
    2·CP-1-r of 2·CP), which is torch's head-tail layout for one document."""
    _, per_rank = context_parallel.zigzag_indices([length], world_size)
    return torch.from_numpy(per_rank[rank])


def shard(full: torch.Tensor, rank: int, world_size: int, dim: int = 2) -> torch.Tensor:
    """This rank's zig-zag shard of `full` along `dim`."""
    index = local_index(full.shape[dim], rank, world_size).to(full.device)
    return full.index_select(dim, index)


def unshard(parts: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The inverse of `shard`: every rank's shard (rank order) back into sequence order."""
    world_size = len(parts)
    length = sum(p.shape[dim] for p in parts)
    order = torch.cat([local_index(length, r, world_size) for r in range(world_size)]).to(parts[0].device)
    return torch.cat(parts, dim=dim).index_select(dim, torch.argsort(order))


def summarize(times_ms: list[float]) -> dict:
    """Median, min, max (and the spread (max - min) / median in %) of repeated timings."""
    median = statistics.median(times_ms)
    low, high = min(times_ms), max(times_ms)
    spread = 100.0 * (high - low) / median if median > 0 else 0.0
    return {"median": median, "min": low, "max": high, "spread_pct": spread, "repeats": len(times_ms)}


def _ms(stats: dict | None) -> str:
    if stats is None:
        return "-"
    return f"{stats['median']:.2f} [{stats['min']:.2f}-{stats['max']:.2f}]"


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def format_table(results: list[dict]) -> str:
    """One row per (length, engine): fwd and fwd+bwd ms (median [min-max]), peak MiB, max |Δ| vs one GPU; below
    the table each failure's error and each engine's notes (kernel, GQA handling), once per distinct text."""
    header = ("tokens", "engine", "fwd ms", "fwd+bwd ms", "peak MiB", "|Δout|", "|Δdq|", "|Δdk|", "|Δdv|")
    rows, footnotes = [header], {}
    for r in results:
        if "error" in r:
            rows.append((str(r["length"]), r["engine"], "FAILED", "", "", "", "", "", ""))
            footnotes.setdefault(f"{r['engine']} failed: {r['error']}", None)
            continue
        diffs = r.get("max_abs_diff") or {}
        peak = "-" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
        cells = (_ms(r.get("fwd_ms")), _ms(r.get("fwd_bwd_ms")), peak, *(_diff(diffs.get(k)) for k in ("out", *GRADS)))
        rows.append((str(r["length"]), r["engine"], *cells))
        for key, value in (r.get("notes") or {}).items():
            footnotes.setdefault(f"{r['engine']} {key}: {value}", None)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [f"  {note}" for note in footnotes])


@dataclass
class Problem:
    """One document's full q (1, H, S, D), k / v (1, Hkv, S, D) and output gradient dout (1, H, S, D), identical on
    every rank (rank 0's, broadcast)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_problem(length: int, args: argparse.Namespace, device: torch.device, seed: int) -> Problem:
    generator = torch.Generator(device).manual_seed(seed)
    dtype = DTYPES[args.dtype]

    def randn(heads: int) -> torch.Tensor:
        t = torch.randn(1, heads, length, args.head_dim, generator=generator, device=device, dtype=dtype)
        dist.broadcast(t, 0)
        return t

    return Problem(randn(args.heads), randn(args.kv_heads), randn(args.kv_heads), randn(args.heads))


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _sdpa_step(q, k, v, dout, scale: float, repeat_kv: bool = False) -> Step:
    """Causal SDPA over (1, H, T, D) q and (1, Hkv, T, D) k, v (through `F.scaled_dot_product_attention` looked up
    at call time: torch's context_parallel patches it). repeat_kv: k and v repeated to H heads first."""

    def step(backward: bool):
        key, value = k, v
        if repeat_kv:
            key, value = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = {} if repeat_kv else {"enable_gqa": q.shape[1] != k.shape[1]}
        out = F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, **gqa)
        return out, (torch.autograd.grad(out, (q, k, v), dout) if backward else None)

    return step


def _gqa_sdpa_step(q, k, v, dout, scale: float) -> tuple[Step, str]:
    """`_sdpa_step` with SDPA's own GQA (enable_gqa=True), tried once (fwd+bwd); if that raises, k and v repeated
    to H heads. Returns the step and how GQA was done."""
    step = _sdpa_step(q, k, v, dout, scale)
    if q.shape[1] == k.shape[1]:
        return step, "none (as many kv heads as query heads)"
    try:
        step(True)
        return step, "native (enable_gqa=True)"
    except Exception as error:  # recorded; repeating k and v is what a user would do
        note = f"k, v repeated to {q.shape[1]} heads before SDPA; enable_gqa=True failed: {_error(error)}"
        return _sdpa_step(q, k, v, dout, scale, repeat_kv=True), note


@contextlib.contextmanager
def reference(problem: Problem) -> Iterator[tuple[Step, dict]]:
    q, k, v = _leaves(problem.q, problem.k, problem.v)
    step, gqa = _gqa_sdpa_step(q, k, v, problem.dout, problem.scale)
    yield step, {"gqa": gqa}


@contextlib.contextmanager
def ours(problem: Problem, rank: int, world_size: int, group: dist.ProcessGroup) -> Iterator[tuple[Step, dict]]:
    """The repo's CP attention as the model runs it: a one-document text pack through `shard_pack` and
    `context_shard`, then the registered attention function with the `ContextShard` as `packed_seqlens`."""
    length = problem.q.shape[2]
    zeros = np.zeros((1, length), dtype=np.int64)
    pack = {
        "sample_lengths": [length],
        "input_ids": torch.from_numpy(zeros),
        "mm_token_type_ids": torch.from_numpy(zeros),  # TEXT
        "shift_labels": torch.from_numpy(zeros),
        "position_ids": torch.from_numpy(np.broadcast_to(np.arange(length), (4, 1, length)).copy()),
    }
    sharded = context_parallel.shard_pack(pack, rank, world_size, pad_token_id=0, spatial_merge_size=2)
    cp_shard = context_parallel.context_shard(sharded, group, problem.q.device)
    q, k, v = _leaves(*(shard(t, rank, world_size) for t in (problem.q, problem.k, problem.v)))
    dout = shard(problem.dout, rank, world_size).transpose(1, 2)  # the function returns (1, T, H, D)

    def step(backward: bool):
        kwargs = {packed.PACK_KWARG: cp_shard}
        out, _ = packed.packed_attention_forward(None, q, k, v, None, scaling=problem.scale, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout) if backward else None
        return out.transpose(1, 2), grads

    varlen = q.device.type in packed.VARLEN_DEVICES and packed.varlen_dtype(q, k, v) is not None
    kernel = "sdpa per chunk (the path off CUDA or in fp32)"
    if varlen:
        kernel = attention_engines.fa2_kernel_name()  # context parallelism runs on the fa2 engine
    yield (
        step,
        {
            "kernel": kernel,
            "layout_is_zigzag": bool(torch.equal(cp_shard.local_index.cpu(), local_index(length, rank, world_size))),
        },
    )


@contextlib.contextmanager
def torch_cp(problem: Problem, rank: int, world_size: int, mesh, rotate: str) -> Iterator[tuple[Step, dict]]:
    """torch's context_parallel: q, k, v, dout as its buffers (sharded in place by its load balancer), SDPA inside
    the context with is_causal=True. Whatever the context leaves patched on an error (older torch versions restore
    nothing when the body raises) is put back, and so is what it leaves registered on any exit: its registry of
    patched functions keeps each SDPA wrapper, and through it the mesh and the process group, alive until the
    interpreter shuts down, where gloo's worker threads, still running, then abort the process."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    buffers = [t.detach().clone() for t in (problem.q, problem.k, problem.v, problem.dout)]
    sdpa, handlers = F.scaled_dot_product_attention, DTensor._op_dispatcher._custom_op_handlers
    registered = patched_functions_registry()
    wrappers_before = set(registered)
    notes: dict = {"rotate_method": rotate}
    try:
        with torch_context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
            q, k, v = (b.requires_grad_(True) for b in buffers[:3])
            dout = buffers[3]
            notes["layout_is_zigzag"] = bool(torch.equal(q.detach(), shard(problem.q, rank, world_size)))
            step, notes["gqa"] = _gqa_sdpa_step(q, k, v, dout, problem.scale)
            yield step, notes
    finally:
        F.scaled_dot_product_attention = sdpa
        DTensor._op_dispatcher._custom_op_handlers = handlers
        for wrapper in set(registered) - wrappers_before:
            del registered[wrapper]


def patched_functions_registry() -> dict:
    """torch's context_parallel's record of the functions it patched (wrapper -> original), never emptied; {} on a
    torch without one."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # torch before the module moved
        from torch.distributed.tensor.experimental import _attention
    return getattr(_attention, "_replaced_functions", {})


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:400]


class Clock:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(step: Step, args: argparse.Namespace, clock: Clock, device: torch.device) -> tuple[dict, tuple]:
    """fwd and fwd+bwd timings (per repeat the slowest rank), the peak memory one fwd+bwd adds, and that step's
    (out, grads)."""
    for _ in range(args.warmup):
        step(True)
    timings = {}
    for name, backward in (("fwd_ms", False), ("fwd_bwd_ms", True)):
        times = []
        for _ in range(args.repeats):
            clock.sync()
            dist.barrier()
            times.append(clock(lambda b=backward: step(b)))
        timings[name] = summarize(_max_over_ranks(times, device))
    clock.sync()
    peak = None
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    out, grads = step(True)
    if clock.cuda:
        clock.sync()
        peak = _max_over_ranks([(torch.cuda.max_memory_allocated(device) - base) / 2**20], device)[0]
    return {**timings, "peak_mib": peak}, (out, grads)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _attempt(what: Callable[[], dict], world_size: int) -> dict:
    """what() on every rank, or {"error", "traceback"} when it raised on any rank (every rank records it)."""
    error, row = None, {}
    try:
        row = what()
    except Exception as caught:  # recorded, and the run goes on
        error = f"{_error(caught)}\n{''.join(traceback.format_exception(caught)[-3:])}"
    errors: list = [None] * world_size
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    return {"error": failed[0].split("\n")[0], "traceback": failed[0]} if failed else row


def run_length(length: int, args: argparse.Namespace, env: dict) -> list[dict]:
    """The reference and every engine at one length; rows for the JSON."""
    rank, world_size, device, group, mesh = (env[k] for k in ("rank", "world_size", "device", "group", "mesh"))
    clock = Clock(device)
    problem = make_problem(length, args, device, args.seed + length)
    engines = {
        REFERENCE: lambda: reference(problem),
        "ours_allgather_kv": lambda: ours(problem, rank, world_size, group),
        "torch_cp_allgather": lambda: torch_cp(problem, rank, world_size, mesh, "allgather"),
        "torch_cp_alltoall": lambda: torch_cp(problem, rank, world_size, mesh, "alltoall"),
    }
    expected: list[torch.Tensor] = []

    def run(name: str) -> dict:
        with env["kernel"](), engines[name]() as (step, notes):
            stats, (out, grads) = measure(step, args, clock, device)
            got = [out.detach(), *(g.detach() for g in grads)]
            if name == REFERENCE:  # this rank's shard of the whole sequence's out, dq, dk, dv
                expected.extend(shard(t, rank, world_size) for t in got)
                magnitude = _max_over_ranks([t.float().abs().max().item() for t in expected], device)
                return {**stats, "max_abs": dict(zip(("out", *GRADS), magnitude)), "notes": notes}
            diffs = _max_over_ranks([_max_abs(a, b) for a, b in zip(got, expected)], device)
            return {**stats, "max_abs_diff": dict(zip(("out", *GRADS), diffs)), "notes": notes}

    rows = []
    for name in (REFERENCE, *args.engines):
        if name != REFERENCE and not expected:
            row = {"error": "no reference (one_gpu failed)"}
        else:
            row = _attempt(lambda n=name: run(n), world_size)
        rows.append({"length": length, "engine": name, **row})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print(format_table(rows[-1:]).splitlines()[2], flush=True)
    return rows


def environment(device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    def kernel():  # the SDPA engines (and the reference) on the flash kernel, as ours
        if device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

    world_size = dist.get_world_size()
    return {
        "rank": dist.get_rank(),
        "world_size": world_size,
        "device": device,
        "group": dist.group.WORLD,
        "mesh": init_device_mesh(device.type, (world_size,)),
        "kernel": kernel,
    }


def versions(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    try:
        import flash_attn

        flash = flash_attn.__version__
    except ImportError:
        flash = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "flash_attn": flash,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout_s), **init)
    try:
        if dist.get_world_size() < 2:
            raise SystemExit("launch with torchrun --nproc_per_node 2 (context parallelism needs >= 2 ranks)")
        check_lengths(args.lengths, dist.get_world_size())
        env = environment(device)
        rows = []
        for length in args.lengths:
            rows += run_length(length, args, env)
        if env["rank"] == 0:
            report = {
                "what": "context-parallel causal attention of one document, fwd and fwd+bwd",
                "provenance": provenance(),
                **versions(device),
                "world_size": env["world_size"],
                "args": {k: v for k, v in vars(args).items() if k != "out"},
                "results": rows,
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
            print(f"\n{format_table(rows)}\n\nwrote {args.out}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0
