"""Weighted mixtures of sources (data.sources; data/row_meta.py's MixtureOrder): realised weights, repeats and
subsampling, exact resume, per-source caches, per-source counts in batches and metrics, and the config's errors."""

import itertools
import logging
import os
import re

import numpy as np
import pytest
import torch

from core.config import load_config
from core.config_tree import ConfigError
from core.data_config import DataConfig, SourceConfig, agreed_pixel_settings, source_names
from core.families import hf_config
from data.pipeline import build_data, load_processor, processor_for_export
from data.row_meta import MixtureOrder, RowMeta, quotas
from data.synthetic import write_builtin_dataset
from inference import evaluate
from inference.during_training import held_out_prompts
from trainer.memory_estimate import largest_max_pixels
from trainer.metrics import IntervalCounts, source_metrics

SIGMAS = 5.0  # a realised share may stray this many binomial standard deviations from its weight's share


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three small JSONL sources of the built-in kinds: images only (60), videos only (30), mixed (24)."""
    root = tmp_path_factory.mktemp("mixture-sources")
    return {
        "images": write_builtin_dataset(root / "images", 60, 1, 0.0),
        "videos": write_builtin_dataset(root / "videos", 30, 2, 1.0),
        "mixed": write_builtin_dataset(root / "mixed", 24, 3, 0.3),
    }


def mixture_cfg(cache, sources_yaml: str, *overrides: str):
    return load_config(
        "recipes/tiny-qwen2_5_vl.yaml",
        [
            f"data.cache_dir={cache}",
            "data.num_workers=0",
            f"data.sources={sources_yaml}",
            "packing.max_tokens=768",
            *overrides,
        ],
    )


def build(cfg):
    processor = load_processor(cfg.model, cfg.data)
    return build_data(cfg.data, cfg.packing, processor, hf_config(cfg.model))


def fake_rows(sizes: list[int]) -> tuple[RowMeta, tuple[np.ndarray, ...]]:
    """RowMeta of sum(sizes) text-only rows of 10 tokens, and each source's row indices."""
    total = sum(sizes)
    rows = RowMeta(
        lengths=np.full(total, 10, np.int32),
        patches=np.zeros(total, np.int32),
        kinds=np.zeros((total, 2), bool),
        skipped=np.zeros(total, bool),
    )
    starts = np.cumsum([0, *sizes])
    return rows, tuple(np.arange(a, b, dtype=np.int64) for a, b in itertools.pairwise(starts))


def test_weights_are_realised_within_sampling_noise_over_a_long_draw():
    """Sources of 40, 400 and 4,000 samples weighted 5:3:2, drawn for 30 epochs (133,200 draws): each source's
    share of every epoch is its weight's share to within one sample (largest-remainder quotas), and of every
    epoch's first 2,000 draws within SIGMAS binomial standard deviations, sqrt(p(1-p)/n) (a without-replacement
    draw varies less). The small source repeats (each sample ~46 times an epoch, evenly: counts differ by <= 1), the
    large one is subsampled and shows all its samples, each once, before any repeats."""
    sizes, weights = [40, 400, 4000], (5.0, 3.0, 2.0)
    rows, indices = fake_rows(sizes)
    mixture = MixtureOrder(rows, indices, weights, seed=7)
    total, shares = sum(sizes), np.asarray(weights) / sum(weights)
    owner = np.repeat(np.arange(3), sizes)
    seen_large = []
    for epoch in range(30):
        order = mixture.order(epoch)
        assert len(order) == total
        counts = np.bincount(owner[order], minlength=3)
        assert np.all(np.abs(counts / total - shares) <= 1 / total)
        head = np.bincount(owner[order[:2000]], minlength=3) / 2000
        assert np.all(np.abs(head - shares) <= SIGMAS * np.sqrt(shares * (1 - shares) / 2000))
        small = np.bincount(order[owner[order] == 0], minlength=40)
        assert small.max() - small.min() <= 1 and small.min() >= 1
        seen_large.extend(order[owner[order] == 2].tolist())
    quota = round(shares[2] * total)  # 888 of the 4,000 an epoch: epochs 0-3 inside the first pass, 4 crosses it
    assert len(set(seen_large[: 4 * quota])) == 4 * quota and len(set(seen_large[: 5 * quota])) == 4000


