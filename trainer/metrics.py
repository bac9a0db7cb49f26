"""Training FLOPs per pack (for MFU), the device's peak FLOP/s, and the metrics logger of the training loop.

The FLOP count is written once, in `pack_flops`; `FlopProfile.from_model` reads the numbers it needs from the model
once at start-up. Everything per step is host arithmetic on Python ints the collator already computed, so counting
never syncs with the device. `MetricsLogger` holds the loop's metric state (interval counts, each step's device
scalars, stopwatches), syncs once per log interval and writes the records; `summarize` writes the run's summary.json.

metrics.jsonl holds one training record per optimizer step, written at the log that ends its interval: the step's
own loss, gradient norm, learning rate and pack efficiency. The record of a logged step (every
`logging.every_steps`, each evaluation and checkpoint, and the last) also holds the interval's rates: tokens/s, step
time, MFU, peak memory. So a loss curve has every step whatever the log interval, and a run pays one device sync
per interval, not per step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from core.config import Config
from core.data_config import source_names
from core.families import FAMILIES
from lifecycle import run_files
from modeling import parts

log = logging.getLogger(__name__)

# Dense bf16 peak (no sparsity) per device name fragment, in FLOP/s; first match wins.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of `device`: the override (in TFLOP/s) when given, else the table; None when unknown
    (CPU or an unlisted GPU), in which case MFU is not reported."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for fragment, flops in PEAK_BF16_FLOPS if fragment in name), None)


# Attention backward is 2× its forward (dV = PᵀdO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q: four matmuls against QKᵀ
# and PV), so forward + backward = 3× forward whenever gradients flow through it.
ATTENTION_TRAIN_FACTOR = 3


def _matmul_params(module: nn.Module, moe_active_fraction: float = 1.0, trained_only: bool = False) -> int:
    """Weights that multiply every token once: parameters with ndim >= 2 outside embedding tables (lookups, not
    matmuls), LoRA adapters included; only the trainable ones if `trained_only`. Fused MoE expert banks (names
    containing 'experts') count only the routed fraction top_k / n_experts."""
    lookup = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    total = 0.0
    for name, param in module.named_parameters():
        if param.ndim < 2 or id(param) in lookup or (trained_only and not param.requires_grad):
            continue
        total += param.numel() * (moe_active_fraction if "experts" in name.split(".") else 1.0)
    return round(total)


def _trains(modules: Iterable[nn.Module]) -> bool:
    return any(p.requires_grad for m in modules for p in m.parameters())


def matmul_flops(params: int, trained_params: int, input_grads: bool, rows: int) -> float:
    """Training FLOPs of `rows` rows through weights of `params` parameters: 2·N forward, 2·N more for the input
    gradients when gradients flow back through them, 2·N_trained for the weight gradients of the trainable ones."""
    return 2.0 * rows * (params * (1 + int(input_grads)) + trained_params)


@dataclass(frozen=True)
class FlopProfile:
    """The per-token and per-document constants of one model, read once (see `pack_flops` for how they're used)."""

    llm_matmul_params: int  # active decoder weights per token, LoRA adapters included (embeddings, lm_head excluded)
    llm_trained_params: int  # the trainable ones among them: they also get a weight gradient
    llm_input_grads: bool  # gradients flow back through the LLM's layers (a decoder or an upstream weight trains)
    lm_head_params: int  # vocabulary x hidden width, per labelled row (the loss multiplies no other row)
    lm_head_trained_params: int  # lm_head_params if the lm_head trains, else 0
    llm_attn_layers: int  # softmax-attention decoder layers
    llm_attn_width: int  # num_attention_heads * head_dim
    llm_linear_layers: int  # Gated DeltaNet layers (Qwen3.5)
    llm_linear_state: int  # value heads * key head dim * value head dim of one Gated DeltaNet layer
    vit_matmul_params: int  # patch embedding + blocks, per patch
    vit_trained_params: int
    vit_input_grads: bool  # a ViT weight trains
    merger_matmul_params: int  # merger(s), per merged token
    merger_trained_params: int
    merger_input_grads: bool  # a merger or ViT weight trains
    vit_full_layers: int  # ViT blocks attending over a whole frame
    vit_window_layers: int  # ViT blocks attending within windows (Qwen2.5-VL)
    vit_attn_width: int  # ViT heads * head_dim
    spatial_merge_size: int
    window_merged: int  # window side in merged tokens (0 = no window attention)

    @classmethod
    def from_model(cls, model: nn.Module) -> FlopProfile:
        """Read the constants from a *ForConditionalGeneration model (LoRA adapters injected or not); what trains
        comes from requires_grad."""
        config = model.config
        text, vision = config.text_config, config.vision_config
        vision_tower, mergers = parts.vision_parts(model), parts.merger_parts(model)
        decoder = parts.inner_model(model).language_model
        moe_fraction = 1.0
        if getattr(text, "num_experts", None):
            moe_fraction = text.num_experts_per_tok / text.num_experts
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        family = FAMILIES[config.model_type]
        vit_width = getattr(vision, family.vit_width_key)
        depth = vision.depth
        window_layers = 0
        window_merged = 0
        if family.window_vision_model is not None:
            window_layers = depth - len(vision.fullatt_block_indexes)
            window_merged = vision.window_size // vision.spatial_merge_size // vision.patch_size

        vit_trains, merger_trains = _trains(vision_tower), _trains(mergers)
        decoder_trains = _trains([decoder])  # the lm_head is downstream of it all
        return cls(
            llm_matmul_params=_matmul_params(decoder, moe_fraction),
            llm_trained_params=_matmul_params(decoder, moe_fraction, trained_only=True),
            llm_input_grads=decoder_trains or vit_trains or merger_trains,
            lm_head_params=_matmul_params(model.lm_head),  # a tied one too: the lookup is free, the matmul is not
            lm_head_trained_params=_matmul_params(model.lm_head, trained_only=True),
            llm_attn_layers=sum(t == "full_attention" for t in layer_types),
            llm_attn_width=text.num_attention_heads * head_dim,
            llm_linear_layers=sum(t == "linear_attention" for t in layer_types),
            llm_linear_state=(
                getattr(text, "linear_num_value_heads", 0)
                * getattr(text, "linear_key_head_dim", 0)
                * getattr(text, "linear_value_head_dim", 0)
            ),
            vit_matmul_params=sum(_matmul_params(m) for m in vision_tower),
            vit_trained_params=sum(_matmul_params(m, trained_only=True) for m in vision_tower),
            vit_input_grads=vit_trains,
            merger_matmul_params=sum(_matmul_params(m) for m in mergers),
            merger_trained_params=sum(_matmul_params(m, trained_only=True) for m in mergers),
            merger_input_grads=merger_trains or vit_trains,
            vit_full_layers=depth - window_layers,
            vit_window_layers=window_layers,
            vit_attn_width=vit_width,
            spatial_merge_size=vision.spatial_merge_size,
            window_merged=window_merged,
        )


def _window_square_sum(side: int, window: int) -> int:
    """Σ over the windows along one axis of (window length)²: full windows of `window`, then the remainder."""
    full, rest = divmod(side, window)
    return full * window * window + rest * rest


def pack_flops(
    profile: FlopProfile, sample_lengths: Sequence[int], image_grids: Sequence[Sequence[int]], label_tokens: int
) -> float:
    """Training FLOPs of one pack: forward + backward of the LLM over its samples and of the ViT over its images.

    sample_lengths: sᵢ, the token count of each sample in the pack (text and image placeholder tokens).
    image_grids: (t, h, w) in patches for each image/video in the pack.
    label_tokens: the pack's labelled positions (`num_label_tokens`; the whole pack's under context parallelism).

    Derivation (a multiply-add is 2 FLOPs; what runs is counted, `matmul_flops`: every weight's forward; its input
    gradient, as much again, where gradients flow back through it — through a part when one of its weights or one
    upstream trains; its weight gradient, as much again, only if it trains. So a full fine-tune counts 6·N per token,
    frozen weights under trained ones 4·N, a frozen ViT below a frozen merger 2·N, and LoRA 4·N for the frozen base
    plus 6·r·(in + out) per adapted layer (the adapters are weights of the part, trainable). At a part's input the
    first weights' input gradient is counted though autograd skips it when nothing upstream trains (a trained merger's
    first layer above a frozen ViT; the ViT's patch embedding, whose input is pixels): a small over-count. Under LoRA
    the embeddings' output takes a gradient (modeling/lora.py), so the decoder's count is exact.
    Attention and the delta rule have no weights; their backward is 2× forward where gradients flow):
      * Decoder layers: a token multiplies each active weight once → 2·N FLOPs forward per token, N =
        `llm_matmul_params` (adapters included; MoE experts scaled by top_k/n_experts), over Σsᵢ tokens.
      * lm_head: 2·V·H forward per labelled row (`lm_head_params` = V·H): the loss multiplies only the rows that
        have a label (trainer/loss.py), so the others cost nothing and count nothing. A tied lm_head (Qwen2.5-VL-3B,
        Qwen3-VL-2B) is the embedding table, whose lookup is free, but its matmul runs: it counts the same. Its
        input gradient flows where the decoder's does; its weight gradient only if it trains.
      * LLM softmax attention, per layer and sample: QKᵀ and PV are each 2·H·d FLOPs per (query, key) pair over the
        s² pairs of a sample of length s, so forward = 4·H·d·s² — per document (Σ sᵢ², never T²), because packed
        samples do not attend to each other. Counted as a full square like verl and MegatronLM's formulas (the
        causal kernel skips about half, so this is the conventional, comparable count). Backward is 2× forward.
      * Gated DeltaNet (Qwen3.5 linear layers), per token and layer: state read Sᵀk, rank-1 update and output Sᵀq,
        each 2·Hv·dk·dv → 6·Hv·dk·dv forward (the recurrent form's work; chunked kernels trade more FLOPs for speed).
      * ViT: patch embedding + blocks multiply each of the P = Σ t·h·w patches (2·N_vit·P); the merger(s) run on
        P/m² merged tokens (2·N_merger·P/m²). Attention is bidirectional within a frame (s = h·w patches, t frames):
        forward 4·H·d·s² per layer; Qwen2.5-VL's window layers attend within windows of w×w merged tokens, i.e.
        per frame Σ_windows (a·b·m²)² = m⁴·(Σ_a a²)(Σ_b b²) over the window side lengths a (rows), b (columns).
    """
    p = profile
    tokens = sum(sample_lengths)
    document_pairs = sum(s * s for s in sample_lengths)
    llm_attn_factor = ATTENTION_TRAIN_FACTOR if p.llm_input_grads else 1
    vit_attn_factor = ATTENTION_TRAIN_FACTOR if p.vit_input_grads else 1
    flops = matmul_flops(p.llm_matmul_params, p.llm_trained_params, p.llm_input_grads, tokens)
    flops += matmul_flops(p.lm_head_params, p.lm_head_trained_params, p.llm_input_grads, label_tokens)
    flops += 4.0 * p.llm_attn_width * document_pairs * p.llm_attn_layers * llm_attn_factor
    flops += 6.0 * p.llm_linear_state * tokens * p.llm_linear_layers * llm_attn_factor

    m = p.spatial_merge_size
    for t, h, w in image_grids:
        patches = t * h * w
        flops += matmul_flops(p.vit_matmul_params, p.vit_trained_params, p.vit_input_grads, patches)
        merged = patches // (m * m)
        flops += matmul_flops(p.merger_matmul_params, p.merger_trained_params, p.merger_input_grads, merged)
        full_pairs = t * (h * w) ** 2
        flops += 4.0 * p.vit_attn_width * full_pairs * p.vit_full_layers * vit_attn_factor
        if p.vit_window_layers:
            rows = _window_square_sum(h // m, p.window_merged)
            cols = _window_square_sum(w // m, p.window_merged)
            window_pairs = t * m**4 * rows * cols
            flops += 4.0 * p.vit_attn_width * window_pairs * p.vit_window_layers * vit_attn_factor
    return flops


@dataclass
class IntervalCounts:
    """Host-side counts of one log interval (Python ints/floats from the collator: no device sync to gather)."""

    steps: int = 0
    tokens: int = 0  # real (non-pad) LLM tokens
    text_tokens: int = 0
    image_tokens: int = 0
    vision_patches: int = 0
    budget_tokens: int = 0  # packs x token budget: the denominator of pack efficiency
    flops: float = 0.0
    skipped_samples: int = 0  # samples whose image no longer loaded (stand-ins without labels, data/collate.py)
    source_samples: list[int] = field(default_factory=list)  # a mixture's samples per source (data.sources order)
    source_tokens: list[int] = field(default_factory=list)  # and their tokens

    def add_batch(self, batch: dict, budget: int, flops: float) -> None:
        self.tokens += batch["num_text_tokens"] + batch["num_image_tokens"] + batch.get("num_video_tokens", 0)
        self.text_tokens += batch["num_text_tokens"]
        self.image_tokens += batch["num_image_tokens"]
        self.vision_patches += batch["num_vision_patches"]
        self.budget_tokens += budget
        self.flops += flops
        self.skipped_samples += batch["num_skipped_samples"]
        if "num_source_samples" in batch:
            self.source_samples = _summed(self.source_samples, batch["num_source_samples"])
            self.source_tokens = _summed(self.source_tokens, batch["num_source_tokens"])


def _summed(total: list[int], counts: list[int]) -> list[int]:
    """Element-wise `total` + `counts` (an empty `total` counts as zeros)."""
    return [a + b for a, b in zip(total or [0] * len(counts), counts, strict=True)]


def source_metrics(names: list[str], samples: list[float], tokens: list[float]) -> dict[str, int]:
    """A mixture's interval counts as metrics: `source_samples/<name>` and `source_tokens/<name>`."""
    metrics = {f"source_samples/{name}": int(count) for name, count in zip(names, samples, strict=True)}
    return metrics | {f"source_tokens/{name}": int(count) for name, count in zip(names, tokens, strict=True)}


def interval_metrics(
    counts: IntervalCounts, elapsed_s: float, world_size: int, peak: float | None, peak_mem_gib: float | None
) -> dict[str, float | None]:
    """Per-GPU rates of one log interval; `counts` are summed over ranks, `elapsed_s` is wall time since the last
    log (after a device sync, so it covers the interval's whole device work)."""
    per_gpu_s = max(elapsed_s, 1e-9) * world_size
    return {
        "tokens_per_s_per_gpu": counts.tokens / per_gpu_s,
        "text_tokens_per_s": counts.text_tokens / per_gpu_s,
        "vision_tokens_per_s": counts.vision_patches / per_gpu_s,
        "step_time_s": elapsed_s / max(counts.steps, 1),
        "mfu": None if peak is None else counts.flops / per_gpu_s / peak,
        "peak_mem_gib": peak_mem_gib,
        "skipped_samples": counts.skipped_samples,
    }


@dataclass
class PendingStep:
    """One optimizer step waiting for the next log: its host values and its device scalars (not yet read)."""

    step: int
    lr: float
    tokens: int  # this rank's real tokens
    budget_tokens: int
    device_values: torch.Tensor  # fp32 (3,): summed CE, label count, gradient norm


class Stopwatch:
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


@dataclass
class TimedTotals:
    """This rank's throughput totals over the timed steps (after each launch's `logging.timing_warmup_steps`) of
    the whole run: saved in every checkpoint and restored on resume, so the summary's rates cover every launch."""

    steps: int = 0
    tokens: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0

    def plus(self, counts: IntervalCounts, seconds: float) -> TimedTotals:
        return TimedTotals(
            self.steps + counts.steps, self.tokens + counts.tokens, self.flops + counts.flops, self.seconds + seconds
        )


def pack_label_tokens(batch: dict) -> int:
    """The labelled positions of a host batch's whole pack (a context-parallel shard counts only its own in
    `num_label_tokens` and keeps the pack's in `cp_pack_label_tokens`)."""
    return batch.get("cp_pack_label_tokens", batch["num_label_tokens"])


def image_grids(batch: dict) -> list[tuple[int, int, int]]:
    """(t, h, w) of every image and video of a host batch (the collator's tensors: no device sync)."""
    grids = [batch.get("image_grid_thw"), batch.get("video_grid_thw")]
    return [tuple(row) for grid in grids if grid is not None for row in grid.tolist()]


class MetricsLogger:
    """The training loop's metrics, from one step to the run's summary.

    `record_step` (once per optimizer step, no host sync) counts the step's batches on the host and keeps its device
    scalars; `log` (when `due`, and before an evaluation or checkpoint) reduces the interval's steps over
    ranks with one all-reduce and one host read, and writes one record per step to metrics.jsonl, the trackers and
    the progress bar (module docstring); `paused()` stops the clocks around evaluation and checkpoints; `timed()` is
    what a checkpoint saves and `close()` the run's totals, for `summarize`. The first `logging.timing_warmup_steps`
    steps of each launch are left out of the timed totals (allocator growth, autotuning, compilation).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        cfg: Config,
        flop_profile: FlopProfile,
        run_dir: Path,
        start_step: int,
        timed_before: TimedTotals,
    ):
        self.accelerator, self.cfg, self.flop_profile, self.run_dir = accelerator, cfg, flop_profile, run_dir
        self.timed_before = timed_before
        device = accelerator.device
        self.peak = peak_flops(device, cfg.logging.peak_tflops)
        if accelerator.is_main_process:
            run_files.keep_metrics_through(run_dir, start_step)
        self.counts, self.timed_counts = IntervalCounts(), IntervalCounts()
        self.source_names = source_names(cfg.data.sources) if cfg.data.sources else []
        self.pending: list[PendingStep] = []
        self.interval_clock, self.timed_clock = Stopwatch(device), Stopwatch(device)
        self.warmup_end = start_step + cfg.logging.timing_warmup_steps
        self.interval_clock.start()
        if self.warmup_end == start_step:
            self.timed_clock.start()
        self.bar = tqdm(
            total=cfg.train.max_steps,
            initial=start_step,
            desc="train",
            unit="step",
            disable=not (accelerator.is_main_process and cfg.logging.progress_bar),
            dynamic_ncols=True,
        )

    def _budget(self, batch: dict) -> int:
        """Token budget of a batch: the pack's (packed), or its padded area (padded)."""
        return self.cfg.packing.max_tokens if self.cfg.packing.mode == "packed" else batch["input_ids"].numel()

    def record_step(
        self,
        step: int,
        lr: float,
        host_batches: list[dict],
        loss_sum: torch.Tensor,
        label_count: torch.Tensor,
        grad_norm: torch.Tensor,
    ) -> None:
        """Add optimizer step `step` and the learning rate it used: its host batches' counts and FLOPs, its device
        loss sum, label count and gradient norm (kept on the device until the next log: no sync)."""
        step_counts = IntervalCounts()
        for batch in host_batches:
            if batch.get("context_rank", 0):  # a pack split over a context group is counted once, by its rank 0
                continue
            flops = pack_flops(self.flop_profile, batch["sample_lengths"], image_grids(batch), pack_label_tokens(batch))
            step_counts.add_batch(batch, self._budget(batch), flops)
            self.counts.add_batch(batch, self._budget(batch), flops)
            if self.timed_clock.running:
                self.timed_counts.add_batch(batch, self._budget(batch), flops)
        device_values = torch.stack([loss_sum.float(), label_count.float(), grad_norm.float()])
        self.pending.append(PendingStep(step, lr, step_counts.tokens, step_counts.budget_tokens, device_values))
        self.counts.steps += 1
        self.timed_counts.steps += self.timed_clock.running
        self.bar.update(1)
        if step == self.warmup_end:
            self.timed_clock.start()

    def due(self, step: int) -> bool:
        return step % self.cfg.logging.every_steps == 0 or step == self.cfg.train.max_steps

    def log(self) -> None:
        """Reduce the interval's steps over ranks (one all-reduce, one host read), emit one record per step (the
        last with the interval's rates), and start the next interval."""
        accelerator, counts, pending = self.accelerator, self.counts, self.pending
        world = accelerator.num_processes
        elapsed = self.interval_clock.lap()
        n = len(pending)
        host = [
            *(value for p in pending for value in (p.tokens, p.budget_tokens)),
            counts.tokens,
            counts.text_tokens,
            counts.image_tokens,
            counts.vision_patches,
            counts.budget_tokens,
            counts.flops,
            counts.skipped_samples,
        ]
        sources = len(self.source_names)
        host += (counts.source_samples or [0] * sources) + (counts.source_tokens or [0] * sources)
        device_values = torch.stack([p.device_values for p in pending]).double().flatten()
        host_values = torch.tensor(host, dtype=torch.float64).to(accelerator.device)
        values = accelerator.reduce(torch.cat([device_values, host_values]), reduction="sum").tolist()
        step_device, step_host, interval = values[: 3 * n], values[3 * n : 5 * n], values[5 * n : 5 * n + 7]
        per_source = values[5 * n + 7 :]
        tokens, text, image, patches, budget, flops, skipped = interval
        summed = IntervalCounts(
            counts.steps, int(tokens), int(text), int(image), int(patches), int(budget), flops, int(skipped)
        )
        peak_mem = (
            torch.cuda.max_memory_allocated(accelerator.device) / 2**30 if accelerator.device.type == "cuda" else None
        )
        for i, p in enumerate(pending):
            loss_sum, labels, grad_norm_sum = step_device[3 * i : 3 * i + 3]
            step_tokens, step_budget = step_host[2 * i : 2 * i + 2]
            record = {
                "step": p.step,
                "lr": p.lr,
                "loss": loss_sum / max(labels, 1.0),
                "grad_norm": grad_norm_sum / world,  # every rank holds the global norm
                "pack_efficiency": step_tokens / step_budget if step_budget else math.nan,
            }
            if i == n - 1:
                record.update(interval_metrics(summed, elapsed, world, self.peak, peak_mem))
                record.update(source_metrics(self.source_names, per_source[:sources], per_source[sources:]))
            self.emit(record)
        self.counts = IntervalCounts()
        self.pending = []

    def emit(self, record: dict) -> None:
        """Write one record to metrics.jsonl and the trackers (main process) and refresh the progress bar."""
        if not self.accelerator.is_main_process:
            return
        run_files.append_metrics(self.run_dir, record)
        self.accelerator.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])
        if "tokens_per_s_per_gpu" in record:
            postfix = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s_per_gpu']:.0f}"}
            self.bar.set_postfix(**postfix, refresh=False)
        log.info("%s", " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

    @contextlib.contextmanager
    def paused(self):
        """Stop the running clocks for work that is not training (eval, checkpoints) and restart them after."""
        running = [clock for clock in (self.interval_clock, self.timed_clock) if clock.running]
        for clock in running:
            clock.stop()
        yield
        for clock in running:
            clock.start()

    def timed(self) -> TimedTotals:
        """The run's timed totals so far (for a checkpoint)."""
        return self.timed_before.plus(self.timed_counts, self.timed_clock.elapsed)

    def close(self) -> TimedTotals:
        """Close the progress bar, stop timing; the run's timed totals."""
        self.bar.close()
        return self.timed_before.plus(self.timed_counts, self.timed_clock.stop())


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
    peak = peak_flops(accelerator.device, cfg.logging.peak_tflops)
    records = run_files.read_metrics(run_dir) if accelerator.is_main_process else []
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
        "timed_seconds": timed.seconds,  # this rank's wall time of the timed steps (step time = this / timed_steps)
        "peak_mem_gib": max(peaks) if peaks else None,
        "samples_skipped_at_load": sum(r.get("skipped_samples", 0) for r in train_records),
        "num_processes": world,
        "fused_rope": fused_rope,
        "run_dir": str(run_dir),
        "wandb_dir": None if wandb_dir is None else str(wandb_dir),
        "export_dir": None if export_dir is None else str(export_dir),
    }
    if accelerator.is_main_process:
        run_files.write_summary(run_dir, summary)
    return summary
