"""Packed vs per-sample forward+backward: the check behind scripts/verify_packing.py and tests/test_packed_forward.py.

The reference runs each sample alone through transformers' own path (sdpa, positions computed by the model itself,
original Gated DeltaNet); the packed run concatenates the samples into one row with per-sample positions from
`get_rope_index` and goes through training/packed.py. Both use the same loss, the sum of per-token cross entropy
over label tokens divided by the total label count of all samples, so the per-sample losses and gradients summed
over samples are directly comparable with the packed ones.

MoE models: the per-sample run's top-k expert choices are recorded and replayed in the packed run (and in the fp32
copy that measures low-precision rounding), see training/routing_pin.py. A near-tie token that the packed run's
rounding would send to another expert would otherwise move its whole gradient between experts; the report counts
those choices (`routing_flips`) instead. Routing weights still come from each run's own router logits, so router
gradients and any leak into the hidden states are compared as before.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from training.packed import attention_implementation, packed_model_inputs
from training.routing_pin import PinnedRouting

IGNORE_INDEX = -100

GRAD_SCALE_FLOOR = 1e-3
"""A gradient is judged against at least this fraction of the model's largest gradient: a parameter whose gradient
is a near-cancelling sum over many tokens (e.g. Gated DeltaNet's A_log) carries the rounding noise of its terms,
not of its tiny total. A leak across samples still moves the large gradients far beyond tolerance."""

RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
"""max |Δ| / max |reference| allowed per quantity. fp32: summation-order noise only (measured ≤ 3e-6 on the tiny
models). bf16/fp16: 8 (11) mantissa bits; on CPU, where both sides run SDPA, the per-sample gradients summed in bf16
already differ from the packed ones by up to 1.7e-2 relative, and on the GPU the varlen kernel rounds differently
from sdpa. In low precision a quantity beyond this still passes when it is within ROUNDING_FACTOR of the model's own
rounding error (see `Difference.failed`)."""

ROUNDING_FACTOR = 3.0
"""Low precision: packed may differ from per-sample by up to this multiple of the per-sample run's own error against
an fp32 copy of the model. If packed is as accurate as per-sample, |packed − per-sample| ≤ 2× that error (triangle
inequality); a leak across samples moves far more quantities far further. MoE routing is pinned to the per-sample
choices in the packed run and in the fp32 copy, so both differences are arithmetic rounding, not expert flips."""


@dataclass
class Sample:
    """One training sample, unpacked.

    input_ids: long (S,); shift_labels: long (S,), target of position t or -100 (the last position is -100);
    mm_token_type_ids: int (S,), 0 text / 1 image; pixel_values: float (P, C·tp·p·p) or None;
    image_grid_thw: long (n_images, 3) or None.
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Difference:
    """max |packed − reference| of one quantity, the scale it is judged against (max |reference|) and, in low
    precision, the reference's own rounding error: max |reference − the same per-sample run in fp32|."""

    name: str
    max_abs: float
    scale: float
    own_rounding: float = 0.0

    @property
    def relative(self) -> float:
        return self.max_abs / self.scale if self.scale > 0 else (0.0 if self.max_abs == 0 else math.inf)

    def failed(self, rtol: float) -> bool:
        return self.relative > rtol and self.max_abs > ROUNDING_FACTOR * self.own_rounding


@dataclass
class PackingReport:
    """Differences of logits, loss and each parameter gradient; `worst_grad` is the largest relative one.

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

    @property
    def worst_grad(self) -> Difference:
        return max(self.grads, key=lambda d: d.relative)

    def failures(self, rtol: float) -> list[str]:
        """Quantities beyond `rtol` (relative to their scale), and gradients present on one side only."""
        beyond = [d for d in (self.logits, self.loss, *self.grads) if d.failed(rtol)]
        bad = [
            f"{d.name}: max|Δ| {d.max_abs:.3g} > {rtol:g} × {d.scale:.3g} and > {ROUNDING_FACTOR:g} × own rounding "
            f"{d.own_rounding:.3g}"
            for d in beyond
        ]
        return bad + [f"{name}: gradient on one side only" for name in self.missing_grads]


def sample_position_ids(model: torch.nn.Module, sample: Sample) -> torch.Tensor:
    """long (4, 1, S): row 0 text positions 0..S-1, rows 1-3 the model's mRoPE positions of this sample alone."""
    input_ids = sample.input_ids[None]
    rope, _ = model.model.get_rope_index(
        input_ids, sample.mm_token_type_ids[None], image_grid_thw=sample.image_grid_thw
    )
    text = torch.arange(len(sample), device=input_ids.device).view(1, 1, -1)
    return torch.cat([text, rope.to(text.dtype)], dim=0)


def pack_samples(model: torch.nn.Module, samples: list[Sample]) -> dict:
    """The packed batch of docs/architecture.md for `samples` (the model-side keys; a reference collation)."""
    lengths = [len(s) for s in samples]
    device = samples[0].input_ids.device
    with_images = [s for s in samples if s.image_grid_thw is not None]
    return {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "position_ids": torch.cat([sample_position_ids(model, s) for s in samples], dim=2),
        "shift_labels": torch.cat([s.shift_labels for s in samples])[None],
        "mm_token_type_ids": torch.cat([s.mm_token_type_ids for s in samples])[None],
        "pixel_values": torch.cat([s.pixel_values for s in with_images]) if with_images else None,
        "image_grid_thw": torch.cat([s.image_grid_thw for s in with_images]) if with_images else None,
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device),
        "max_seqlen": max(lengths),
        "sample_lengths": lengths,
    }


