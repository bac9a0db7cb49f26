"""The training loop: one optimizer step = `train.grad_accum_steps` micro-batches, the loss normalised by the global
count of label tokens, no host sync inside a step, metrics synced once per log interval.

`TrainModule` puts the HF model and the loss in one forward, so DDP/FSDP2 see exactly one module call per
micro-step and every rank runs the vision tower twice every step, for images and for videos (a pack without one
or the other sends a dummy image through it in its place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from data.processing import IGNORE_INDEX
from training import metrics, packed
from training.checkpoint import Checkpointer, latest_checkpoint
from training.config import Config

log = logging.getLogger(__name__)
CE_CHUNK_ELEMENTS = 2**28  # fp32 logits live one chunk at a time: 1 GiB, whatever the vocabulary
PADDED_MODEL_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
)


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm stopped being finite: the weights are no longer worth saving."""


def mixed_precision(dtype: str) -> str:
    """accelerate's `mixed_precision` for `model.dtype`: weights stay fp32 (the optimizer's master copy), matmuls
    run in the recipe dtype under autocast."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}[dtype]


def _tensor_sum(value: Any) -> torch.Tensor | None:
    """Sum of every floating tensor in a (nested) model output; None when there is none."""
    if isinstance(value, torch.Tensor):
        return value.float().sum() if value.is_floating_point() else None
    if isinstance(value, dict) or hasattr(value, "to_tuple"):
        value = list(value.values())
    if isinstance(value, list | tuple):
        sums = [s for s in (_tensor_sum(v) for v in value) if s is not None]
        return torch.stack(sums).sum() if sums else None
    return None


def _chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """Σ over label tokens of -log softmax(logits)[label], in fp32, without a full fp32 copy of the logits.

    logits: (N, V) in the compute dtype (bf16 under autocast); labels: long (N,), IGNORE_INDEX where no target.
    Returns an fp32 scalar. Each chunk of `chunk_tokens` rows (default: CE_CHUNK_ELEMENTS / V) is upcast, reduced
    and dropped; backward recomputes it (activation checkpointing), so the fp32 log-probabilities of a 16k x 152k
    pack (~10 GB, plus as much again for their gradient) never exist at once.
    """
    chunk = chunk_tokens or max(1, CE_CHUNK_ELEMENTS // logits.shape[-1])
    if logits.shape[0] <= chunk:
        return _chunk_cross_entropy(logits, labels)
    sums = [
        checkpoint(_chunk_cross_entropy, part, part_labels, use_reentrant=False)
        for part, part_labels in zip(logits.split(chunk), labels.split(chunk))
    ]
    return torch.stack(sums).sum()


class TrainModule(nn.Module):
    """HF model + summed cross-entropy in one forward.

    forward(batch) -> fp32 scalar: Σ over label tokens of -log p(target), computed from the model's logits
    (1, T, V) (or (B, S, V) padded) and `shift_labels` by `summed_cross_entropy` (no HF loss, no full fp32 copy of
    the logits). The caller divides by the global label count.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        # FSDP2 auto-wrapping reads the layer classes to shard from the root module.
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        vision = model.config.vision_config
        merge = vision.spatial_merge_size
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        # The smallest valid image: one temporal step, merge x merge patches → one merged token.
        self.register_buffer("dummy_pixels", torch.zeros(merge * merge, patch_dim), persistent=False)
        self.register_buffer("dummy_grid", torch.tensor([[1, merge, merge]]), persistent=False)

    def model_inputs(self, batch: dict) -> dict:
        if "cu_seqlens" in batch:
            return packed.packed_model_inputs(self.model, batch)
        return {key: batch[key] for key in PADDED_MODEL_KEYS if batch.get(key) is not None}

    def forward(self, batch: dict) -> torch.Tensor:
        # The model calls the vision tower once for a pack's images and once for its videos. Every rank must make
        # the same calls (FSDP2 all-gathers per call, DDP needs every vision parameter used), so a pack without
        # images or without videos sends a dummy image through the tower in their place (contributing exactly 0).
        # Dummies run first, where a real image would: FSDP2 all-gathers unit by unit, in execution order.
        visual = self.model.model.visual
        dummies = [
            _tensor_sum(visual(self.dummy_pixels.to(visual.dtype), grid_thw=self.dummy_grid))
            for key in ("pixel_values", "pixel_values_videos")
            if batch.get(key) is None
        ]
        logits = self.model(**self.model_inputs(batch), use_cache=False).logits
        loss_sum = summed_cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten())
        return loss_sum + 0.0 * sum(dummies) if dummies else loss_sum


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to `device`; Python values (counts, lengths) stay on the host. Non-blocking: asynchronous from
    pinned memory (the Prefetcher pins on CUDA), so the host never waits for the copy."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def accumulate_gradients(
    accelerator: Accelerator, module: nn.Module, micro_batches: list[dict]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of one optimizer step's micro-batches (already on the device).

    The loss of micro-batch j is Σ_j CE / N, N = label tokens over all micro-batches of all ranks, so the
    accumulated gradient is exactly the gradient of the mean token loss of the global batch, however tokens are
    spread over micro-batches and ranks. N is counted on the device from `shift_labels` (a host-made tensor would
    need a blocking copy) and all-reduced once: no host sync. DDP/FSDP average gradients over ranks, so the loss is
    multiplied by the world size to turn that average back into the sum.
    Returns (summed CE over this rank's micro-batches, this rank's label count) as detached device scalars.
    """
    local_count = sum((b["shift_labels"] != IGNORE_INDEX).sum(dtype=torch.float32) for b in micro_batches)
    global_count = (
        accelerator.reduce(local_count.clone(), reduction="sum") if accelerator.num_processes > 1 else local_count
    )
    scale = accelerator.num_processes / global_count.clamp(min=1.0)
    loss_total = torch.zeros((), device=accelerator.device)
    for j, batch in enumerate(micro_batches):
        last = j == len(micro_batches) - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(module):
            loss_sum = module(batch)
            accelerator.backward(loss_sum * scale)
        loss_total += loss_sum.detach()
    return loss_total, local_count


def optimizer_step(
    accelerator: Accelerator,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    params: list[nn.Parameter],
    host_batches: list[dict],
    max_grad_norm: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over `host_batches` (its `train.grad_accum_steps` micro-batches, still on the host):
    copy to the device, forward + backward (`accumulate_gradients`), clip `params` (the trainable ones) to
    `max_grad_norm` (0: measure the norm, clip nothing), optimizer and scheduler step, gradients dropped. No host sync.
    Returns (summed CE over this rank's micro-batches, this rank's label count, the gradient norm before clipping)
    as detached fp32 device scalars.
    """
    micro = [to_device(b, accelerator.device) for b in host_batches]
    loss_sum, label_count = accumulate_gradients(accelerator, module, micro)
    grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if isinstance(grad_norm, DTensor):  # FSDP2: a replicated DTensor, which cannot be added to a plain tensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, label_count, grad_norm.detach().float()


