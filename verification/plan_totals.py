"""What one epoch of a recipe's data plan holds, summed without decoding a sample: packs, tokens, padded tokens and
per-row counts (images, patches, videos, frames) from the processed dataset's arrow columns
(scripts/inspect_data.py prints them; the data-scale tests and measurements compare them).
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.pipeline import ProcessedRows

ROW_COUNTS = ("images", "image_patches", "videos", "video_temporal_patches", "video_patches", "frames", "video_samples")


def _grid_counts(column: pa.ChunkedArray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of a List(List(int)) grid column ((n, 3) grids per row): grids, t·h·w patches, t temporal patches."""
    per_row = pc.list_value_length(column).to_numpy()
    grids = pc.list_flatten(pc.list_flatten(column)).to_numpy().reshape(-1, 3).astype(np.int64)
    owner = np.repeat(np.arange(rows), per_row)
    patches = np.bincount(owner, weights=grids.prod(1), minlength=rows)
    temporal = np.bincount(owner, weights=grids[:, 0], minlength=rows)
    return per_row, patches.astype(np.int64), temporal.astype(np.int64)


def row_counts(table: pa.Table) -> np.ndarray:
    """(N, len(ROW_COUNTS)) int64: each processed row's ROW_COUNTS, from the arrow columns (no row is decoded)."""
    rows = table.num_rows
    images, image_patches, _ = _grid_counts(table.column("image_grid_thw"), rows)
    videos, video_patches, temporal = _grid_counts(table.column("video_grid_thw"), rows)
    videos_per_row = pc.list_value_length(table.column("videos")).to_numpy()
    frames_per_video = pc.list_value_length(pc.struct_field(pc.list_flatten(table.column("videos")), "frames"))
    owner = np.repeat(np.arange(rows), videos_per_row)
    frames = np.bincount(owner, weights=frames_per_video.to_numpy(), minlength=rows).astype(np.int64)
    return np.stack([images, image_patches, videos, temporal, video_patches, frames, videos > 0], 1).astype(np.int64)


def _row_count(row: dict) -> list[int]:
    """ROW_COUNTS of one processed row (a dict), as `row_counts` gives them."""
    images, videos = row["image_grid_thw"], row["video_grid_thw"]
    return [
        len(images),
        sum(t * h * w for t, h, w in images),
        len(videos),
        sum(t for t, _, _ in videos),
        sum(t * h * w for t, h, w in videos),
        sum(len(video["frames"]) for video in row["videos"]),
        bool(videos),
    ]


def epoch_totals(loader) -> dict[str, int]:
    """Epoch 0's planned packs, tokens, padded tokens (padded mode) and ROW_COUNTS summed over its samples; for a
    mixture also `source_samples` and `source_tokens`, lists in data.sources order.

    Walks the plan once, holding one step at a time: the in-memory mode counts how often each row is planned (a
    mixture may repeat a row) and sums their counts from the processed dataset's columns; the streaming mode
    (whose keys are the rows) sums row by row."""
    totals = dict.fromkeys(("packs", "tokens", "padded_tokens", *ROW_COUNTS), 0)
    in_memory = isinstance(loader.fetch, ProcessedRows)
    planned = np.zeros(len(loader.fetch.dataset) if in_memory else 0, dtype=np.int64)
    streamed = np.zeros(len(ROW_COUNTS), dtype=np.int64)
    for step in loader.steps(0):
        for pack in step:
            totals["packs"] += 1
            totals["tokens"] += pack.tokens
            totals["padded_tokens"] += len(pack.items) * max(item.length for item in pack.items)
            if in_memory:
                np.add.at(planned, [item.key for item in pack.items], 1)
            else:
                streamed += np.sum([_row_count(item.key) for item in pack.items], axis=0, dtype=np.int64)
    if in_memory:
        table = loader.fetch.dataset.data.table
        streamed = (row_counts(table) * planned[:, None]).sum(0)
        starts = loader.fetch.source_starts
        if starts is not None:
            lengths = table.column("length").to_numpy().astype(np.int64)
            spans = list(itertools.pairwise([*starts.tolist(), len(planned)]))
            totals["source_samples"] = [int(planned[a:b].sum()) for a, b in spans]
            totals["source_tokens"] = [int((planned[a:b] * lengths[a:b]).sum()) for a, b in spans]
    return totals | dict(zip(ROW_COUNTS, streamed.tolist(), strict=True))