def test_mixture_order_is_a_function_of_seed_and_epoch():
    """The same (seed, epoch) gives the same order (what resuming relies on); another epoch or seed another one."""
    rows, indices = fake_rows([30, 70])
    a, b = MixtureOrder(rows, indices, (1.0, 1.0), seed=3), MixtureOrder(rows, indices, (1.0, 1.0), seed=3)
    assert np.array_equal(a.order(2), b.order(2))
    assert not np.array_equal(a.order(2), a.order(3))
    assert not np.array_equal(a.order(2), MixtureOrder(rows, indices, (1.0, 1.0), seed=4).order(2))
    assert quotas([1.0, 1.0, 1.0], 10).tolist() in ([4, 3, 3], [3, 4, 3], [3, 3, 4])


def test_mixture_resumes_exactly_mid_epoch_and_counts_per_source(tmp_path, sources):
    """A mixture loader restored from state_dict mid-epoch (and across the epoch boundary) yields exactly the batches
    the original would have yielded next; every batch counts its samples and tokens per source (Python ints that
    sum to the pack's), and the interval metrics name them."""
    spec = (
        f"[{{path: {sources['images']}, weight: 1}}, {{path: {sources['videos']}, weight: 3}}, "
        f"{{path: {sources['mixed']}, weight: 1, max_samples: 16}}]"
    )
    cfg = mixture_cfg(tmp_path, spec)
    train, _, stats = build(cfg)
    assert list(stats.sources) == ["images", "videos", "mixed"] and stats.sources["mixed"].records == 16
    steps_per_epoch = len(list(train.steps(0)))
    original = iter(train)
    counts = IntervalCounts()
    for _ in range(steps_per_epoch - 2):
        batch = next(original)
        assert sum(batch["num_source_tokens"]) == batch["input_ids"].shape[1]
        assert sum(batch["num_source_samples"]) == len(batch["sample_lengths"])
        counts.add_batch(batch, 768, 0.0)
    metrics = source_metrics(["images", "videos", "mixed"], counts.source_samples, counts.source_tokens)
    assert metrics["source_samples/videos"] > metrics["source_samples/images"] > 0
    state = train.state_dict()
    expected = [next(original) for _ in range(4)]  # crosses into epoch 1
    resumed, _, _ = build(cfg)
    resumed.load_state_dict(state)
    got = [batch for _, batch in zip(range(4), resumed, strict=False)]
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["num_source_samples"] == b["num_source_samples"]


def _cache_files(loader) -> dict[str, int]:
    """The processed datasets' arrow files behind a loader and their mtimes (ns)."""
    files = [entry["filename"] for entry in loader.fetch.dataset.cache_files]
    return {path: os.stat(path).st_mtime_ns for path in files}


def test_each_source_keeps_its_cache_when_another_changes(tmp_path, sources):
    """Reweighting reuses every source's processed file; changing one source's records and adding another
    reprocesses those two only: the untouched source's processed file is the same file, not rewritten."""
    changed = tmp_path / "changed"
    write_builtin_dataset(changed, 20, 5, 0.0)
    cache = tmp_path / "cache"
    first, _, _ = build(mixture_cfg(cache, f"[{{path: {sources['images']}}}, {{path: {changed / 'data.jsonl'}}}]"))
    before = _cache_files(first)
    assert len(before) == 2
    reweighted, _, _ = build(
        mixture_cfg(cache, f"[{{path: {sources['images']}, weight: 4}}, {{path: {changed / 'data.jsonl'}}}]")
    )
    assert _cache_files(reweighted) == before
    lines = (changed / "data.jsonl").read_text().splitlines(keepends=True)
    (changed / "data.jsonl").write_text("".join(lines[:15]))
    spec = f"[{{path: {sources['images']}}}, {{path: {changed / 'data.jsonl'}}}, {{path: {sources['mixed']}}}]"
    after = _cache_files(build(mixture_cfg(cache, spec))[0])
    kept = set(before) & set(after)
    assert len(after) == 3 and len(kept) == 1
    (same,) = kept
    assert after[same] == before[same]