@torch.no_grad()
def evaluate(accelerator: Accelerator, module: nn.Module, loader, max_batches: int, start_state: dict) -> float:
    """Mean token loss over the first `max_batches` held-out batches of every rank (one sync at the end); the
    loader is rewound to `start_state` first, so every evaluation sees the same batches."""
    loader.load_state_dict(start_state)
    module.eval()
    sums = torch.zeros(2, device=accelerator.device)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        sums[0] += module(to_device(batch, accelerator.device))
        sums[1] += batch["num_label_tokens"]
    module.train()
    sums = accelerator.reduce(sums, reduction="sum")
    return (sums[0] / sums[1].clamp(min=1.0)).item()


class _Stopwatch:
    """Wall time of device work, excluding pauses (eval, checkpoints); reading it syncs the device first."""

    def __init__(self, device: torch.device):
        self.device = device
        self.elapsed = 0.0
        self._start: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def running(self) -> bool:
        return self._start is not None

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        if self._start is not None:
            self.elapsed += time.perf_counter() - self._start
        self._start = None
        return self.elapsed

    def lap(self) -> float:
        """Seconds since the last lap (pauses excluded); the watch keeps running from zero."""
        elapsed = self.stop()
        self.elapsed = 0.0
        self.start()
        return elapsed


@contextlib.contextmanager
def _paused(*clocks: _Stopwatch):
    """Stop the running clocks for work that is not training (eval, checkpoints) and restart them after."""
    running = [clock for clock in clocks if clock.running]
    for clock in running:
        clock.stop()
    yield
    for clock in running:
        clock.start()


