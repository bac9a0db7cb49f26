"""The processed dataset's per-row metadata as numpy arrays read from its arrow columns, and what the pipeline
derives from it: which rows are kept (the skip accounting), which are held out for eval, and which a mixture's
epoch draws.

The processed dataset stays memory-mapped on disk; only the few columns read here are touched, once, into (N,)
arrays of a few bytes per row, so a million-record dataset costs tens of MB, never a Python object per row.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.formats import SKIP_REASONS, DataError
from data.packing import PackItem

logger = logging.getLogger("data.pipeline")  # the pipeline's log, which users filter by
SKIP_EXAMPLES_LOGGED = 3
ITEMS_PER_READ = 4096  # samples whose metadata the plan reads from the numpy arrays at once


@dataclass
class DataStats:
    """What happened to the records: kept per split, skipped per reason (streaming: updated while iterating)."""

    records: int = 0
    kept_train: int = 0
    kept_eval: int = 0
    skipped: Counter = field(default_factory=Counter)
    skip_examples: dict[str, list[str]] = field(default_factory=dict)
    train_tokens: int = 0  # tokens of the kept training samples (in-memory mode)
    placeholders_added: int = 0  # records with media and no placeholders, given them (data/formats.py)
    sources: dict[str, DataStats] = field(default_factory=dict)  # a mixture's stats per source name, in order

    def skip(self, reason: str, sample_id: str, detail: str) -> None:
        self.skipped[reason] += 1
        examples = self.skip_examples.setdefault(reason, [])
        if len(examples) < SKIP_EXAMPLES_LOGGED:
            examples.append(f"{sample_id}: {detail}")
            logger.warning("skipping sample %s (%s): %s", sample_id, reason, detail)

    def summary(self) -> str:
        reasons = ", ".join(f"{r}={self.skipped[r]}" for r in SKIP_REASONS if self.skipped[r]) or "none"
        return (
            f"records={self.records} kept_train={self.kept_train} kept_eval={self.kept_eval} "
            f"skipped={sum(self.skipped.values())} ({reasons})"
        )

    def placeholders_note(self) -> str | None:
        """The one line that says placeholders were added, and to how many records (per source for a mixture)."""
        if not self.placeholders_added:
            return None
        sources = ", ".join(
            f"{name}: {s.placeholders_added}" for name, s in self.sources.items() if s.placeholders_added
        )
        return (
            f"data: {self.placeholders_added} records have images or videos but no <image> / <video> placeholder"
            f"{f' ({sources})' if sources else ''}; each got one per image and video in front of its first user "
            "turn, as LLaMA-Factory does"
        )

    def add(self, other: DataStats) -> None:
        """Count `other`'s records, samples, skips and examples in these stats too (a mixture's total)."""
        self.records += other.records
        self.kept_train += other.kept_train
        self.kept_eval += other.kept_eval
        self.train_tokens += other.train_tokens
        self.placeholders_added += other.placeholders_added
        self.skipped.update(other.skipped)
        for reason, examples in other.skip_examples.items():
            self.skip_examples.setdefault(reason, []).extend(examples)


def too_long_detail(length: int, max_tokens: int) -> str:
    return f"{length} tokens > packing.max_tokens {max_tokens}"


def on_error_raise_message(sample_id: str, reason: str, detail: str) -> str:
    return f"sample {sample_id}: {reason}: {detail} (data.on_error=skip skips it)"


def too_long_reason(has_videos: bool) -> str:
    """A video sample over budget is one with too many frames for the pack (data.video_max_frames / pixels)."""
    return "video_too_long" if has_videos else "too_long"


def eval_period(eval_fraction: float) -> int:
    """Every eval_period-th record is held out (0: none): stable, and the same when streaming."""
    return max(1, round(1 / eval_fraction)) if eval_fraction > 0 else 0


def is_eval_row(index: int, eval_fraction: float) -> bool:
    period = eval_period(eval_fraction)
    return period > 0 and index % period == 0


def held_out_rows(count: int, eval_fraction: float) -> np.ndarray:
    """(count,) bool: `is_eval_row` of every row index."""
    period = eval_period(eval_fraction)
    return np.arange(count) % period == 0 if period else np.zeros(count, dtype=bool)


def _has_items(column: pa.ChunkedArray) -> np.ndarray:
    """(N,) bool: whether each row's list is non-empty (reads the list offsets only, not the values)."""
    return pc.list_value_length(column).to_numpy() > 0