def _sample_inputs(sample: Sample) -> dict:
    """Model kwargs for one sample alone (B=1); positions are left to the model's own get_rope_index."""
    inputs = {"input_ids": sample.input_ids[None], "mm_token_type_ids": sample.mm_token_type_ids[None]}
    if sample.image_grid_thw is not None:
        inputs.update(pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw)
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


def samples_from_batch(batch: dict, spatial_merge_size: int) -> list[Sample]:
    """Split a packed batch (docs/architecture.md) back into its samples, images assigned by their token counts."""
    bounds = batch["cu_seqlens"].tolist()
    grids = batch.get("image_grid_thw")
    grids = [] if grids is None else grids.tolist()
    samples, image, patch = [], 0, 0
    for start, end in itertools.pairwise(bounds):
        types = batch["mm_token_type_ids"][0, start:end]
        image_tokens, first_image, first_patch = int((types == 1).sum()), image, patch
        while image_tokens > 0 and image < len(grids):
            t, h, w = grids[image]
            image_tokens -= t * h * w // spatial_merge_size**2
            image, patch = image + 1, patch + t * h * w
        if image_tokens != 0:
            raise ValueError(f"sample [{start}, {end}) has image tokens that do not match image_grid_thw.")
        has_images = image > first_image
        samples.append(
            Sample(
                input_ids=batch["input_ids"][0, start:end],
                shift_labels=batch["shift_labels"][0, start:end],
                mm_token_type_ids=types,
                pixel_values=batch["pixel_values"][first_patch:patch] if has_images else None,
                image_grid_thw=batch["image_grid_thw"][first_image:image] if has_images else None,
            )
        )
    if image != len(grids):
        raise ValueError(f"{len(grids) - image} images of the batch belong to no sample's image tokens.")
    return samples


def compare_packed_to_per_sample(
    model: torch.nn.Module, samples: list[Sample], batch: dict | None = None
) -> PackingReport:
    """Forward+backward of `samples` one by one (reference) and as one pack; the differences.

    `batch` is the packed batch of these samples (e.g. from the data pipeline, so its positions are checked too);
    by default `pack_samples` builds it. `model` must have packed forward enabled
    (training.packed.enable_packed_forward). Its gradients are cleared before each run and left holding the
    packed run's. All tensors are on the model's device. MoE routing of the packed run is pinned to the per-sample
    run's choices (module docstring).
    """
    num_labels = int(sum((s.shift_labels != IGNORE_INDEX).sum() for s in samples))
    routing = PinnedRouting()
    with routing.recording(model):
        reference_logits, reference_loss, reference_grads = _per_sample_run(model, samples, num_labels, routing)

    model.zero_grad(set_to_none=True)
    batch = pack_samples(model, samples) if batch is None else batch
    with routing.replaying(model) as flips:
        logits = model(**packed_model_inputs(model, batch), use_cache=False).logits
        loss = label_loss(logits, batch["shift_labels"], num_labels)
        loss.backward()
    packed_grads = _grads(model)

    report = PackingReport(
        logits=_difference("logits", logits[0], torch.cat(reference_logits)),
        loss=_difference("loss", loss, torch.as_tensor(reference_loss)),
        routing_flips=flips.flips,
        routing_choices=flips.choices,
    )
    floor = GRAD_SCALE_FLOOR * max((g.abs().max().item() for g in reference_grads.values()), default=0.0)
    for name in sorted(reference_grads.keys() | packed_grads.keys()):
        if name in reference_grads and name in packed_grads:
            difference = _difference(name, packed_grads[name], reference_grads[name])
            difference.scale = max(difference.scale, floor)
            report.grads.append(difference)
        else:
            report.missing_grads.append(name)
    if next(model.parameters()).dtype != torch.float32:
        reference = (reference_logits, reference_loss, reference_grads)
        _add_own_rounding(report, model, samples, num_labels, reference, routing)
    return report