@dataclass
class TimedTotals:
    """This rank's throughput totals over the timed steps (after each launch's `logging.timing_warmup_steps`) of
    the whole run: saved in every checkpoint and restored on resume, so the summary's rates cover every launch."""

    steps: int = 0
    tokens: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0

    def plus(self, counts: metrics.IntervalCounts, seconds: float) -> TimedTotals:
        return TimedTotals(
            self.steps + counts.steps, self.tokens + counts.tokens, self.flops + counts.flops, self.seconds + seconds
        )


class Prefetcher:
    """Collates the next batches in a background thread, so the host's image processing overlaps the GPU's work
    (the step itself never syncs, but the launch queue is only so deep).

    Hands out host batches (pinned when `pin` is set) and remembers the loader position after each one it handed
    out: `state_dict()` is what was consumed, not what was prefetched, so a checkpoint resumes exactly.
    """

    def __init__(self, loader, depth: int = 2, pin: bool = False):
        self.loader = loader
        self.pin = pin
        self._state = loader.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                for batch in self.loader:
                    if self.pin:
                        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                    if not self._put((batch, self.loader.state_dict(), None)):
                        return
        except Exception as error:  # handed to the training thread, which raises it
            self._put((None, None, error))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict:
        batch, state, error = self._queue.get()
        if error is not None:
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict:
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def train(
    cfg: Config,
    accelerator: Accelerator,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    train_loader,
    eval_loader,
    flop_profile: metrics.FlopProfile,
    checkpointer: Checkpointer,
    run_dir: Path,
    start_step: int = 0,
    timed_before: TimedTotals | None = None,
) -> TimedTotals:
    """Run optimizer steps `start_step + 1 … train.max_steps`; log, evaluate and checkpoint on the way.
    Returns this rank's timed totals of the whole run: `timed_before` (restored from the checkpoint) plus this
    launch's."""
    tcfg, lcfg = cfg.train, cfg.logging
    device = accelerator.device
    world = accelerator.num_processes
    peak = metrics.peak_flops(device, lcfg.peak_tflops)
    budget_of = (
        (lambda b: cfg.packing.max_tokens) if cfg.packing.mode == "packed" else (lambda b: b["input_ids"].numel())
    )
    params = [p for p in module.parameters() if p.requires_grad]
    metrics_file = run_dir / "metrics.jsonl"
    if accelerator.is_main_process:
        keep_metrics_through(metrics_file, start_step)
    eval_start = eval_loader.state_dict() if eval_loader is not None else None
    timed_before = timed_before or TimedTotals()

    counts = metrics.IntervalCounts()
    loss_acc = torch.zeros((), device=device)
    labels_acc = torch.zeros((), device=device)
    grad_norm_acc = torch.zeros((), device=device)
    first_nonfinite_step = torch.zeros((), dtype=torch.long, device=device)  # 0 = none yet; set without a sync
    interval_clock, timed_clock = _Stopwatch(device), _Stopwatch(device)
    timed_counts = metrics.IntervalCounts()
    # The first steps of every launch (allocator growth, autotuning, compilation) are left out of the summary.
    warmup_end = start_step + lcfg.timing_warmup_steps
    interval_clock.start()
    if warmup_end == start_step:
        timed_clock.start()

    bar = tqdm(
        total=tcfg.max_steps,
        initial=start_step,
        desc="train",
        unit="step",
        disable=not (accelerator.is_main_process and lcfg.progress_bar),
        dynamic_ncols=True,
    )
    batches = Prefetcher(train_loader, pin=device.type == "cuda")
    module.train()
    for step in range(start_step + 1, tcfg.max_steps + 1):
        host_batches = [next(batches) for _ in range(tcfg.grad_accum_steps)]
        for b in host_batches:
            flops = metrics.pack_flops(flop_profile, b["sample_lengths"], _grids(b))
            counts.add_batch(b, budget_of(b), flops)
            if timed_clock.running:
                timed_counts.add_batch(b, budget_of(b), flops)
        lr = _llm_lr(optimizer)  # what this step really uses (the scheduler sets the next step's after it)
        loss_sum, label_count, grad_norm = optimizer_step(
            accelerator, module, optimizer, scheduler, params, host_batches, tcfg.max_grad_norm
        )
        loss_acc += loss_sum
        labels_acc += label_count
        grad_norm_acc += grad_norm
        nonfinite = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        first_nonfinite_step = torch.where(nonfinite & (first_nonfinite_step == 0), step, first_nonfinite_step)
        counts.steps += 1
        timed_counts.steps += timed_clock.running
        bar.update(1)

        if step == warmup_end:
            timed_clock.start()
        if step % lcfg.every_steps == 0 or step == tcfg.max_steps:
            _stop_if_nonfinite(accelerator, first_nonfinite_step, run_dir)
            record = _log_interval(
                accelerator, counts, loss_acc, labels_acc, grad_norm_acc, interval_clock, world, peak
            )
            record.update(step=step, lr=lr)
            _emit(accelerator, record, metrics_file, bar)
            counts = metrics.IntervalCounts()
            loss_acc.zero_()
            labels_acc.zero_()
            grad_norm_acc.zero_()
        do_eval = eval_loader is not None and tcfg.eval_every and step % tcfg.eval_every == 0
        do_save = cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < tcfg.max_steps
        if do_eval or do_save:
            with _paused(interval_clock, timed_clock):
                if do_eval:
                    eval_loss = evaluate(accelerator, module, eval_loader, tcfg.eval_batches, eval_start)
                    _emit(accelerator, {"step": step, "eval_loss": eval_loss}, metrics_file, bar)
                if do_save:
                    _stop_if_nonfinite(accelerator, first_nonfinite_step, run_dir)
                    timed = timed_before.plus(timed_counts, timed_clock.elapsed)
                    checkpointer.save(step, batches.state_dict(), dataclasses.asdict(timed))
    bar.close()
    batches.close()

    timed = timed_before.plus(timed_counts, timed_clock.stop())
    if eval_loader is not None and tcfg.eval_every and tcfg.max_steps % tcfg.eval_every:
        eval_loss = evaluate(accelerator, module, eval_loader, tcfg.eval_batches, eval_start)
        _emit(accelerator, {"step": tcfg.max_steps, "eval_loss": eval_loss}, metrics_file, bar)
    if cfg.checkpoint.save_final:
        checkpointer.save(tcfg.max_steps, batches.state_dict(), dataclasses.asdict(timed))
    return timed