def test_held_out_samples_come_from_every_source_at_its_own_share(tmp_path, sources):
    """Each source holds out its own eval share (a source's eval_fraction, else data.eval_fraction); the eval loader
    passes over all of them once."""
    spec = f"[{{path: {sources['images']}, eval_fraction: 0.25}}, {{path: {sources['videos']}}}]"
    _, evaluation, stats = build(mixture_cfg(tmp_path, spec, "data.eval_fraction=0.1"))
    assert stats.sources["images"].kept_eval == 15 and stats.sources["videos"].kept_eval == 3
    keys = [item.key for step in evaluation.steps(0) for pack in step for item in pack.items]
    sources = [row["source"] for row in evaluation.fetch(keys)]
    assert len(set(keys)) == len(keys) == 18 and sources.count(0) == 15 and sources.count(1) == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.path=a.jsonl", "data.sources=[{path: b.jsonl}]"], "data.path (a.jsonl) and data.sources are both set"),
        (["data.sources=[]"], "data.sources is empty"),
        (["data.sources=[{weight: 2}]"], "data.sources[0].path is required"),
        (["data.sources=[{path: a.jsonl, weight: 0}]"], "data.sources[0].weight must be > 0"),
        (["data.sources=[{path: a.jsonl, eval_fraction: 1.5}]"], "data.sources[0]: data.eval_fraction"),
        (["data.sources=[{path: a.jsonl}]", "data.streaming=true"], "needs data.streaming=false"),
        (["data.sources=[{path: a.jsonl, name: x}, {path: b.jsonl, name: x}]"], "names must be unique"),
        (["data.max_visual_tokens=0"], "data.max_visual_tokens must be >= 1"),
    ],
)
def test_mixture_config_errors_are_one_line(overrides, message):
    """data.path beside data.sources, and bad source keys, are ConfigErrors naming the key."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("recipes/tiny-qwen2_5_vl.yaml", overrides)


def test_default_source_names_are_unique_and_readable():
    """Sources named by their file's stem, by their directory where stems repeat (data.jsonl), else indexed."""
    names = source_names(
        [
            SourceConfig(path="/d/caption/data.jsonl"),
            SourceConfig(path="/d/vqa/data.jsonl"),
            SourceConfig(path="/d/extra.parquet"),
            SourceConfig(path="/e/extra.parquet", name="mine"),
        ]
    )
    assert names == ["caption", "vqa", "extra", "mine"]


