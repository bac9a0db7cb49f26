"""data.max_visual_tokens (data/processing.py's fit_visuals): images shrink and videos lose frames then resolution
to fit a sample's budget, the rows and batches follow, and packed == per-sample on the resized images and videos."""

import itertools
import math
import random

import pytest
import torch

from core.config import load_config
from core.families import hf_config
from data.pipeline import build_data, load_processor
from data.processing import Visual, fit_visuals, smart_resize, visual_tokens
from modeling.packed import enable_packed_forward
from tests.test_packed_forward import FAMILIES, assert_within
from tests.tiers import tiered
from verification.packing_check import RELATIVE_TOLERANCE, compare_packed_to_per_sample, samples_from_batch

FACTOR, TEMPORAL = 28, 2  # Qwen2/2.5-VL: patch 14 x merge 2, two frames per temporal patch
IMAGE_BOUNDS = (56 * 56, 28 * 28 * 1280)
FRAME_BOUNDS = (56 * 56, 28 * 28 * 768)
IMAGE_ID, VIDEO_ID = 5, 6  # the tiny recipes' image and video token ids


def random_visuals(rng: random.Random) -> list[Visual]:
    """0-3 images and 0-2 videos of random sizes (aspect ratios up to 1:8) and frame counts."""
    visuals = []
    for _ in range(rng.randint(0, 3)):
        side = rng.randint(20, 2500)
        visuals.append(Visual(side, max(8, int(side * rng.uniform(0.125, 8))), *IMAGE_BOUNDS))
    for _ in range(rng.randint(0, 2)):
        side, frames = rng.randint(40, 1200), rng.randint(1, 64)
        visuals.append(Visual(side, int(side * rng.uniform(0.5, 2)), *FRAME_BOUNDS, frames=frames, max_frames=64))
    return visuals or [Visual(300, 400, *IMAGE_BOUNDS)]