def _llm_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the LLM's parameter group (of the first group when the LLM is frozen)."""
    groups = optimizer.param_groups
    return next((g["lr"] for g in groups if g.get("name") == "llm"), groups[0]["lr"])


def keep_metrics_through(metrics_file: Path, step: int) -> None:
    """Keep metrics.jsonl's records of steps <= `step` (all of them for a fresh run: none): a resume from the
    checkpoint at `step` logs the later steps again, and each step must appear once. A line torn by a kill is
    dropped too."""
    if not metrics_file.is_file():
        return
    kept = []
    for line in metrics_file.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
    write_atomically(metrics_file, "".join(kept))


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a kill leaves the old file or the new one, never a torn one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def _stop_if_nonfinite(accelerator: Accelerator, first_nonfinite_step: torch.Tensor, run_dir: Path) -> None:
    """Raise NonFiniteError when any rank saw a non-finite loss or gradient norm (one sync; called at log intervals
    and before every save, so no checkpoint or export ever holds NaN weights)."""
    worst = accelerator.reduce(first_nonfinite_step.clone(), reduction="sum").item()  # > 0 iff some rank saw one
    if worst == 0:
        return
    step = int(first_nonfinite_step.item()) or "?"
    last = latest_checkpoint(run_dir)
    raise NonFiniteError(
        f"the loss or gradient norm became non-finite at step {step}; training stopped without saving. "
        f"{'The last good checkpoint is ' + str(last) if last else 'No checkpoint was saved'}: lower train.lr or "
        "set train.max_grad_norm > 0, and check the data."
    )


def _grids(batch: dict) -> list[tuple[int, int, int]]:
    grids = [batch.get("image_grid_thw"), batch.get("video_grid_thw")]
    return [tuple(row) for grid in grids if grid is not None for row in grid.tolist()]  # host tensors (collator)