def _per_sample_run(model: torch.nn.Module, samples: list[Sample], num_labels: int, routing: PinnedRouting):
    """Each sample alone through transformers' own path: (logits per sample, summed loss, gradients).

    `routing.sample` is the running sample's index through its forward and backward, None afterwards.
    """
    model.zero_grad(set_to_none=True)
    reference_logits, reference_loss = [], 0.0
    try:
        with attention_implementation(model, "sdpa"):
            for index, sample in enumerate(samples):
                routing.sample = index
                logits = model(**_sample_inputs(sample), use_cache=False).logits
                loss = label_loss(logits, sample.shift_labels[None], num_labels)
                loss.backward()
                reference_logits.append(logits.detach()[0])
                reference_loss += loss.detach()
    finally:
        routing.sample = None
    return reference_logits, reference_loss, _grads(model)


def _add_own_rounding(report, model, samples, num_labels, reference, routing: PinnedRouting) -> None:
    """Fill each Difference's `own_rounding`: the low-precision per-sample run (`reference`: logits, loss, grads)
    against an fp32 copy of the model that takes the same expert choices, so the error is arithmetic rounding only."""
    logits, loss, grads = reference
    exact = copy.deepcopy(model).float()
    with routing.replaying(exact):
        exact_logits, exact_loss, exact_grads = _per_sample_run(exact, samples, num_labels, routing)
    del exact
    report.logits.own_rounding = _difference("", torch.cat(logits), torch.cat(exact_logits)).max_abs
    report.loss.own_rounding = _difference("", torch.as_tensor(loss), torch.as_tensor(exact_loss)).max_abs
    for difference in report.grads:
        difference.own_rounding = _difference("", grads[difference.name], exact_grads[difference.name]).max_abs


@dataclass(frozen=True)
class SampleSpec:
    """Layout of a synthetic sample: text lengths around images. `images` are (h, w) patch grids (t = 1)."""

    text_before: int
    images: tuple[tuple[int, int], ...] = ()
    text_between: int = 2
    text_after: int = 0


def synthetic_sample(config, spec: SampleSpec, generator: torch.Generator) -> Sample:
    """A random sample laid out as `spec` for a model `config` (token ids and vision sizes from it).

    Text ids are drawn above the special ids; each image is vision_start, h·w/merge² image tokens, vision_end;
    pixel values are random (P, 3·tp·p·p); every position whose next token is text is a label.
    """
    vision = config.vision_config
    merge, patch, temporal = vision.spatial_merge_size, vision.patch_size, vision.temporal_patch_size
    vocab = config.text_config.vocab_size
    first_text_id = 1 + max(
        config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id
    )

    def text(n: int) -> list[int]:
        return torch.randint(first_text_id, vocab, (n,), generator=generator).tolist()

    ids, types, pixels, grids = text(spec.text_before), [0] * spec.text_before, [], []
    for i, (h, w) in enumerate(spec.images):
        if h % merge or w % merge:
            raise ValueError(f"image grid {h}x{w} must be a multiple of spatial_merge_size {merge}.")
        n_tokens = h * w // merge**2
        ids += [config.vision_start_token_id, *[config.image_token_id] * n_tokens, config.vision_end_token_id]
        types += [0, *[1] * n_tokens, 0]
        between = spec.text_between if i + 1 < len(spec.images) else spec.text_after
        ids, types = ids + text(between), types + [0] * between
        pixels.append(torch.randn(h * w, 3 * temporal * patch * patch, generator=generator))
        grids.append([1, h, w])
    input_ids = torch.tensor(ids)
    mm_types = torch.tensor(types, dtype=torch.int32)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    next_is_text = mm_types[1:] == 0
    labels[:-1] = torch.where(next_is_text, input_ids[1:], IGNORE_INDEX)
    return Sample(
        input_ids=input_ids,
        shift_labels=labels,
        mm_token_type_ids=mm_types,
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
