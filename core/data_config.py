"""The recipe sections the data pipeline reads: `data` (what to load and how to process it) and `packing`, with the
built-in dataset's question kinds that `data.builtin_kinds` names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.config_tree import ConfigError, check_seed

# The built-in dataset's question kinds (data/synthetic.py generates them; data.builtin_kinds selects among them).
IMAGE_KINDS = ("count", "color", "position", "text", "caption", "multi_count", "multi_color", "multi_turn")
VIDEO_KINDS = ("direction", "direction_and_image")
TEXT_KINDS = ("arithmetic", "spelling")  # text-only questions: the answer is in the question
# Image kinds outside the default mix (data.builtin_kinds selects them): "background" asks for the colour most of the
# image shows, the first thing a vision path learns; the CPU smoke run proves with it that the model looks.
EXTRA_IMAGE_KINDS = ("background",)
KINDS = (*IMAGE_KINDS, *EXTRA_IMAGE_KINDS, *VIDEO_KINDS, *TEXT_KINDS)  # every record's `category`


@dataclass
class SourceConfig:
    """One source of a weighted mixture (`data.sources`). A null key takes the `data` section's value."""

    path: str = ""  # a file, a directory, a hub id, or "builtin", as data.path
    weight: float = 1.0  # share of the mixture's samples: weight / the sum of the sources' weights
    name: str | None = None  # label in logs and metrics (default: the file's stem, made unique)
    format: Literal["auto", "llava", "messages", "pairs", "alpaca"] | None = None
    image_root: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_fps: float | None = None
    video_max_frames: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    max_samples: int | None = None  # at most this many of the source's records (a seeded subset, in file order)
    eval_fraction: float | None = None  # held-out share of this source


# The settings that decide how an image or a video frame is resized and sampled: a source of a mixture may set its own.
PIXEL_KEYS = ("min_pixels", "max_pixels", "video_fps", "video_max_frames", "video_min_pixels", "video_max_pixels")
# SourceConfig keys a source sets for itself; the others (weight, name) belong to the mixture.
SOURCE_DATA_KEYS = ("path", "format", "image_root", *PIXEL_KEYS, "eval_fraction")


@dataclass
class DataConfig:
    path: str | None = None  # a file, a directory, a hub id, or "builtin" (null: builtin, unless data.sources)
    # several sources mixed by weight instead of data.path (docs/data.md, "Mixtures"): a list of SourceConfig
    sources: list[SourceConfig] | None = None
    max_visual_tokens: int | None = None  # per sample: larger images shrink, videos lose frames then resolution
    image_root: str | None = None  # where relative image paths resolve (default: the data file's directory)
    # record layout (docs/data.md): auto detects it from each record
    format: Literal["auto", "llava", "messages", "pairs", "alpaca"] = "auto"
    num_samples: int = 2000  # size of the built-in dataset (ignored for other paths)
    video_share: float = 0.2  # share of video samples in the built-in dataset (ignored for other paths)
    # the built-in dataset's question kinds (KINDS), each sample's drawn uniformly from them;
    # null: every kind in the default mix (ignored for other paths)
    builtin_kinds: list[str] | None = None
    eval_fraction: float = 0.02  # held-out share for periodic eval
    min_pixels: int | None = None  # image resize bounds passed to the image processor
    max_pixels: int | None = None
    video_fps: float = 2.0  # frame lists are taken as sampled at this rate; video files are sampled to it
    video_max_frames: int = 64  # at most this many frames per video (uniformly subsampled beyond it)
    video_min_pixels: int | None = None  # per-frame resize bounds (default: data.min_pixels / the image processor's)
    video_max_pixels: int | None = None  # default: the image bound, capped at 768 LLM tokens per frame
    num_proc: int | None = None  # processes for the first processing of the data; None: every core this process may use
    # processes collating batches (image decode + image processor) ahead of the step; 0 = inline; null = sized from
    # the machine: min(8, cores per GPU process - 1) with CUDA, 0 on the CPU (trainer/defaults.py)
    num_workers: int | None = None
    streaming: bool = False  # iterate without loading everything in memory
    on_error: Literal["skip", "raise"] = "skip"  # bad samples: counted and logged, or an error naming the sample
    cache_dir: str | None = None  # built-in dataset, tiny processor and processed-data cache (default: .cache)
    seed: int = 0

    def validate(self) -> None:
        self._validate_own()
        if self.max_visual_tokens is not None and self.max_visual_tokens < 1:
            raise ConfigError(f"data.max_visual_tokens must be >= 1 or null, got {self.max_visual_tokens}.")
        if self.sources is None:
            return
        if self.path is not None:
            raise ConfigError(
                f"data.path ({self.path}) and data.sources are both set: a mixture names its files in data.sources; "
                "set data.path=null (or remove it from the recipe)."
            )
        if not self.sources:
            raise ConfigError("data.sources is empty: list at least one {path, weight} source, or use data.path.")
        if self.streaming:
            raise ConfigError("data.sources needs data.streaming=false: a mixture is planned over cached sources.")
        for index, source in enumerate(self.sources):
            where = f"data.sources[{index}]"
            if not source.path:
                raise ConfigError(f"{where}.path is required (a file, a directory, a hub id or builtin).")
            if not source.weight > 0:
                raise ConfigError(f"{where}.weight must be > 0, got {source.weight}.")
            if source.max_samples is not None and source.max_samples < 1:
                raise ConfigError(f"{where}.max_samples must be >= 1 or null, got {source.max_samples}.")
            try:
                source_data_config(self, source)._validate_own()
            except ConfigError as error:
                raise ConfigError(f"{where}: {error}") from None
        names = [source.name for source in self.sources if source.name is not None]
        if len(names) != len(set(names)):
            raise ConfigError(f"data.sources names must be unique, got {names}.")

    def _validate_own(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}.")
        if self.num_proc is not None and self.num_proc < 1:
            raise ConfigError(f"data.num_proc must be >= 1 or null (every core), got {self.num_proc}.")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}.")
        if self.num_samples < 1:
            raise ConfigError(f"data.num_samples must be >= 1, got {self.num_samples}.")
        for key in ("min_pixels", "max_pixels"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"data.{key} must be >= 1 or null, got {getattr(self, key)}.")
        check_seed("data.seed", self.seed)
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.min_pixels ({self.min_pixels}) > data.max_pixels ({self.max_pixels}).")
        if self.builtin_kinds is not None:
            unknown = sorted(set(self.builtin_kinds) - set(KINDS))
            if unknown or not self.builtin_kinds:
                raise ConfigError(f"data.builtin_kinds must be a non-empty list of {list(KINDS)}; unknown: {unknown}.")
        if not 0.0 <= self.video_share <= 1.0:
            raise ConfigError(f"data.video_share must be in [0, 1], got {self.video_share}.")
        if self.video_fps <= 0:
            raise ConfigError(f"data.video_fps must be > 0, got {self.video_fps}.")
        if self.video_max_frames < 1:
            raise ConfigError(f"data.video_max_frames must be >= 1, got {self.video_max_frames}.")
        low, high = self.video_min_pixels, self.video_max_pixels
        if low is not None and high is not None and low > high:
            raise ConfigError(f"data.video_min_pixels ({low}) > data.video_max_pixels ({high}).")


@dataclass
class PackingConfig:
    mode: Literal["packed", "padded"] = "packed"  # packed THD batches, or padded per-sample batches (baseline)
    max_tokens: int = 8192  # token budget of one pack (per rank, per micro-step)
    buffer_size: int = 512  # samples held for best-fit-decreasing
    padded_batch_size: int = 8  # samples per batch in padded mode
    vision_cost_weight: float = 1.0  # rank balancing cost of a pack = LLM tokens + this x ViT patches
    balance_window_steps: int = 8  # steps whose packs are balanced together across ranks

    def validate(self) -> None:
        if self.max_tokens < 16:
            raise ConfigError(f"packing.max_tokens must be >= 16, got {self.max_tokens}.")
        if self.buffer_size < 1:
            raise ConfigError(f"packing.buffer_size must be >= 1, got {self.buffer_size}.")
        if self.padded_batch_size < 1:
            raise ConfigError(f"packing.padded_batch_size must be >= 1, got {self.padded_batch_size}.")
        if self.vision_cost_weight < 0:
            raise ConfigError(f"packing.vision_cost_weight must be >= 0, got {self.vision_cost_weight}.")
        if self.balance_window_steps < 1:
            raise ConfigError(f"packing.balance_window_steps must be >= 1, got {self.balance_window_steps}.")


def source_data_config(data_cfg: DataConfig, source: SourceConfig) -> DataConfig:
    """The `data` section one source of a mixture is loaded and processed with: the source's own keys where set,
    the section's elsewhere (seed, cache, on_error, max_visual_tokens...)."""
    own = {key: getattr(source, key) for key in SOURCE_DATA_KEYS if getattr(source, key) is not None}
    return dataclasses.replace(data_cfg, sources=None, **own)


def held_out_shares(data_cfg: DataConfig) -> dict[str, float]:
    """Each source's held-out share (its eval_fraction, else the section's), keyed by where the value comes from:
    {"data.eval_fraction": f} without a mixture, else "data.sources[i].eval_fraction" or
    "data.sources[i] (data.eval_fraction)" per source, in order."""
    if not data_cfg.sources:
        return {"data.eval_fraction": data_cfg.eval_fraction}
    shares = {}
    for index, source in enumerate(data_cfg.sources):
        own = source.eval_fraction is not None
        where = f"data.sources[{index}].eval_fraction" if own else f"data.sources[{index}] (data.eval_fraction)"
        shares[where] = source.eval_fraction if own else data_cfg.eval_fraction
    return shares


def agreed_pixel_settings(data_cfg: DataConfig) -> tuple[DataConfig, dict[str, list]]:
    """(settings, disagreements): the section with a mixture's pixel and frame settings (PIXEL_KEYS) taken from its
    sources where they all agree (what a single-processor consumer such as the export or generation on new data
    resizes by), and each key on which the sources differ, with every source's value; no sources: (data_cfg, {})."""
    if not data_cfg.sources:
        return data_cfg, {}
    per_source = [source_data_config(data_cfg, source) for source in data_cfg.sources]
    agreed, differ = {}, {}
    for key in PIXEL_KEYS:
        values = [getattr(settings, key) for settings in per_source]
        if len(set(values)) == 1:
            agreed[key] = values[0]
        else:
            differ[key] = values
    return dataclasses.replace(data_cfg, **agreed), differ


def source_names(sources: list[SourceConfig]) -> list[str]:
    """Each source's label: its `name`, else its file's stem, else (stems shared, as data.jsonl's) its directory's
    name; a label still shared gets the source's index appended."""
    paths = [Path(source.path.rstrip("/")) for source in sources]
    stems = [path.stem or str(path) for path in paths]
    unnamed = [stem for source, stem in zip(sources, stems, strict=True) if source.name is None]
    names = []
    for source, path, stem in zip(sources, paths, stems, strict=True):
        if source.name is not None:
            names.append(source.name)
        else:
            names.append(stem if unnamed.count(stem) == 1 or not path.parent.name else path.parent.name)
    return [name if names.count(name) == 1 else f"{name}{index}" for index, name in enumerate(names)]