@dataclass(frozen=True)
class RowMeta:
    """What the plan reads per processed row (kept or skipped), as (N,) arrays indexed by row.

    lengths: int32 tokens; patches: int32 ViT patches (images and videos); kinds: bool (N, 2), (has images, has
    videos); skipped: bool, a skip_reason set at processing."""

    lengths: np.ndarray
    patches: np.ndarray
    kinds: np.ndarray
    skipped: np.ndarray

    @classmethod
    def read(cls, table: pa.Table) -> RowMeta:
        """From the columns of PROCESSED_FEATURES in `table` (the processed dataset's arrow table)."""
        return cls(
            lengths=table.column("length").to_numpy().astype(np.int32, copy=False),
            patches=table.column("num_patches").to_numpy().astype(np.int32, copy=False),
            kinds=np.stack([_has_items(table.column("image_grid_thw")), _has_items(table.column("video_grid_thw"))], 1),
            skipped=pc.not_equal(table.column("skip_reason"), "").to_numpy(),
        )

    @classmethod
    def concat(cls, parts: list[RowMeta]) -> RowMeta:
        """The rows of `parts` one after another (a mixture's sources)."""
        return cls(*(np.concatenate([getattr(part, name) for part in parts]) for name in cls.__dataclass_fields__))


def kept_rows(table: pa.Table, meta: RowMeta, max_tokens: int, stats: DataStats, raise_errors: bool) -> np.ndarray:
    """(N,) bool: the rows that become samples; the others (a skip_reason, or longer than `max_tokens`) are counted
    in `stats` per reason, the first SKIP_EXAMPLES_LOGGED of each logged as examples in row order, as skipping them
    one by one would. With `raise_errors`, DataError naming the first such row instead."""
    too_long = ~meta.skipped & (meta.lengths > max_tokens)
    reasons = list(SKIP_REASONS)
    code = np.full(len(meta.lengths), -1, dtype=np.int16)  # index into `reasons` of each row's skip, -1 kept
    skipped = np.flatnonzero(meta.skipped)
    if skipped.size:
        encoded = pc.dictionary_encode(table.column("skip_reason").take(skipped)).combine_chunks()
        names = encoded.dictionary.to_pylist()
        reasons += [name for name in names if name not in reasons]
        code[skipped] = np.asarray([reasons.index(name) for name in names], dtype=np.int16)[encoded.indices]
    code[too_long & ~meta.kinds[:, 1]] = reasons.index(too_long_reason(False))
    code[too_long & meta.kinds[:, 1]] = reasons.index(too_long_reason(True))
    bad = code >= 0
    if raise_errors and bad.any():
        first = int(np.argmax(bad))
        raise DataError(on_error_raise_message(*_skip_of(table, meta, first, reasons[code[first]], max_tokens)))
    counts = {reasons[c]: int(n) for c, n in enumerate(np.bincount(code[bad], minlength=len(reasons))) if n}
    examples = {reason: np.flatnonzero(code == reasons.index(reason))[:SKIP_EXAMPLES_LOGGED] for reason in counts}
    for row in np.sort(np.concatenate([rows for rows in examples.values()])) if counts else ():
        sample_id, reason, detail = _skip_of(table, meta, int(row), reasons[code[row]], max_tokens)
        stats.skip(reason, sample_id, detail)
    for reason, count in counts.items():
        stats.skipped[reason] += count - len(examples[reason])  # the examples were counted by stats.skip
    return ~bad


