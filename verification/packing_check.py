"""Packed vs per-sample forward+backward: the check behind scripts/verify_packing.py and tests/test_packed_forward.py.

The reference runs each sample alone through transformers' own path (sdpa, positions computed by the model itself,
original Gated DeltaNet); the packed run concatenates the samples into one row with per-sample positions from
`get_rope_index` and goes through modeling/packed.py. Both use the same loss, the sum of per-token cross entropy
over label tokens divided by the total label count of all samples, so the per-sample losses and gradients summed
over samples are directly comparable with the packed ones.

Low precision (bf16/fp16): an fp32 copy of the model runs both sides again, splitting packed − per-sample into
  (packed − packed fp32) + (packed fp32 − per-sample fp32) + (per-sample fp32 − per-sample).
The middle term is what packing itself changes on the code paths the fp32 copy takes: it is judged at the fp32
tolerance, however large the rounding. The outer terms are each run's own rounding, and a gradient may differ by a
multiple of them (`Difference.failed`): the per-sample run's always; the packed run's only where the low-precision
pack takes the same kernels as its fp32 copy (off `modeling.packed.VARLEN_DEVICES`). On CUDA the low-precision pack
takes the varlen kernel and the fp32 copy per-segment SDPA, so there the packed run's error against its copy could
hide a leak in the varlen kernel's backward and is not used; logits and loss are judged against the per-sample run's
rounding only everywhere. Why the packed run's rounding matters on the CPU: a kernel that accumulates a parameter
gradient over all tokens of one call in low precision rounds the pack's sum worse than each sample's shorter one.
PyTorch's CPU LayerNorm backward does so for its weight and bias in bf16 (the Qwen2-VL, Qwen3-VL and Qwen3.5 vision
towers): its error grows with the number of patches summed, so a pack's is far larger than a sample's even with
identical norm inputs and output gradients on both sides (docs/numerics.md). On the H200 these gradients pass with
the per-sample run's rounding alone.

MoE models: the per-sample run's top-k expert choices are recorded and replayed in the packed run (and in the fp32
copy's runs), see verification/routing_pin.py. A near-tie token that the packed run's rounding would send to another
expert would otherwise move its whole gradient between experts; the report counts those choices (`routing_flips`)
instead. Routing weights still come from each run's own router logits, so router gradients and any leak into the
hidden states are still compared.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from data.collate import label_rows
from data.positions import takes_second_per_grid_ts
from data.processing import IGNORE_INDEX
from data.video import uses_timestamps
from modeling.packed import VARLEN_DEVICES, attention_implementation, packed_model_inputs
from verification.routing_pin import PinnedRouting

GRAD_SCALE_FLOOR = 1e-3
"""A gradient is judged against at least this fraction of the model's largest gradient: a parameter whose gradient
is a near-cancelling sum over many tokens (e.g. Gated DeltaNet's A_log) carries the rounding noise of its terms,
not of its tiny total. A leak across samples still moves the large gradients far beyond tolerance."""

RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
"""max |Δ| / max |reference| allowed per quantity. fp32: summation-order noise only; it also judges a low-precision
model's fp32 copy (module docstring). bf16/fp16: 8 (11) mantissa bits; on CPU, where both sides run SDPA, the
per-sample gradients summed in bf16 already differ from the packed ones at the 1e-2 level, and on the GPU the varlen
kernel rounds differently from sdpa (docs/numerics.md). In low precision a quantity beyond this still passes when
it is within ROUNDING_FACTOR of the runs' own rounding errors (see `Difference.failed`)."""

ROUNDING_FACTOR = 3.0
"""Low precision: packed may differ from per-sample by up to this multiple of a run's own error against the same run
of an fp32 copy of the model. If the fp32 copy's packed and per-sample runs agree (checked at the fp32 tolerance),
|packed − per-sample| ≤ the sum of the two runs' errors ≤ 2× the larger. MoE routing is pinned to the per-sample
choices in every run, so these errors are arithmetic rounding, not expert flips."""


@dataclass
class Sample:
    """One training sample, unpacked.

    input_ids: long (S,); shift_labels: long (S,), target of position t or -100 (the last position is -100);
    mm_token_type_ids: int (S,), 0 text / 1 image / 2 video; pixel_values: float (P, C·tp·p·p) or None;
    image_grid_thw: long (n_images, 3) or None; pixel_values_videos / video_grid_thw likewise for videos;
    second_per_grid_ts: float (n_videos,) or None (read by Qwen2.5-VL's positions only).
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Difference:
    """max |packed − reference| of one quantity and the scale it is judged against (max |reference|).

    In low precision also the runs' own rounding errors against the same runs of an fp32 copy of the model:
    own_rounding = max |per-sample − per-sample fp32|; packed_rounding = max |packed − packed fp32|, gradients only,
    and only where both packed runs take the same kernels (0 otherwise; module docstring).
    Logits and loss are not excused by the packed run's rounding: a token's logits involve no sum over the pack, so
    a packed run with worse logits is wrong (e.g. a kernel taken only in low precision that leaks), not less exact.
    """

    name: str
    max_abs: float
    scale: float
    own_rounding: float = 0.0
    packed_rounding: float = 0.0

    @property
    def relative(self) -> float:
        return self.max_abs / self.scale if self.scale > 0 else (0.0 if self.max_abs == 0 else math.inf)

    @property
    def rounding(self) -> float:
        """The larger of the two runs' own rounding errors."""
        return max(self.own_rounding, self.packed_rounding)

    def failed(self, rtol: float) -> bool:
        return self.relative > rtol and self.max_abs > ROUNDING_FACTOR * self.rounding


@dataclass
class PackingReport:
    """Differences of logits, loss and each parameter gradient; `worst_grad` is the largest relative one.

    Low precision: `exact` holds the same differences between the fp32 copy's packed and per-sample runs (empty for
    an fp32 model), judged at the fp32 tolerance whatever `rtol` the low-precision ones get.

    MoE models: `routing_choices` token choices (tokens × routers) of the packed run were pinned to the per-sample
    ones; `routing_flips` of them would have chosen a different top-k set (0 and 0 without routers). Flips are
    reported, not judged: they are rounding near ties in low precision, and a leak shows in logits and gradients.
    """

    logits: Difference
    loss: Difference
    grads: list[Difference] = field(default_factory=list)
    missing_grads: list[str] = field(default_factory=list)
    routing_flips: int = 0
    routing_choices: int = 0
    exact: list[Difference] = field(default_factory=list)

    @property
    def worst_grad(self) -> Difference:
        return max(self.grads, key=lambda d: d.relative)

    def failures(self, rtol: float) -> list[str]:
        """Quantities beyond `rtol` (relative to their scale) and not within ROUNDING_FACTOR × the runs' rounding,
        fp32-copy quantities beyond the fp32 tolerance, and gradients present on one side only."""
        beyond = [d for d in (self.logits, self.loss, *self.grads) if d.failed(rtol)]
        bad = [
            f"{d.name}: max|Δ| {d.max_abs:.3g} > {rtol:g} × {d.scale:.3g} and > {ROUNDING_FACTOR:g} × rounding "
            f"{d.rounding:.3g} (per-sample {d.own_rounding:.3g}, packed {d.packed_rounding:.3g})"
            for d in beyond
        ]
        exact_rtol = RELATIVE_TOLERANCE[torch.float32]
        bad += [
            f"fp32 copy, {d.name}: max|Δ| {d.max_abs:.3g} > {exact_rtol:g} × {d.scale:.3g}"
            for d in self.exact
            if d.failed(exact_rtol)
        ]
        return bad + [f"{name}: gradient on one side only" for name in self.missing_grads]


def sample_position_ids(model: torch.nn.Module, sample: Sample) -> torch.Tensor:
    """long (4, 1, S): row 0 text positions 0..S-1, rows 1-3 the model's mRoPE positions of this sample alone."""
    input_ids = sample.input_ids[None]
    rope, _ = model.model.get_rope_index(
        input_ids,
        sample.mm_token_type_ids[None],
        image_grid_thw=sample.image_grid_thw,
        video_grid_thw=sample.video_grid_thw,
        **_video_timing(model, sample),
    )
    text = torch.arange(len(sample), device=input_ids.device).view(1, 1, -1)
    return torch.cat([text, rope.to(text.dtype)], dim=0)


def pack_samples(model: torch.nn.Module, samples: list[Sample]) -> dict:
    """The packed batch of docs/architecture.md for `samples` (the model-side keys; a reference collation)."""
    lengths = [len(s) for s in samples]
    device = samples[0].input_ids.device
    with_images = [s for s in samples if s.image_grid_thw is not None]
    with_videos = [s for s in samples if s.video_grid_thw is not None]

    def videos(name: str):
        return torch.cat([getattr(s, name) for s in with_videos]) if with_videos else None

    shift_labels = torch.cat([s.shift_labels for s in samples])[None]
    return {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "position_ids": torch.cat([sample_position_ids(model, s) for s in samples], dim=2),
        "shift_labels": shift_labels,
        "label_rows": label_rows(shift_labels.cpu()).to(device),
        "mm_token_type_ids": torch.cat([s.mm_token_type_ids for s in samples])[None],
        "pixel_values": torch.cat([s.pixel_values for s in with_images]) if with_images else None,
        "image_grid_thw": torch.cat([s.image_grid_thw for s in with_images]) if with_images else None,
        "pixel_values_videos": videos("pixel_values_videos"),
        "video_grid_thw": videos("video_grid_thw"),
        "second_per_grid_ts": videos("second_per_grid_ts"),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device),
        "max_seqlen": max(lengths),
        "sample_lengths": lengths,
    }