def test_generation_prompts_come_from_every_source_held_out(tmp_path, sources):
    """train.generate_every's held-out prompts of a mixture: the sources in turn, each from its own held-out records
    (its eval share), none of them a record the mixture trains on."""
    spec = f"[{{path: {sources['images']}, eval_fraction: 0.25}}, {{path: {sources['videos']}, eval_fraction: 0.2}}]"
    cfg = mixture_cfg(tmp_path, spec)
    processor = load_processor(cfg.model, cfg.data)
    prompts = held_out_prompts(cfg, processor, hf_config(cfg.model), 6)
    _, evaluation, _ = build(cfg)
    keys = [item.key for step in evaluation.steps(0) for pack in step for item in pack.items]
    held = {(row["sample_id"], bool(row["video_grid_thw"])) for row in evaluation.fetch(keys)}  # the ids repeat
    assert len(prompts) == 6 and {(p.sample_id, bool(p.row["video_grid_thw"])) for p in prompts} <= held
    images = [prompt.sample_id for prompt in prompts if not prompt.row["video_grid_thw"]]
    assert 0 < len(images) < 6  # both sources take turns


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.sources=[{path: a.jsonl, eval_fraction: 0}]", "train.eval_every=0", "train.generate_every=5"],
            "train.generate_every > 0 answers held-out records, but no source of data.sources holds any out "
            "(data.sources[0].eval_fraction=0)",
        ),
        (
            ["data.sources=[{path: a.jsonl, eval_fraction: 0}, {path: b.jsonl}]", "data.eval_fraction=0"],
            "train.eval_every > 0 needs a held-out split, but no source of data.sources holds any out "
            "(data.sources[0].eval_fraction=0, data.sources[1] (data.eval_fraction)=0)",
        ),
    ],
)
def test_a_mixture_that_holds_nothing_out_is_refused_for_eval_and_generation(overrides, message):
    """train.eval_every / train.generate_every read held-out records: a mixture whose every source (by its own
    eval_fraction or the section's) holds none out is one ConfigError naming each source's share, at load."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("recipes/tiny-qwen2_5_vl.yaml", ["train.eval_every=10", *overrides])
    assert load_config("recipes/tiny-qwen2_5_vl.yaml", [*overrides, "train.eval_every=0", "train.generate_every=0"])


def test_one_source_holding_out_is_enough_for_eval_and_generation():
    """A source's own eval_fraction counts: data.eval_fraction=0 beside a source holding records out is accepted for
    train.eval_every and train.generate_every."""
    cfg = load_config(
        "recipes/tiny-qwen2_5_vl.yaml",
        [
            "data.eval_fraction=0",
            "data.sources=[{path: a.jsonl}, {path: b.jsonl, eval_fraction: 0.1}]",
            "train.eval_every=10",
            "train.generate_every=10",
        ],
    )
    assert [s.eval_fraction for s in cfg.data.sources] == [None, 0.1]


def test_generation_skips_a_source_that_holds_nothing_out(tmp_path, sources):
    """train.generate_every's prompts of a mixture with one source at eval_fraction 0: all from the other source (the
    source without a held-out split gives none, and does not stop the others)."""
    spec = f"[{{path: {sources['images']}, eval_fraction: 0}}, {{path: {sources['videos']}, eval_fraction: 0.2}}]"
    cfg = mixture_cfg(tmp_path, spec, "train.generate_every=1")
    processor = load_processor(cfg.model, cfg.data)
    prompts = held_out_prompts(cfg, processor, hf_config(cfg.model), 4)
    assert len(prompts) == 4 and all(prompt.row["video_grid_thw"] for prompt in prompts)


def test_pixel_settings_the_sources_agree_on_reach_the_export_and_generation(caplog):
    """A mixture's sources that all set the same pixel bound: the export's processor and generation on new data
    resize by it (not the data section's); a bound they differ on keeps the section's, said in one line naming
    it; the memory estimate takes the largest bound any source resizes to."""
    cfg = load_config(
        "recipes/tiny-qwen2_5_vl.yaml",
        [
            "data.max_pixels=50000",
            "data.sources=[{path: a.jsonl, max_pixels: 20000, video_fps: 1, video_max_pixels: 9000}, "
            "{path: b.jsonl, max_pixels: 20000}]",
        ],
    )
    settings, differ = agreed_pixel_settings(cfg.data)
    assert settings.max_pixels == 20000 and settings.video_fps == cfg.data.video_fps
    assert differ == {"video_fps": [1.0, cfg.data.video_fps], "video_max_pixels": [9000, None]}
    processor = load_processor(cfg.model, cfg.data)
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        exported = processor_for_export(processor, cfg.data)
    assert exported.image_processor.size["longest_edge"] == 20000
    lines = [r.getMessage() for r in caplog.records if "resize differently" in r.getMessage()]
    assert len(lines) == 1 and "video_max_pixels: [9000, None]" in lines[0] and "video_fps" not in lines[0]
    assert largest_max_pixels(cfg.data) == 20000
    wider = load_config("recipes/tiny-qwen2_5_vl.yaml", ["data.sources=[{path: a, max_pixels: 90000}, {path: b}]"])
    assert largest_max_pixels(wider.data) is None  # the second source keeps the data's own sizes


def test_generation_reads_the_held_out_records_of_a_streamed_run(tmp_path, sources):
    """train.generate_every with data.streaming=true (records without a length): the held-out prompts are those of
    the same data read in memory; scripts.generate's built-in set of a streamed run is read by index too."""
    prompts = {}
    for streaming in ("true", "false"):
        cfg = load_config(
            "recipes/tiny-qwen2_5_vl.yaml",
            [f"data.cache_dir={tmp_path}", f"data.path={sources['mixed']}", f"data.streaming={streaming}",
             "data.eval_fraction=0.2", "train.generate_every=1"],
        )  # fmt: skip
        processor = load_processor(cfg.model, cfg.data)
        prompts[streaming] = [p.sample_id for p in held_out_prompts(cfg, processor, hf_config(cfg.model), 3)]
    assert len(prompts["true"]) == 3 and prompts["true"] == prompts["false"]
    streamed = DataConfig(streaming=True, cache_dir=str(tmp_path))
    records, _, settings = evaluate.open_eval_records(streamed, "builtin", 4, None, None)
    assert len(records) == 4 and not settings.streaming