def smallest_tokens(visuals: list[Visual]) -> int:
    """Visual tokens of a sample's smallest form, from the processor's rule: every video at one temporal patch, every
    image and frame as transformers' smart_resize sizes it under a pixel cap of one merge window (one window, or a
    few for a long thin or tiny image, whose aspect ratio the rule keeps)."""
    window = FACTOR * FACTOR
    sizes = [smart_resize(v.height, v.width, FACTOR, min(v.min_pixels, window), window) for v in visuals]
    return sum((height // FACTOR) * (width // FACTOR) for height, width in sizes)


def test_fitted_visuals_never_exceed_the_budget():
    """Over 600 random samples and budgets: a fitted sample's visual tokens never exceed the budget; one that fits
    is unchanged; sides stay multiples of patch x merge with the aspect ratio kept to within that rounding; videos
    lose frames before anything loses resolution; None exactly where even the smallest form is over the budget,
    long thin images (more than one window at their smallest) included."""
    rng = random.Random(0)
    shrunk = framed = refused = refused_long_thin = 0
    for _ in range(600):
        visuals, budget = random_visuals(rng), rng.choice([1, 4, 16, 64, 256, 1024, 8192])
        fitted = fit_visuals(visuals, budget, FACTOR, TEMPORAL)
        before = visual_tokens(visuals, FACTOR, TEMPORAL)
        smallest = smallest_tokens(visuals)
        if fitted is None:
            assert smallest > budget, (visuals, budget)
            refused += 1
            refused_long_thin += smallest > len(visuals)
            continue
        assert visual_tokens(fitted, FACTOR, TEMPORAL) <= budget
        if before <= budget:
            assert fitted == visuals
            continue
        resized = any(a.max_pixels != b.max_pixels for a, b in zip(visuals, fitted, strict=True))
        shrunk += resized
        framed += not resized
        for original, new in zip(visuals, fitted, strict=True):
            height, width = new.resized(FACTOR)
            assert height % FACTOR == 0 and width % FACTOR == 0 and new.frames <= original.frames
            if resized and original.frames:  # resolution goes only once every video is down to one temporal patch
                assert new.frames == min(original.frames, TEMPORAL)
            if min(height, width) >= 4 * FACTOR:
                drift = abs(math.log((height / width) / (original.height / original.width)))
                assert drift <= 2 * FACTOR / min(height, width)
    assert shrunk > 50 and framed > 10 and refused > 10 and refused_long_thin > 5  # every branch is exercised


def budget_cfg(cache, family: str, budget, *overrides: str):
    return load_config(
        f"recipes/tiny-{family}.yaml",
        [
            f"data.cache_dir={cache}",
            "data.num_workers=0",
            "data.num_samples=60",
            "data.video_share=0.5",
            f"data.max_visual_tokens={budget}",
            *overrides,
        ],
    )


def all_rows(loader) -> dict[str, dict]:
    """Every processed row of a loader's dataset (kept or skipped), by sample id."""
    dataset = loader.fetch.dataset
    return {row["sample_id"]: row for row in (dataset[i] for i in range(len(dataset)))}


def visual_token_count(row: dict) -> int:
    return sum(token in (IMAGE_ID, VIDEO_ID) for token in row["input_ids"])


def text_of(row: dict) -> list[int]:
    return [token for token in row["input_ids"] if token not in (IMAGE_ID, VIDEO_ID)]


def build(cfg):
    processor = load_processor(cfg.model, cfg.data)
    return build_data(cfg.data, cfg.packing, processor, hf_config(cfg.model))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("budget-cache")


def test_budget_resizes_rows_and_batches_within_it(cache):
    """With data.max_visual_tokens=40 every processed row holds <= 40 image and video tokens; samples over it were
    shrunk (fewer visual tokens than without the budget, the same text), videos lost frames, and a whole epoch
    collates (the collator remakes every resized image and video and checks its grid). A budget above every
    sample leaves the rows exactly as without one."""
    plain = all_rows(build(budget_cfg(cache, "qwen2_5_vl", "null"))[0])
    train, _, stats = build(budget_cfg(cache, "qwen2_5_vl", 40))
    budgeted = all_rows(train)
    assert not stats.skipped
    shrunk = fewer_frames = 0
    for sample_id, row in budgeted.items():
        original = plain[sample_id]
        assert visual_token_count(row) <= 40
        if visual_token_count(original) > 40:
            shrunk += 1
            assert visual_token_count(row) < visual_token_count(original)
            fewer_frames += any(a[0] < b[0] for a, b in zip(row["video_grid_thw"], original["video_grid_thw"]))
        else:
            assert row["input_ids"] == original["input_ids"] and row["image_sizes"] == original["image_sizes"]
        assert text_of(row) == text_of(original)  # Qwen2.5-VL has no frame timestamps: the text stays as it was
    assert shrunk > 10 and fewer_frames > 0
    for batch in itertools.islice(train, len(list(train.steps(0)))):
        assert batch["num_image_tokens"] + batch["num_video_tokens"] <= 40 * len(batch["sample_lengths"])
    roomy = all_rows(build(budget_cfg(cache, "qwen2_5_vl", 100_000))[0])
    assert all(roomy[k]["input_ids"] == plain[k]["input_ids"] for k in plain)


def test_a_sample_that_cannot_fit_is_a_counted_skip(cache):
    """A budget of 1 visual token: samples with two or more images or temporal patches cannot fit and are skipped
    as visual_tokens_over_budget, counted, with a reason naming the budget; single-image samples shrink to it."""
    train, _, stats = build(budget_cfg(cache, "qwen2_5_vl", 1))
    assert stats.skipped["visual_tokens_over_budget"] > 0
    assert "data.max_visual_tokens 1" in stats.skip_examples["visual_tokens_over_budget"][0]
    kept = [row for row in all_rows(train).values() if not row["skip_reason"]]
    assert kept and all(visual_token_count(row) <= 1 for row in kept)


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=("qwen2_5_vl", "qwen3_5")))
def test_packed_equals_per_sample_on_resized_images_and_videos(cache, tiny_model, family):
    """A pipeline pack of samples resized to data.max_visual_tokens=24 (images shrunk, videos with fewer frames
    and smaller frames) gives the logits, loss and every gradient of its samples run one by one (fp32)."""
    cfg = budget_cfg(cache, family, 24, "packing.max_tokens=512")
    train, _, _ = build(cfg)
    model = tiny_model(family)
    enable_packed_forward(model)
    merge = model.config.vision_config.spatial_merge_size
    batch = next(b for b in train if b["video_grid_thw"] is not None and b["image_grid_thw"] is not None)
    assert batch["num_image_tokens"] + batch["num_video_tokens"] <= 24 * len(batch["sample_lengths"])
    report = compare_packed_to_per_sample(model, samples_from_batch(batch, merge), batch)
    assert_within(report, RELATIVE_TOLERANCE[torch.float32])