def _video_timing(model: torch.nn.Module, sample: Sample) -> dict:
    """{"second_per_grid_ts": …} for a family whose positions read it (Qwen2.5-VL), else {}."""
    if sample.video_grid_thw is None or not takes_second_per_grid_ts(model.model):
        return {}
    return {"second_per_grid_ts": sample.second_per_grid_ts}


def _sample_inputs(model: torch.nn.Module, sample: Sample) -> dict:
    """Model kwargs for one sample alone (B=1); positions are left to the model's own get_rope_index."""
    inputs = {"input_ids": sample.input_ids[None], "mm_token_type_ids": sample.mm_token_type_ids[None]}
    if sample.image_grid_thw is not None:
        inputs.update(pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw)
    if sample.video_grid_thw is not None:
        inputs.update(pixel_values_videos=sample.pixel_values_videos, video_grid_thw=sample.video_grid_thw)
        inputs.update(_video_timing(model, sample))
    return inputs


def label_loss(logits: torch.Tensor, shift_labels: torch.Tensor, num_label_tokens: int) -> torch.Tensor:
    """Σ cross entropy over label tokens / num_label_tokens. logits (B,S,V), shift_labels long (B,S) → fp32 ()."""
    token_loss = F.cross_entropy(
        logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return token_loss / max(num_label_tokens, 1)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _difference(name: str, packed: torch.Tensor, reference: torch.Tensor) -> Difference:
    packed, reference = packed.detach().double(), reference.detach().double()
    return Difference(name, (packed - reference).abs().max().item(), reference.abs().max().item())


def _split_visuals(batch: dict, kind: str, token_type: int, merge: int) -> list[tuple[slice, slice]]:
    """Per sample of a packed batch, (grid rows, patch rows) of its images (kind "image") or videos ("video"),
    assigned in order by the sample's token count of that type (t·h·w / merge² tokens each)."""
    grids = batch.get(f"{kind}_grid_thw")
    grids = [] if grids is None else grids.tolist()
    spans, index, patch = [], 0, 0
    for start, end in itertools.pairwise(batch["cu_seqlens"].tolist()):
        tokens = int((batch["mm_token_type_ids"][0, start:end] == token_type).sum())
        first_index, first_patch = index, patch
        while tokens > 0 and index < len(grids):
            t, h, w = grids[index]
            tokens -= t * h * w // merge**2
            index, patch = index + 1, patch + t * h * w
        if tokens != 0:
            raise ValueError(f"sample [{start}, {end}) has {kind} tokens that do not match {kind}_grid_thw.")
        spans.append((slice(first_index, index), slice(first_patch, patch)))
    if index != len(grids):
        raise ValueError(f"{len(grids) - index} {kind}s of the batch belong to no sample's {kind} tokens.")
    return spans


def samples_from_batch(batch: dict, spatial_merge_size: int) -> list[Sample]:
    """Split a packed batch (docs/architecture.md) back into its samples, images and videos assigned by their token
    counts."""
    images = _split_visuals(batch, "image", 1, spatial_merge_size)
    videos = _split_visuals(batch, "video", 2, spatial_merge_size)
    samples = []
    for (start, end), (grid, patches), (video, video_patches) in zip(
        itertools.pairwise(batch["cu_seqlens"].tolist()), images, videos, strict=True
    ):
        has_images, has_videos = grid.stop > grid.start, video.stop > video.start
        seconds = batch.get("second_per_grid_ts")
        samples.append(
            Sample(
                input_ids=batch["input_ids"][0, start:end],
                shift_labels=batch["shift_labels"][0, start:end],
                mm_token_type_ids=batch["mm_token_type_ids"][0, start:end],
                pixel_values=batch["pixel_values"][patches] if has_images else None,
                image_grid_thw=batch["image_grid_thw"][grid] if has_images else None,
                pixel_values_videos=batch["pixel_values_videos"][video_patches] if has_videos else None,
                video_grid_thw=batch["video_grid_thw"][video] if has_videos else None,
                second_per_grid_ts=seconds[video] if has_videos and seconds is not None else None,
            )
        )
    return samples


@dataclass
class _Run:
    """One forward+backward: logits (T, V) of all samples in pack order, fp32 loss (), gradients by parameter name."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def compare_packed_to_per_sample(
    model: torch.nn.Module, samples: list[Sample], batch: dict | None = None
) -> PackingReport:
    """Forward+backward of `samples` one by one (reference) and as one pack; the differences.

    `batch` is the packed batch of these samples (e.g. from the data pipeline, so its positions are checked too);
    by default `pack_samples` builds it. `model` must have packed forward enabled
    (modeling.packed.enable_packed_forward). Its gradients are cleared before each run and left holding the
    packed run's. All tensors are on the model's device. MoE routing of the packed run is pinned to the per-sample
    run's choices (module docstring). A bf16/fp16 model is also run as an fp32 copy (module docstring). fp32 work
    runs in IEEE fp32 whatever the process's TF32 settings (`ieee_fp32`).
    """
    with ieee_fp32():
        return _compare(model, samples, batch)


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls and cuDNN convolutions in IEEE fp32, not TF32, their settings restored afterwards (PyTorch's
    `fp32_precision` API; inside, reading the legacy `torch.backends.cudnn.allow_tf32` raises, as PyTorch does for any
    mix of the two APIs). The fp32 runs are judged at the fp32 tolerance, but cuDNN convolves fp32 in TF32 by
    default, a 10-bit mantissa: in TF32 the vision patch embedding's weight gradient (a sum over every patch) of a
    bf16 model's fp32 copy differs between packed and per-sample runs by more than that tolerance; in IEEE fp32 it
    passes (docs/numerics.md)."""
    backends = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    saved = [backend.fp32_precision for backend in backends]
    try:
        for backend in backends:
            backend.fp32_precision = "ieee"
        yield
    finally:
        for backend, precision in zip(backends, saved, strict=True):
            backend.fp32_precision = precision


def _compare(model: torch.nn.Module, samples: list[Sample], batch: dict | None) -> PackingReport:
    num_labels = int(sum((s.shift_labels != IGNORE_INDEX).sum() for s in samples))
    batch = pack_samples(model, samples) if batch is None else batch
    routing = PinnedRouting()
    with routing.recording(model):
        reference = _per_sample_run(model, samples, num_labels, routing)
    packed, flips = _packed_run(model, batch, num_labels, routing)

    report = _report(packed, reference)
    report.routing_flips, report.routing_choices = flips.flips, flips.choices
    if next(model.parameters()).dtype != torch.float32:
        _add_fp32_copy(report, model, samples, batch, num_labels, (packed, reference), routing)
    return report


def _report(packed: _Run, reference: _Run) -> PackingReport:
    """Differences of `packed` from `reference`; a gradient's scale is at least GRAD_SCALE_FLOOR × the largest."""
    report = PackingReport(
        logits=_difference("logits", packed.logits, reference.logits),
        loss=_difference("loss", packed.loss, reference.loss),
    )
    floor = GRAD_SCALE_FLOOR * max((g.abs().max().item() for g in reference.grads.values()), default=0.0)
    for name in sorted(reference.grads.keys() | packed.grads.keys()):
        if name in reference.grads and name in packed.grads:
            difference = _difference(name, packed.grads[name], reference.grads[name])
            difference.scale = max(difference.scale, floor)
            report.grads.append(difference)
        else:
            report.missing_grads.append(name)
    return report


def _per_sample_run(model: torch.nn.Module, samples: list[Sample], num_labels: int, routing: PinnedRouting) -> _Run:
    """Each sample alone through transformers' own path; gradients summed over the samples.

    `routing.sample` is the running sample's index through its forward and backward, None afterwards.
    """
    model.zero_grad(set_to_none=True)
    logits_per_sample, total_loss = [], torch.zeros((), device=samples[0].input_ids.device)
    try:
        with attention_implementation(model, "sdpa"):
            for index, sample in enumerate(samples):
                routing.sample = index
                logits = model(**_sample_inputs(model, sample), use_cache=False).logits
                loss = label_loss(logits, sample.shift_labels[None], num_labels)
                loss.backward()
                logits_per_sample.append(logits.detach()[0])
                total_loss += loss.detach()
    finally:
        routing.sample = None
    return _Run(torch.cat(logits_per_sample), total_loss, _grads(model))


def _packed_run(model: torch.nn.Module, batch: dict, num_labels: int, routing: PinnedRouting):
    """The pack through modeling/packed.py, routing pinned to the recorded per-sample choices: (_Run, RoutingFlips)."""
    model.zero_grad(set_to_none=True)
    with routing.replaying(model) as flips:
        logits = model(**packed_model_inputs(model, batch), use_cache=False).logits
        loss = label_loss(logits, batch["shift_labels"], num_labels)
        loss.backward()
    return _Run(logits.detach()[0], loss.detach(), _grads(model)), flips


def _add_fp32_copy(report, model, samples, batch, num_labels, runs: tuple[_Run, _Run], routing) -> None:
    """Run both sides on an fp32 copy of the model (same expert choices): fill `report.exact` with its packed vs
    per-sample differences, and each low-precision Difference's `own_rounding` (per-sample run vs its fp32 copy) and,
    for gradients, `packed_rounding` (packed run vs its fp32 copy)."""
    packed, reference = runs
    exact_model = copy.deepcopy(model).float()
    with routing.replaying(exact_model):
        exact_reference = _per_sample_run(exact_model, samples, num_labels, routing)
    exact_packed, _ = _packed_run(exact_model, batch, num_labels, routing)
    del exact_model
    exact = _report(exact_packed, exact_reference)
    report.exact = [exact.logits, exact.loss, *exact.grads]
    report.missing_grads += [f"fp32 copy, {name}" for name in exact.missing_grads]

    def error(name: str, run: _Run, exact_run: _Run) -> float:
        if name not in exact_run.grads:  # reported above as missing from the fp32 copy
            return 0.0
        return _difference(name, run.grads[name], exact_run.grads[name]).max_abs

    # The packed run's own rounding may excuse its gradients only when its fp32 copy takes the same kernels; where
    # the low-precision pack takes the varlen kernel (the copy cannot: fp32), a leak in that kernel's backward
    # would count as the run's "rounding" and excuse itself.
    same_kernels = next(model.parameters()).device.type not in VARLEN_DEVICES
    report.logits.own_rounding = _difference("", reference.logits, exact_reference.logits).max_abs
    report.loss.own_rounding = _difference("", reference.loss, exact_reference.loss).max_abs
    for difference in report.grads:
        difference.own_rounding = error(difference.name, reference, exact_reference)
        if same_kernels:
            difference.packed_rounding = error(difference.name, packed, exact_packed)


def randomize_adapters(model: torch.nn.Module, seed: int = 0, scale: float = 0.1) -> None:
    """Draw every LoRA adapter's B (modeling/lora.py) from N(0, scale²): peft initialises B to zero, so at step 0 the
    adapters add nothing and a packed vs per-sample comparison would pass through them vacuously."""
    from modeling.lora import ADAPTER, lora_layers

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            weight = layer.lora_B[ADAPTER].weight
            weight.copy_(scale * torch.randn(weight.shape, generator=generator))


@dataclass(frozen=True)
class SampleSpec:
    """Layout of a synthetic sample: text lengths around images, then videos. `images` are (h, w) patch grids
    (t = 1); `videos` are (t, h, w) grids, laid out as the family's processor lays them out (Qwen3-VL/3.5: a
    two-token timestamp and vision_start/vision_end around each temporal patch)."""

    text_before: int
    images: tuple[tuple[int, int], ...] = ()
    text_between: int = 2
    text_after: int = 0
    videos: tuple[tuple[int, int, int], ...] = ()


def synthetic_sample(config, spec: SampleSpec, generator: torch.Generator) -> Sample:
    """A random sample laid out as `spec` for a model `config` (token ids and vision sizes from it).

    Text ids are drawn above the special ids; each image is vision_start, h·w/merge² image tokens, vision_end;
    each video likewise with t·h·w/merge² video tokens (per temporal patch, after a timestamp, for Qwen3-VL/3.5),
    0.5 s per temporal patch; pixel values are random (P, 3·tp·p·p); every position whose next token is text is
    a label.
    """
    vision = config.vision_config
    merge, patch, temporal = vision.spatial_merge_size, vision.patch_size, vision.temporal_patch_size
    vocab = config.text_config.vocab_size
    first_text_id = 1 + max(
        config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id
    )
    start, end = config.vision_start_token_id, config.vision_end_token_id

    def text(n: int) -> list[int]:
        return torch.randint(first_text_id, vocab, (n,), generator=generator).tolist()

    def pixels(patches: int) -> torch.Tensor:
        return torch.randn(patches, 3 * temporal * patch * patch, generator=generator)

    def visual(t: int, h: int, w: int, token_id: int, token_type: int) -> tuple[list[int], list[int]]:
        if h % merge or w % merge:
            raise ValueError(f"grid {h}x{w} must be a multiple of spatial_merge_size {merge}.")
        per_patch = h * w // merge**2
        if token_type == 2 and uses_timestamps(config):
            ids = []
            for _ in range(t):
                ids += [*text(2), start, *[token_id] * per_patch, end]
            return ids, [0 if i != token_id else token_type for i in ids]
        return [start, *[token_id] * (t * per_patch), end], [0, *[token_type] * (t * per_patch), 0]

    ids, types, image_pixels, grids = text(spec.text_before), [0] * spec.text_before, [], []
    for i, (h, w) in enumerate(spec.images):
        more_ids, more_types = visual(1, h, w, config.image_token_id, 1)
        between = spec.text_between if i + 1 < len(spec.images) or spec.videos else spec.text_after
        ids, types = ids + more_ids + text(between), types + more_types + [0] * between
        image_pixels.append(pixels(h * w))
        grids.append([1, h, w])
    video_pixels = []
    for i, (t, h, w) in enumerate(spec.videos):
        more_ids, more_types = visual(t, h, w, config.video_token_id, 2)
        between = spec.text_between if i + 1 < len(spec.videos) else spec.text_after
        ids, types = ids + more_ids + text(between), types + more_types + [0] * between
        video_pixels.append(pixels(t * h * w))
    input_ids = torch.tensor(ids)
    mm_types = torch.tensor(types, dtype=torch.int32)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    next_is_text = mm_types[1:] == 0
    labels[:-1] = torch.where(next_is_text, input_ids[1:], IGNORE_INDEX)
    return Sample(
        input_ids=input_ids,
        shift_labels=labels,
        mm_token_type_ids=mm_types,
        pixel_values=torch.cat(image_pixels) if image_pixels else None,
        image_grid_thw=torch.tensor(grids) if grids else None,
        pixel_values_videos=torch.cat(video_pixels) if video_pixels else None,
        video_grid_thw=torch.tensor(spec.videos) if spec.videos else None,
        second_per_grid_ts=torch.full((len(spec.videos),), 0.5, dtype=torch.float64) if spec.videos else None,
    )