def _log_interval(
    accelerator: Accelerator,
    counts: metrics.IntervalCounts,
    loss_acc: torch.Tensor,
    labels_acc: torch.Tensor,
    grad_norm_acc: torch.Tensor,
    clock: _Stopwatch,
    world: int,
    peak: float | None,
) -> dict:
    """Reduce the interval's device and host counters over ranks in one all-reduce and one host read."""
    elapsed = clock.lap()
    host = torch.tensor(
        [
            counts.tokens,
            counts.text_tokens,
            counts.image_tokens,
            counts.vision_patches,
            counts.budget_tokens,
            counts.flops,
            counts.skipped_samples,
        ],
        dtype=torch.float64,
    )
    packed_stats = torch.cat([torch.stack([loss_acc, labels_acc, grad_norm_acc]).double(), host.to(accelerator.device)])
    values = accelerator.reduce(packed_stats, reduction="sum").tolist()  # the one sync of the interval
    loss_sum, labels, grad_norm_sum, tokens, text, image, patches, budget, flops, skipped = values
    summed = metrics.IntervalCounts(
        counts.steps, int(tokens), int(text), int(image), int(patches), int(budget), flops, int(skipped)
    )
    peak_mem = (
        torch.cuda.max_memory_allocated(accelerator.device) / 2**30 if accelerator.device.type == "cuda" else None
    )
    return {
        "loss": loss_sum / max(labels, 1.0),
        "grad_norm": grad_norm_sum / (world * max(counts.steps, 1)),
        **metrics.interval_metrics(summed, elapsed, world, peak, peak_mem),
    }


def json_line(record: dict) -> str:
    """`record` as strict JSON: a non-finite float (a rate over an empty interval) becomes null, never the NaN or
    Infinity tokens that json.dumps writes by default and JSON readers reject."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def _emit(accelerator: Accelerator, record: dict, metrics_file: Path, bar: tqdm) -> None:
    """Write one record to metrics.jsonl and the trackers (main process) and refresh the progress bar."""
    if not accelerator.is_main_process:
        return
    with metrics_file.open("a") as f:
        f.write(json_line(record) + "\n")
    accelerator.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])
    if "loss" in record:
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s_per_gpu']:.0f}", refresh=False)
    log.info("%s", " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))


def read_metrics(metrics_file: Path) -> list[dict]:
    if not metrics_file.is_file():
        return []
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def summarize(
    accelerator: Accelerator,
    cfg: Config,
    timed: TimedTotals,
    run_dir: Path,
    wandb_dir: Path | None,
    export_dir: Path | None,
    fused_rope: bool,
) -> dict:
    """Write `<run dir>/summary.json` (main process) and return it, for the whole run however many launches it
    took: losses, eval loss, peak memory and load-time skips from metrics.jsonl; mean rates over the timed steps
    (`timed`, this rank's totals; one all-reduce)."""
    world = accelerator.num_processes
    totals = torch.tensor([timed.tokens, timed.flops], dtype=torch.float64, device=accelerator.device)
    tokens, flops = accelerator.reduce(totals, reduction="sum").tolist()
    seconds = max(timed.seconds, 1e-9) * world
    peak = metrics.peak_flops(accelerator.device, cfg.logging.peak_tflops)
    records = read_metrics(run_dir / "metrics.jsonl") if accelerator.is_main_process else []
    train_records = [r for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    peaks = [r["peak_mem_gib"] for r in train_records if r.get("peak_mem_gib") is not None]
    summary = {
        "steps": train_records[-1]["step"] if train_records else cfg.train.max_steps,
        "loss_start": train_records[0]["loss"] if train_records else None,
        "loss_end": train_records[-1]["loss"] if train_records else None,
        "eval_loss": evals[-1] if evals else None,
        "tokens_per_s_per_gpu": tokens / seconds if timed.steps else None,
        "mfu": flops / seconds / peak if timed.steps and peak is not None else None,
        "timed_steps": timed.steps,
        "peak_mem_gib": max(peaks) if peaks else None,
        "samples_skipped_at_load": sum(r.get("skipped_samples", 0) for r in train_records),
        "num_processes": world,
        "fused_rope": fused_rope,
        "run_dir": str(run_dir),
        "wandb_dir": None if wandb_dir is None else str(wandb_dir),
        "export_dir": None if export_dir is None else str(export_dir),
    }
    if accelerator.is_main_process:
        write_atomically(run_dir / "summary.json", json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary
