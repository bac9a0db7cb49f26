"""Recipe sections read by the data pipeline: `data` (what to load and how to process it) and `packing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.config_tree import ConfigError, check_seed
from data.synthetic import KINDS


@dataclass
class DataConfig:
    path: str = "builtin"  # a file, a directory, a hub id, or "builtin" for the generated dataset
    image_root: str | None = None  # where relative image paths resolve (default: the data file's directory)
    format: Literal["auto", "llava", "messages"] = "auto"  # record layout; auto detects it from the records
    num_samples: int = 2000  # size of the built-in dataset (ignored for other paths)
    video_share: float = 0.2  # share of video samples in the built-in dataset (ignored for other paths)
    # the built-in dataset's question kinds (data/synthetic.py's KINDS), each sample's drawn uniformly from them;
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
