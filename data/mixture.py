"""A weighted mixture of sources (`data.sources`): which samples of which source an epoch trains on, and in which
order.

Each source is processed and cached on its own (data/pipeline.py); the mixture only plans over their rows, so
adding or reweighting a source reprocesses nothing. An epoch holds as many samples as the sources' kept training
samples together; source i's share of them is weight_i / Σ weights (rounded by largest remainder, so the shares
are exact to one sample). Each source is drawn from its own endless stream of passes, every pass a fresh seeded
permutation of its samples, and epoch e takes the next `quota` samples of that stream: a source weighted above its
size repeats (whole passes, then part of the next), one weighted below it is subsampled, and the next epochs go on
through the samples it has not yet shown. The epoch's samples of all sources are then shuffled together (seeded).
Everything is a function of (data.seed, epoch), so a resumed run replans the epoch and skips the steps it took.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data.packing import PackItem
from data.row_meta import RowMeta, pack_items


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
    """`items(epoch)`: the mixture's training samples of an epoch as PackItems (module docstring).

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