def _skip_of(table: pa.Table, meta: RowMeta, row: int, reason: str, max_tokens: int) -> tuple[str, str, str]:
    """(sample id, reason, detail) of a skipped row."""
    sample_id = table.column("sample_id")[row].as_py()
    if meta.skipped[row]:
        return sample_id, reason, table.column("skip_detail")[row].as_py()
    return sample_id, reason, too_long_detail(int(meta.lengths[row]), max_tokens)


def pack_items(rows: RowMeta, order: np.ndarray) -> Iterator[PackItem]:
    """PackItems of the row indices `order`, in order, made ITEMS_PER_READ at a time as the plan consumes them, so
    only the planner's buffer of them is alive."""
    for start in range(0, len(order), ITEMS_PER_READ):
        keys = order[start : start + ITEMS_PER_READ]
        lengths, patches, kinds = rows.lengths[keys].tolist(), rows.patches[keys].tolist(), rows.kinds[keys]
        for key, length, num_patches, (has_images, has_videos) in zip(
            keys.tolist(), lengths, patches, kinds.tolist(), strict=True
        ):
            yield PackItem(key, length, num_patches, has_images=has_images, has_videos=has_videos)


# A weighted mixture of sources (data.sources): which samples of which source an epoch trains on, in which order.


def quotas(weights: list[float], total: int) -> np.ndarray:
    """(n,) int64: `total` samples split in proportion to `weights`, by largest remainder (sums to `total`)."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(shares).astype(np.int64)
    remainders = shares - counts
    counts[np.argsort(-remainders, kind="stable")[: total - int(counts.sum())]] += 1
    return counts


def stream_slice(indices: np.ndarray, seed: int, source: int, start: int, count: int) -> np.ndarray:
    """Samples start .. start+count-1 of a source's endless stream: pass k is `indices` permuted by the generator
    seeded [seed, source, k]."""
    size = len(indices)
    if count == 0:
        return indices[:0]
    first, last = start // size, (start + count - 1) // size
    passes = [np.random.default_rng([seed, source, k]).permutation(indices) for k in range(first, last + 1)]
    offset = start - first * size
    return np.concatenate(passes)[offset : offset + count]


@dataclass(frozen=True)
class MixtureOrder:
    """`items(epoch)`: the mixture's training samples of an epoch as PackItems.

    Each source is processed and cached on its own (data/pipeline.py); the mixture only plans over their rows, so
    adding or reweighting a source reprocesses nothing. An epoch holds as many samples as the sources' kept training
    samples together; source i's share of them is weight_i / Σ weights (rounded by largest remainder, so the shares
    are exact to one sample). Each source is drawn from its own endless stream of passes, every pass a fresh seeded
    permutation of its samples, and epoch e takes the next `quota` samples of that stream: a source weighted above its
    size repeats (whole passes, then part of the next), one weighted below it is subsampled, and the next epochs go on
    through the samples it has not yet shown. The epoch's samples of all sources are then shuffled together (seeded).
    Everything is a function of (data.seed, epoch), so a resumed run replans the epoch and skips the steps it took.

    rows: the sources' RowMeta one after another; indices: per source, its training rows' indices into `rows`
    (int64); weights: per source (> 0); seed: data.seed."""

    rows: RowMeta
    indices: tuple[np.ndarray, ...]
    weights: tuple[float, ...]
    seed: int

    def epoch_quotas(self) -> np.ndarray:
        """(n_sources,) samples each source gives an epoch."""
        return quotas(list(self.weights), sum(len(ix) for ix in self.indices))

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's row indices, in training order."""
        picks = [
            stream_slice(indices, self.seed, source, epoch * int(quota), int(quota))
            for source, (indices, quota) in enumerate(zip(self.indices, self.epoch_quotas(), strict=True))
        ]
        chosen = np.concatenate(picks)
        return chosen[np.random.default_rng([self.seed, epoch]).permutation(len(chosen))]

    def __call__(self, epoch: int) -> Iterator[PackItem]:
        return pack_items(self.rows, self.order(epoch))
