"""The data pipeline's entry points for the trainer: `load_processor(model, data)` and `build_data(data, packing, …)`.

Both take the recipe sections they read (`model`, `data`, `packing`), never the whole training config.

records (data/sources.py) → per-sample processing, parallel and cached (data/processing.py) → skip accounting →
per-epoch plan: shuffled order, best-fit-decreasing packs, rank-balanced steps, whole optimizer steps
(data/packing.py) → collate (data/collate.py). The loaders iterate steps; each yields this rank's batch of the step
and can save/restore its position (`state_dict` / `load_state_dict`), so a resumed run sees exactly the batches it
had not seen yet.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, concatenate_datasets
from filelock import FileLock, Timeout
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, PretrainedConfig
from transformers.utils import cached_file

from core.caches import mapped
from core.config_tree import ConfigError
from core.data_config import DataConfig, PackingConfig, agreed_pixel_settings, source_data_config, source_names
from core.families import hf_config
from data.collate import Collator
from data.formats import DataError
from data.image_files import files_signature, list_files
from data.packing import ConsumedSteps, Leftover, Pack, PackItem, deal_steps, pack_stream, packs_after, whole_groups
from data.processing import PROCESSED_FEATURES, SampleProcessor, image_size_kwargs
from data.row_meta import (
    DataStats,
    MixtureOrder,
    RowMeta,
    held_out_rows,
    is_eval_row,
    kept_rows,
    on_error_raise_message,
    pack_items,
    too_long_detail,
    too_long_reason,
)
from data.sources import open_records
from data.tiny_processor import image_only_processor_class, load_or_build_tiny_processor
from data.video import VideoSettings

logger = logging.getLogger(__name__)
PROCESSING_VERSION = 4  # bump when processing output changes, to invalidate cached datasets
# Anchored at the repository, not the working directory: scripts/ and train.py launched from anywhere share it.
DEFAULT_CACHE_ROOT = str(Path(__file__).resolve().parents[1] / ".cache")
ROW_INDEX_COLUMN = "__row_index__"
RECORDS_PER_PROCESS = 256  # with fewer records per process, starting the process costs about what it saves


MAX_LOADER_WORKERS = 8  # the most loader workers `data.num_workers: null` starts per GPU process (docs/data.md)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which container limits set), else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_processes() -> int:
    """Training processes on this machine (torchrun, which accelerate launch runs, sets LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def default_loader_workers(on_cuda: bool, cores: int, processes: int) -> int:
    """data.num_workers when null: with CUDA, a core per worker and one left for each of the machine's `processes`
    training processes, at least 1 and at most MAX_LOADER_WORKERS; without CUDA 0 (collate inline: the step itself
    keeps the cores busy)."""
    if not on_cuda:
        return 0
    return max(1, min(MAX_LOADER_WORKERS, cores // max(1, processes) - 1))


def cache_root(data_cfg: DataConfig) -> str:
    return data_cfg.cache_dir or DEFAULT_CACHE_ROOT


def load_processor(model_cfg, data_cfg: DataConfig):
    """The recipe's processor: `model.processor` or `model.name_or_path` via AutoProcessor, else the tiny one
    (cached under `data.cache_dir`). `model_cfg`: the recipe's `model` section; `data_cfg`: its `data` section.

    Without torchvision, transformers cannot build a Qwen-VL video processor, so AutoProcessor fails for real
    checkpoints; then the family's image-only processor is assembled from the checkpoint's tokenizer, image
    processor and chat template (videos go through the image processor frame by frame: data/video.py).
    """
    source = model_cfg.processor or model_cfg.name_or_path
    if source is None:
        return load_or_build_tiny_processor(cache_root(data_cfg), hf_config(model_cfg))
    if model_cfg.processor and not os.path.isdir(source) and source.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"model.processor={source} is not a directory (a Hub id is 'owner/name').")
    try:
        return AutoProcessor.from_pretrained(source)
    except (ImportError, OSError, ValueError, AttributeError, TypeError) as error:
        model_type = hf_config(model_cfg).model_type
        logger.warning("AutoProcessor(%s) failed (%s); using the image-only %s processor.", source, error, model_type)
        tokenizer = AutoTokenizer.from_pretrained(source)
        image_processor = AutoImageProcessor.from_pretrained(source)
        template_file = cached_file(source, "chat_template.jinja", _raise_exceptions_for_missing_entries=False)
        chat_template = Path(template_file).read_text() if template_file else tokenizer.chat_template
        if chat_template is None:
            raise ValueError(f"{source} has no chat template (chat_template.jinja or the tokenizer's).") from error
        return image_only_processor_class(model_type)(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template
        )


# The pixel settings an exported processor carries (frame rate and frame cap are the serving engine's request's).
EXPORTED_PIXEL_KEYS = ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels")


def processor_for_export(processor, data_cfg: DataConfig):
    """A copy of `processor` whose saved config carries the run's pixel bounds: the image processor's `size` (what
    AutoProcessor, vLLM and SGLang resize by) set to data.min/max_pixels, and a video processor's (when the processor
    has one) to the per-frame bounds training used, so an engine that loads the export resizes as training did. A
    mixture's sources' own bounds count where they all agree; where they differ, the section's, said in one line."""
    data_cfg, differ = agreed_pixel_settings(data_cfg)
    differ = {key: values for key, values in differ.items() if key in EXPORTED_PIXEL_KEYS}
    if differ:
        logger.warning(
            "data.sources resize differently (%s): the export's processor resizes by the data section's %s",
            "; ".join(f"{key}: {values}" for key, values in differ.items()),
            ", ".join(f"data.{key}={getattr(data_cfg, key)}" for key in differ),
        )
    exported = copy.deepcopy(processor)
    bounds = image_size_kwargs(exported.image_processor, data_cfg.min_pixels, data_cfg.max_pixels)
    video_bounds = VideoSettings.from_config(data_cfg, processor.image_processor).size_kwargs
    if bounds:
        exported.image_processor.size = dict(bounds["size"])
    video_processor = getattr(exported, "video_processor", None)
    if video_processor is not None:
        video_processor.size = dict(video_bounds["size"])
    return exported


# Config keys that describe how weights are stored or run, not how a sample is tokenised or positioned: train.py's
# built model and inspect_data.py's bare config differ in them, and must share one processed cache.
RUNTIME_CONFIG_KEYS = frozenset({"dtype", "torch_dtype", "transformers_version", "_name_or_path", "architectures"})


def _processing_config(value):
    """A config dict without RUNTIME_CONFIG_KEYS, at every level."""
    if isinstance(value, dict):
        return {k: _processing_config(v) for k, v in value.items() if k not in RUNTIME_CONFIG_KEYS}
    return value


def processing_fingerprint(
    data_cfg: DataConfig, processor, model_config: PretrainedConfig, source_fingerprint: str, images_signature: str
) -> str:
    """Cache key of the processed dataset: everything its rows depend on. The source data (its contents' hash for
    JSON files), the image files (data/image_files.py's `files_signature`), the data settings, processor, the model
    config's processing fields, and the processing code's version. inspect_data.py and train.py compute the same
    key."""
    tokenizer = processor.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "version": PROCESSING_VERSION,
        "source": source_fingerprint,
        "images": images_signature,
        "data": [data_cfg.path, data_cfg.image_root, data_cfg.format, data_cfg.min_pixels, data_cfg.max_pixels],
        "video": [data_cfg.video_fps, data_cfg.video_max_frames, data_cfg.video_min_pixels, data_cfg.video_max_pixels],
        "max_visual_tokens": data_cfg.max_visual_tokens,
        "tokenizer": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "chat_template": processor.chat_template,
        "image_processor": processor.image_processor.to_json_string(),
        "model": _processing_config(model_config.to_dict()),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class StepLoader:
    """Iterates one rank's batches, step by step, epoch after epoch (`epochs=None`) or for a fixed count.

    `items(epoch)` yields the epoch's PackItems in order; `fetch(keys)` turns PackItem keys into processed rows;
    `collate(rows)` makes the batch. Every rank computes the same plan and takes its own pack of each step.
    `stats` (DataStats, optional) lets the error for an empty epoch name its cause.

    An epoch holds a whole number of optimizer steps of `grad_accum_steps` micro-steps, so the trainer's
    `grad_accum_steps` consecutive batches never mix two epochs: the packs that cannot fill one more optimizer
    step (too few for every rank, or for every micro-step) are left out, counted and logged once per epoch by rank 0.
    With `balance_window_steps = grad_accum_steps`, one rank accumulating N micro-steps sees the same packs per
    optimizer step as N ranks with one micro-step each and balance_window_steps=1.

    A position saved on another number of ranks (a resume with --allow-world-size-change) carries over as the packs
    it consumed: the rest of that epoch's packs are dealt to this loader's ranks (`carried`, data/packing.py's
    `packs_after`), so no sample of the epoch is repeated or left out; the epochs after it are planned as usual.
    """

    def __init__(
        self,
        items: Callable[[int], Iterator[PackItem]],
        fetch: Callable[[list], list[dict]],
        collate: Callable[[list[dict]], dict],
        packing_cfg,
        rank: int,
        world_size: int,
        seed: int,
        epochs: int | None,
        num_workers: int = 0,
        grad_accum_steps: int = 1,
        name: str = "train",
        stats: DataStats | None = None,
        step_vision: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}.")
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}.")
        self.items, self.fetch, self.collate = items, fetch, collate
        self.packing = packing_cfg
        self.rank, self.world_size, self.seed, self.epochs = rank, world_size, seed, epochs
        self.num_workers, self.grad_accum_steps, self.name = num_workers, grad_accum_steps, name
        self.stats = stats  # the data stats, for a hint when an epoch is empty
        self.step_vision = step_vision  # batches (dicts) carry STEP_VISION: the micro-step's kinds over all ranks
        self.epoch, self.step_in_epoch = 0, 0
        self.carried: list[ConsumedSteps] = []  # steps of `self.epoch` taken on other layouts, before step 0
        self._reported_epochs: set[int] = set()
        if num_workers > 0:
            worker_start_context()

    def packs(self, epoch: int) -> Iterator[Pack]:
        """The epoch's packs (packed mode: best-fit-decreasing; padded mode: consecutive samples)."""
        if self.packing.mode == "packed":
            return pack_stream(self.items(epoch), self.packing.max_tokens, self.packing.buffer_size)
        return self._padded_batches(epoch)

    def _padded_batches(self, epoch: int) -> Iterator[Pack]:
        batch = Pack()
        for item in self.items(epoch):
            batch.add(item)
            if len(batch.items) == self.packing.padded_batch_size:
                yield batch
                batch = Pack()
        if batch.items:
            yield batch

    def steps(self, epoch: int, leftover: Leftover | None = None) -> Iterator[list[Pack]]:
        """The epoch's micro-steps: lists of world_size packs, index = rank, in whole groups of grad_accum_steps
        (one optimizer step each). Packs left out at the end are added to `leftover` once the steps are exhausted."""
        window, weight = self.packing.balance_window_steps, self.packing.vision_cost_weight
        packs = self.packs(epoch)
        for consumed in self.carried if epoch == self.epoch else []:
            packs = packs_after(packs, consumed, weight, self.seed + epoch)
        dealt = deal_steps(packs, self.world_size, window, weight, self.seed + epoch, leftover)
        return whole_groups(dealt, self.grad_accum_steps, leftover)

    def leftover(self, epoch: int) -> Leftover:
        """The packs (and tokens) the epoch's plan leaves out at its end; plans the whole epoch to find them."""
        leftover = Leftover()
        for _ in self.steps(epoch, leftover):
            pass
        return leftover

    def __iter__(self) -> Iterator[dict]:
        if self.epochs is not None and self.epoch >= self.epochs:  # a finished finite loader starts a new pass
            self.epoch, self.step_in_epoch = 0, 0
        while self.epochs is None or self.epoch < self.epochs:
            epoch_batches = _EpochBatches(self, self.epoch, first_step=self.step_in_epoch)
            remaining = epoch_batches
            if self.num_workers > 0:
                remaining = DataLoader(
                    epoch_batches,
                    batch_size=None,
                    num_workers=self.num_workers,
                    prefetch_factor=4,
                    multiprocessing_context=worker_start_context(),
                    worker_init_fn=ignore_stop_signals,
                )
            yielded = self.step_in_epoch
            for batch in remaining:
                if isinstance(batch, WorkerDataError):
                    raise DataError(batch.message)
                self.step_in_epoch += 1
                yield batch
            # (an epoch carried over from another layout may have had all its packs taken there)
            if self.epochs is None and yielded == self.step_in_epoch == 0 and not self.carried:
                raise DataError(
                    f"an epoch has no batch for rank {self.rank} of {self.world_size}: {self._no_batch_hint()}"
                )
            if self.rank == 0:
                self._report_leftover(self.epoch, epoch_batches.leftover)
            self.epoch, self.step_in_epoch, self.carried = self.epoch + 1, 0, []

    def _no_batch_hint(self) -> str:
        """Why an epoch may be empty and the fix, from the data stats when they show it."""
        stats = self.stats
        too_long = stats.skipped["too_long"] + stats.skipped["video_too_long"] if stats is not None else 0
        if stats is not None and stats.kept_train == 0 and too_long:
            return (
                f"no sample was kept, {too_long} longer than packing.max_tokens={self.packing.max_tokens} "
                "(too_long, video_too_long); raise packing.max_tokens (or set data.max_visual_tokens to shrink images "
                "and videos to fit)."
            )
        return (
            f"too few kept samples (see the data stats), or fewer packs than one optimizer step ({self.world_size} "
            f"ranks x {self.grad_accum_steps} micro-batches); add data or lower packing.max_tokens."
        )

    def _report_leftover(self, epoch: int, walked: Leftover | None) -> None:
        """Log the epoch's left-over packs, once per epoch. `walked` is what this process recorded while walking
        the plan; None when DataLoader workers walked it (their records stay in their processes), so plan it here."""
        if epoch in self._reported_epochs:
            return
        self._reported_epochs.add(epoch)
        leftover = walked if walked is not None else self.leftover(epoch)
        if leftover.packs:
            logger.info(
                "%s epoch %d: %d pack%s (%d tokens) left over: fewer than one step of %d ranks x %d micro-batches",
                self.name,
                epoch,
                leftover.packs,
                "" if leftover.packs == 1 else "s",
                leftover.tokens,
                self.world_size,
                self.grad_accum_steps,
            )

    def state_dict(self) -> dict:
        """Position in the data: the epoch, how many of its steps were consumed, and the layout they were planned
        for (plus the steps of the epoch taken on other layouts before them)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "world_size": self.world_size,
            "grad_accum_steps": self.grad_accum_steps,
            "balance_window_steps": self.packing.balance_window_steps,
            "carried": [dataclasses.asdict(consumed) for consumed in self.carried],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; one saved on another number of ranks continues the epoch with its remaining packs
        (see the class docstring)."""
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self.carried = [ConsumedSteps(**consumed) for consumed in state.get("carried", [])]
        saved_world_size = int(state.get("world_size", self.world_size))
        if saved_world_size != self.world_size:
            if self.step_in_epoch:
                consumed = ConsumedSteps(
                    saved_world_size,
                    int(state["grad_accum_steps"]),
                    int(state["balance_window_steps"]),
                    self.step_in_epoch,
                )
                self.carried.append(consumed)
                logger.info(
                    "%s loader: %d micro-steps of epoch %d were taken on %d ranks; its other packs go to %d ranks",
                    self.name,
                    self.step_in_epoch,
                    self.epoch,
                    saved_world_size,
                    self.world_size,
                )
            self.step_in_epoch = 0
        elif self.step_in_epoch % self.grad_accum_steps:  # saved with another grad_accum_steps
            logger.warning(
                "%s loader resumes at micro-step %d of epoch %d, inside a group of grad_accum_steps=%d: until the "
                "epoch ends, optimizer steps pair different micro-batches than an uninterrupted run would.",
                self.name,
                self.step_in_epoch,
                self.epoch,
                self.grad_accum_steps,
            )


STEP_VISION = "step_vision"
"""Batch key: (any image, any video) over every rank's pack of the micro-step, as Python bools. Every rank plans
the same steps, so each knows which vision calls the others make without a collective (trainer/step.py)."""


def step_vision_kinds(step: list[Pack]) -> tuple[bool, bool]:
    items = [item for pack in step for item in pack.items]
    return any(item.has_images for item in items), any(item.has_videos for item in items)


def worker_start_context() -> multiprocessing.context.BaseContext:
    """Loader workers start from a forkserver, never by forking the training process. Each epoch's workers are
    started by the batch prefetcher's thread (data/prefetch.py) while the main thread launches kernels and compiles;
    a fork then copies locks other threads hold (a module's import lock, a library's mutex), and a child that takes
    one waits forever: the loader stalls on that worker's batch. Python 3.12 warns on fork with threads and 3.14
    changed the default to forkserver; naming it keeps one behaviour on every version. The server preloads
    data/worker_server.py (the pipeline's imports, and the SIGUSR1 stack dump); each worker then imports the main
    module, as spawned processes do, so a script that builds loaders needs its `if __name__ == "__main__"` guard.

    Starts the server if it is not running; a loader with workers calls this when built, so the server's imports
    overlap the model's setup instead of delaying the first batch."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["data.worker_server"])
    multiprocessing.forkserver.ensure_running()
    return context


def ignore_stop_signals(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT (torch's worker loop installs a SIGTERM handler that ends it):
    a scheduler signals every process of a job, and the training process then finishes its step, which may still
    wait for this worker's batch, and saves (lifecycle/preemption.py). The worker ends with the training process
    anyway (data/worker_server.py)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _EpochBatches(IterableDataset):
    """This rank's batches of one epoch from `first_step` on. With DataLoader workers, worker w collates steps
    first_step + w, + w + n, …; the DataLoader reads workers round-robin, so batches arrive in step order.

    `leftover` is set once an iteration has walked the whole plan (in a worker, that worker's copy is set)."""

    def __init__(self, loader: StepLoader, epoch: int, first_step: int):
        self.loader, self.epoch, self.first_step = loader, epoch, first_step
        self.leftover: Leftover | None = None

    def __iter__(self) -> Iterator[dict | WorkerDataError]:
        worker = get_worker_info()
        try:
            yield from self._batches(*((worker.id, worker.num_workers) if worker is not None else (0, 1)))
        except DataError as error:
            if worker is None:
                raise
            yield WorkerDataError(str(error))

    def _batches(self, worker_id: int, num_workers: int) -> Iterator[dict]:
        leftover = Leftover()
        for index, step in enumerate(self.loader.steps(self.epoch, leftover)):
            if index < self.first_step or (index - self.first_step) % num_workers != worker_id:
                continue
            rows = self.loader.fetch([item.key for item in step[self.loader.rank].items])
            batch = self.loader.collate(rows)
            if self.loader.step_vision:
                batch[STEP_VISION] = step_vision_kinds(step)
            yield batch
        self.leftover = leftover


@dataclass(frozen=True)
class WorkerDataError:
    """A DataError raised in a loader worker, handed to the training process in place of the batch, which raises it
    again with the same one-line message: PyTorch's own re-raise would bury the message in a multi-line traceback
    (and train.py's `data error: ...` line with it)."""

    message: str


def _kept_item(row: dict, max_tokens: int, stats: DataStats, raise_errors: bool) -> PackItem | None:
    """A streamed row's PackItem, or None for a skip (counted in `stats`); `row_meta.kept_rows` decides the same
    for a whole processed dataset at once."""
    reason, detail = row["skip_reason"], row["skip_detail"]
    if not reason and row["length"] > max_tokens:
        reason, detail = too_long_reason(bool(row["video_grid_thw"])), too_long_detail(row["length"], max_tokens)
    if reason:
        if raise_errors:  # the processed-dataset cache keeps skips from earlier `on_error: skip` runs
            raise DataError(on_error_raise_message(row["sample_id"], reason, detail))
        stats.skip(reason, row["sample_id"], detail)
        return None
    return PackItem(
        key=row,
        length=int(row["length"]),
        num_patches=int(row["num_patches"]),
        has_images=bool(row["image_grid_thw"]),
        has_videos=bool(row["video_grid_thw"]),
    )


def processing_processes(num_proc: int | None, records: int) -> int:
    """`data.num_proc`, or for None every core this process may use (its CPU affinity: what a cluster's scheduler
    grants it), but no more than one per RECORDS_PER_PROCESS records."""
    if num_proc is not None:
        return num_proc
    cores = cpu_cores()
    return max(1, min(cores, records // RECORDS_PER_PROCESS))


@contextlib.contextmanager
def source_build_lock(cache: str, source_fingerprint: str) -> Iterator[None]:
    """Held while a process lists and processes one source: the other ranks of a node (and other runs sharing the
    cache) wait for it, then load what it wrote, instead of each building the same cache on every core at once."""
    os.makedirs(os.path.join(cache, "locks"), exist_ok=True)
    lock = FileLock(os.path.join(cache, "locks", f"processing-{source_fingerprint}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process to finish processing this data (%s)", lock.lock_file)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def processed_records(records: Dataset, sample_processor: SampleProcessor, fingerprint: str, num_proc: int) -> Dataset:
    """The processed dataset (PROCESSED_FEATURES, one row per record), from the cache when it holds `fingerprint`
    and reads back (core/caches.py's `mapped`: else computed again, said in one line)."""
    run_map = functools.partial(
        records.map,
        sample_processor,
        with_indices=True,
        remove_columns=records.column_names,
        features=PROCESSED_FEATURES,
        num_proc=num_proc if num_proc > 1 else None,
        new_fingerprint=fingerprint,
        desc="processing samples",
    )
    return mapped(records, fingerprint, run_map, "processed data")


def _split(data_cfg: DataConfig, max_tokens: int, processed: Dataset, stats: DataStats):
    """(rows, train row indices, eval row indices) of the processed dataset; counts the records, kept and skipped,
    and the kept training tokens in `stats`."""
    # A fresh map's output: its arrow table is the rows in order (no indices mapping), memory-mapped from the cache.
    table = processed.data.table
    rows = RowMeta.read(table)
    kept = kept_rows(table, rows, max_tokens, stats, data_cfg.on_error == "raise")
    held_out = held_out_rows(len(processed), data_cfg.eval_fraction)
    train_rows, eval_rows = np.flatnonzero(kept & ~held_out), np.flatnonzero(kept & held_out)
    stats.records, stats.kept_train, stats.kept_eval = len(processed), len(train_rows), len(eval_rows)
    stats.train_tokens = int(rows.lengths[train_rows].sum(dtype=np.int64))
    stats.placeholders_added = int(table.column("placeholders_added").to_numpy().sum())
    return rows, train_rows, eval_rows


def in_memory_items(data_cfg: DataConfig, max_tokens: int, processed: Dataset, stats: DataStats):
    """(train items, eval items, fetch) over the processed dataset; counts the records, kept and skipped, in
    `stats`."""
    rows, train_rows, eval_rows = _split(data_cfg, max_tokens, processed, stats)
    train_items = _SampleOrder(rows, train_rows, seed=data_cfg.seed)
    eval_items = _SampleOrder(rows, eval_rows, seed=None)
    return train_items, eval_items, ProcessedRows(processed)


def mixture_items(data_cfg: DataConfig, max_tokens: int, processed: list[Dataset], stats: DataStats):
    """(train items, eval items, fetch) over the sources' processed datasets, in `data.sources` order: training
    samples drawn by weight (`MixtureOrder`), eval the held-out samples of every source in row order. `stats` gets
    each source's counts (in `stats.sources`) and their total."""
    names = source_names(data_cfg.sources)
    parts, train, held, starts, start = [], [], [], [], 0
    for source, name, dataset in zip(data_cfg.sources, names, processed, strict=True):
        source_stats = stats.sources[name] = DataStats()
        rows, train_rows, eval_rows = _split(source_data_config(data_cfg, source), max_tokens, dataset, source_stats)
        stats.add(source_stats)
        if not len(train_rows):
            raise DataError(
                f"data.sources {name} ({source.path}) keeps no training sample, so its weight cannot be drawn: "
                f"{source_stats.summary()}"
            )
        parts.append(rows)
        train.append(train_rows + start)
        held.append(eval_rows + start)
        starts.append(start)
        start += len(dataset)
    rows = RowMeta.concat(parts)
    weights = tuple(source.weight for source in data_cfg.sources)
    train_items = MixtureOrder(rows, tuple(train), weights, seed=data_cfg.seed)
    eval_items = _SampleOrder(rows, np.concatenate(held), seed=None)
    return train_items, eval_items, ProcessedRows(concatenate_datasets(processed), np.asarray(starts, dtype=np.int64))


# The in-memory plan's parts are module-level classes, not closures: loader workers start from a forkserver
# (_EpochBatches), so everything an epoch's plan calls is pickled to them.


@dataclass(frozen=True)
class _SampleOrder:
    """`items(epoch)`: one split's samples as PackItems, reshuffled per epoch when seeded, in row order otherwise.

    `indices`: (n,) int64 row indices of the split."""

    rows: RowMeta
    indices: np.ndarray
    seed: int | None

    def __call__(self, epoch: int) -> Iterator[PackItem]:
        order = self.indices
        if self.seed is not None:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        return pack_items(self.rows, order)


@dataclass(frozen=True)
class ProcessedRows:
    """`fetch(keys)` of the in-memory mode: the processed rows (dicts of PROCESSED_FEATURES) of those row indices,
    read from `dataset`, the memory-mapped processed dataset (a mixture's: its sources' one after another).

    `source_starts`: a mixture's first row of each source; each row then carries `source`, its source's index."""

    dataset: Dataset
    source_starts: np.ndarray | None = None

    def __call__(self, keys: list[int]) -> list[dict]:
        rows = [self.dataset[int(k)] for k in keys]
        if self.source_starts is not None:
            sources = np.searchsorted(self.source_starts, keys, side="right") - 1
            for row, source in zip(rows, sources.tolist(), strict=True):
                row["source"] = source
        return rows


def _streaming(
    data_cfg: DataConfig, packing_cfg: PackingConfig, records, sample_processor: SampleProcessor, stats: DataStats
):
    """Items that carry their processed rows. The first training pass over the data fills `stats`."""
    raise_errors = data_cfg.on_error == "raise"
    indexed = records.map(lambda record, index: {ROW_INDEX_COLUMN: index}, with_indices=True)
    counted_epochs: set[int] = set()

    def items_of(want_eval: bool, shuffle: bool) -> Callable[[int], Iterator[PackItem]]:
        def items(epoch: int) -> Iterator[PackItem]:
            count = shuffle and not counted_epochs
            stream = indexed
            if shuffle:  # through a buffer: rows differ by epoch, the split does not (it uses the original index)
                stream = indexed.shuffle(seed=data_cfg.seed, buffer_size=packing_cfg.buffer_size)
                stream.set_epoch(epoch)
            for record in stream:
                index = record.pop(ROW_INDEX_COLUMN)
                row = sample_processor(record, index)
                held_out = is_eval_row(index, data_cfg.eval_fraction)
                item = _kept_item(row, packing_cfg.max_tokens, stats if count else DataStats(), raise_errors)
                if count:
                    stats.records += 1
                    stats.kept_eval += item is not None and held_out
                    stats.kept_train += item is not None and not held_out
                    stats.placeholders_added += row["placeholders_added"]
                if item is not None and held_out == want_eval:
                    yield item
            if count:
                counted_epochs.add(epoch)
                if stats.placeholders_note():
                    logger.info(stats.placeholders_note())

        return items

    return items_of(False, shuffle=True), items_of(True, shuffle=False), lambda keys: list(keys)


def _collate_then(collate: Callable[[list[dict]], dict], then: Callable[[dict], dict], rows: list[dict]) -> dict:
    """`then(collate(rows))`; module-level so DataLoader workers can pickle it."""
    return then(collate(rows))


def source_records(data_cfg: DataConfig, max_samples: int | None = None):
    """(records, image_root) of one source: its raw records, at most `max_samples` of them (a subset drawn with
    data.seed, kept in file order), and where its relative image paths resolve."""
    records, image_root = open_records(data_cfg, cache_root(data_cfg))
    if max_samples is not None and max_samples < len(records):
        chosen = np.random.default_rng([data_cfg.seed, len(records)]).choice(len(records), max_samples, replace=False)
        records = records.select(np.sort(chosen))
    return records, image_root


def _records(data_cfg: DataConfig, processor, model_config: PretrainedConfig, max_samples: int | None = None):
    """(records, SampleProcessor) of one source: its raw records (`source_records`) and the per-record function
    that processes them."""
    records, image_root = source_records(data_cfg, max_samples)
    sample_processor = SampleProcessor(
        processor,
        model_config,
        data_format=data_cfg.format,
        image_root=image_root,
        min_pixels=data_cfg.min_pixels,
        max_pixels=data_cfg.max_pixels,
        video=VideoSettings.from_config(data_cfg, processor.image_processor),
        raise_errors=data_cfg.on_error == "raise",
        max_visual_tokens=data_cfg.max_visual_tokens,
    )
    return records, sample_processor


def _processed_source(
    data_cfg: DataConfig, processor, model_config: PretrainedConfig, records: Dataset, sample_processor
) -> Dataset:
    """One source's processed dataset, from its own cache (keyed by `processing_fingerprint`) or built once."""
    num_proc = processing_processes(data_cfg.num_proc, len(records))
    with source_build_lock(cache_root(data_cfg), records._fingerprint):
        images = files_signature(list_files(records, sample_processor, num_proc))
        fingerprint = processing_fingerprint(data_cfg, processor, model_config, records._fingerprint, images)
        return processed_records(records, sample_processor, fingerprint, num_proc)


def build_data(
    data_cfg: DataConfig,
    packing_cfg: PackingConfig,
    processor,
    model_config: PretrainedConfig,
    rank: int = 0,
    world_size: int = 1,
    grad_accum_steps: int = 1,
    shard: Callable[[dict], dict] | None = None,
    plan: Callable[[dict], dict] | None = None,
):
    """(train_loader, eval_loader, stats) for the recipe's `data` and `packing` sections.

    `rank` / `world_size` are data-parallel. `shard` (context parallelism, packed mode): applied to every
    collated batch, e.g. this rank's share of the pack (modeling/context_parallel.py's `shard_pack`); every rank
    of a context group passes the group's data-parallel rank, so all of them get the same packs. `plan`: applied
    to every collated batch next (after `shard`), in the loader workers, e.g. the vision tower's host plans
    (modeling/vision_plan.py's `VisionPlanner.add_host_plans`), so the training step does not compute them.

    train_loader: endless over epochs, reshuffled each epoch (seeded), yields this rank's batches (packed or
    padded, docs/architecture.md), each epoch a whole number of optimizer steps of `grad_accum_steps`
    micro-batches, with state_dict()/load_state_dict(). eval_loader: one unshuffled pass over the held-out
    samples, in steps of one batch per rank. stats: DataStats (records, kept per split, skipped per reason).
    """
    stats = DataStats()
    started = time.perf_counter()
    if data_cfg.sources:
        processed = []
        for source in data_cfg.sources:
            source_cfg = source_data_config(data_cfg, source)
            records, sample_processor = _records(source_cfg, processor, model_config, source.max_samples)
            processed.append(_processed_source(source_cfg, processor, model_config, records, sample_processor))
        train_items, eval_items, fetch = mixture_items(data_cfg, packing_cfg.max_tokens, processed, stats)
    else:
        records, sample_processor = _records(data_cfg, processor, model_config)
        if data_cfg.streaming:
            train_items, eval_items, fetch = _streaming(data_cfg, packing_cfg, records, sample_processor, stats)
        else:
            processed = _processed_source(data_cfg, processor, model_config, records, sample_processor)
            train_items, eval_items, fetch = in_memory_items(data_cfg, packing_cfg.max_tokens, processed, stats)
    if not data_cfg.streaming:
        level = logging.WARNING if stats.skipped else logging.INFO
        logger.log(level, "data: %s (ready in %.1f s)", stats.summary(), time.perf_counter() - started)
        for name, source_stats in stats.sources.items():
            logger.log(level, "data source %s: %s", name, source_stats.summary())
        if stats.placeholders_note():
            logger.info(stats.placeholders_note())
    collator = Collator(
        processor.image_processor,
        image_token_id=model_config.image_token_id,
        video_token_id=model_config.video_token_id,
        pad_token_id=processor.tokenizer.pad_token_id,
        raise_errors=data_cfg.on_error == "raise",
        num_sources=len(data_cfg.sources or ()),
    )
    collate = collator.packed if packing_cfg.mode == "packed" else collator.padded
    if shard is not None:
        if packing_cfg.mode != "packed":
            raise ConfigError("a batch shard (context parallelism) needs packing.mode=packed.")
        collate = functools.partial(_collate_then, collate, shard)
    if plan is not None:
        collate = functools.partial(_collate_then, collate, plan)
    common = {"fetch": fetch, "collate": collate, "packing_cfg": packing_cfg, "rank": rank, "world_size": world_size}
    # Streaming counts skips while iterating: that must happen in this process, so it collates inline.
    num_workers = data_cfg.num_workers
    if num_workers is None:
        num_workers = default_loader_workers(torch.cuda.is_available(), cpu_cores(), local_processes())
    common["num_workers"] = 0 if data_cfg.streaming else num_workers
    train_loader = StepLoader(
        train_items,
        seed=data_cfg.seed,
        epochs=None,
        grad_accum_steps=grad_accum_steps,
        stats=stats,
        step_vision=True,
        **common,
    )
    eval_loader = StepLoader(eval_items, seed=data_cfg.seed, epochs=1, name="eval", **common)
    return train_loader, eval_loader, stats
