"""Processed samples → the batch tensors of docs/architecture.md ("The packed batch"), on the host, once per batch.

Packed: one (1, T) row of concatenated samples with cu_seqlens / seq_idx / 4-row positions. Padded: (B, S) rows,
right-padded, with an attention mask. In both, `shift_labels[t]` is the target of position t: the label of token
t+1 of the same sample, and -100 at each sample's last token, so no position predicts across a boundary.
`label_rows` lists the positions that have a label, so the loss gathers those rows of the final hidden states and
the lm_head never multiplies a row without one (most of a vision pack's rows: image, video and prompt tokens).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

from data.formats import DataError, SampleError, load_image
from data.processing import IGNORE_INDEX, bounds_kwargs, empty_row
from data.video import Clip, load_clip, video_patches

logger = logging.getLogger(__name__)
TEXT, IMAGE, VIDEO = 0, 1, 2
# The batch's image and video inputs the model's forward takes (docs/architecture.md, "The packed batch"), None where
# a pack has none; VIDEO_SECONDS (None likewise) only shapes positions, which the batch carries precomputed.
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
VIDEO_SECONDS = "second_per_grid_ts"


def label_rows(shift_labels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """long (n,): the flat indices (into `shift_labels.reshape(-1)`, i.e. the rows of the flattened final hidden
    states) of the positions whose label is not IGNORE_INDEX, ascending. Made on the host with the batch, so the
    loss knows n without reading the device."""
    flat = np.asarray(shift_labels).reshape(-1)
    return torch.from_numpy(np.flatnonzero(flat != IGNORE_INDEX).astype(np.int64))


class Collator:
    """Builds batches from processed rows (dicts with the columns of processing.PROCESSED_FEATURES).

    Each row carries how its pixels are made (`image_sizes`, `video_settings`: its source's settings, or those of
    data.max_visual_tokens), so one collator serves every source of a mixture. Rows fetched from a mixture carry
    `source` (the source's index): the batch then counts samples and tokens per source (`num_source_samples`,
    `num_source_tokens`, lists of `num_sources` Python ints).

    Args: image_processor (makes pixel_values and, frame by frame, pixel_values_videos; must be the one the rows
    were processed with), image_token_id / video_token_id / pad_token_id (the model's ids), raise_errors
    (data.on_error=raise: an image or video that no longer loads is an error instead of a counted skip),
    num_sources (the mixture's sources; 0 for one data.path).
    """

    def __init__(
        self,
        image_processor,
        image_token_id: int,
        video_token_id: int,
        pad_token_id: int | None,
        raise_errors: bool = False,
        num_sources: int = 0,
    ):
        self.image_processor = image_processor
        self.num_sources = num_sources
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0
        self.raise_errors = raise_errors

    def stand_in(self, row: dict) -> dict:
        """A row of the same length with no image, no video and no label: it keeps the pack (and so the plan, the
        rank balance and the resume position) as planned while contributing nothing to the loss."""
        length = int(row["length"])
        text = empty_row(
            sample_id=row["sample_id"],
            input_ids=[self.pad_token_id] * length,
            labels=[IGNORE_INDEX] * length,
            mrope_positions=[list(range(length))] * 3,
            length=length,
        )
        return {**row, **text}

    def decoded(self, rows: list[dict]) -> tuple[list[dict], list, list[Clip], int]:
        """(rows, their images and video clips decoded in order, how many rows were replaced by stand-ins).

        The processed-data cache checks every image file when it is built, but a file can still vanish or break
        while the run reads it: that sample becomes a logged stand-in instead of a crash in a loader worker."""
        out_rows, images, clips, skipped = [], [], [], 0
        for row in rows:
            try:
                row_images = [load_image(ref) for ref in row["images"]]
                row_clips = self.clips(row)
            except SampleError as error:
                if self.raise_errors:
                    raise DataError(f"sample {row['sample_id']}: {error} (data.on_error=skip skips it)") from None
                logger.warning("skipping sample %s at load time (%s): %s", row["sample_id"], error.reason, error.detail)
                out_rows.append(self.stand_in(row))
                skipped += 1
                continue
            out_rows.append(row)
            images += row_images
            clips += row_clips
        return out_rows, images, clips, skipped

    @staticmethod
    def clips(row: dict) -> list[Clip]:
        """The row's videos sampled as at processing (each video's stored frame rate and frame cap)."""
        return [
            load_clip(ref, settings["fps"], settings["max_frames"])
            for ref, settings in zip(row["videos"], row["video_settings"], strict=True)
        ]

    def sample_arrays(self, row: dict) -> dict[str, np.ndarray]:
        """Per-sample arrays: input_ids (L,), shift_labels (L,), positions (4, L), token_types (L,)."""
        input_ids = np.asarray(row["input_ids"], dtype=np.int64)
        labels = np.asarray(row["labels"], dtype=np.int64)
        shift_labels = np.full_like(labels, IGNORE_INDEX)
        shift_labels[:-1] = labels[1:]
        text_positions = np.arange(len(input_ids), dtype=np.int64)[None]
        positions = np.concatenate([text_positions, np.asarray(row["mrope_positions"], dtype=np.int64)], axis=0)
        token_types = np.where(
            input_ids == self.image_token_id, IMAGE, np.where(input_ids == self.video_token_id, VIDEO, TEXT)
        )
        return {
            "input_ids": input_ids,
            "shift_labels": shift_labels,
            "positions": positions,
            "token_types": token_types,
        }

    def vision_inputs(self, rows: list[dict], images: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """pixel_values (P, C·tp·p·p) float32 and image_grid_thw (n_images, 3) long, in sample order; or Nones.
        `images`: the rows' decoded images, in order."""
        if not images:
            return None, None
        stored = torch.tensor([grid for row in rows for grid in row["image_grid_thw"]], dtype=torch.long)
        bounds = [tuple(size) for row in rows for size in row["image_sizes"]]
        pixels, grids, start = [], [], 0
        for size, run in itertools.groupby(bounds):  # one processor call per run of images with the same bounds
            count = len(list(run))
            out = self.image_processor(
                images=images[start : start + count], return_tensors="pt", **bounds_kwargs(*size)
            )
            pixels.append(out["pixel_values"].float())
            grids.append(out["image_grid_thw"].long())
            start += count
        if not torch.equal(torch.cat(grids), stored):
            raise RuntimeError(
                "image grids differ from the processed dataset's: the image processor or data.min/max_pixels changed "
                "since preprocessing; delete the data cache (data.cache_dir) to reprocess."
            )
        return torch.cat(pixels), stored

    def video_inputs(self, rows: list[dict], clips: list[Clip]) -> dict:
        """pixel_values_videos (P, C·tp·p·p) float32, video_grid_thw (n_videos, 3) long and second_per_grid_ts
        (n_videos,) float64, in sample order; or Nones. `clips`: the rows' decoded videos, in order."""
        if not clips:
            return {"pixel_values_videos": None, "video_grid_thw": None, "second_per_grid_ts": None}
        stored = torch.tensor([grid for row in rows for grid in row["video_grid_thw"]], dtype=torch.long)
        patches, grids = [], []
        settings = [video for row in rows for video in row["video_settings"]]
        for clip, video in zip(clips, settings, strict=True):
            size = bounds_kwargs(video["min_pixels"], video["max_pixels"])
            pixels, grid = video_patches(self.image_processor, size, clip)
            patches.append(pixels)
            grids.append(grid)
        if not torch.equal(torch.tensor(grids, dtype=torch.long), stored):
            raise RuntimeError(
                "video grids differ from the processed dataset's: the image processor, data.video_* settings or the "
                "video files changed since preprocessing; delete the data cache (data.cache_dir) to reprocess."
            )
        # float64 as at processing, so a reference that recomputes positions from it gets the same ones
        seconds = torch.tensor([s for row in rows for s in row["second_per_grid_ts"]], dtype=torch.float64)
        return {"pixel_values_videos": torch.cat(patches), "video_grid_thw": stored, "second_per_grid_ts": seconds}

    def counts(
        self, input_ids: np.ndarray, shift_labels: np.ndarray, token_types: np.ndarray, rows: list[dict], skipped: int
    ) -> dict:
        num_image_tokens = int((token_types == IMAGE).sum())
        per_source = {}
        if self.num_sources:
            samples, tokens = [0] * self.num_sources, [0] * self.num_sources
            for row in rows:
                samples[row["source"]] += 1
                tokens[row["source"]] += int(row["length"])
            per_source = {"num_source_samples": samples, "num_source_tokens": tokens}
        return {
            **per_source,
            "num_skipped_samples": skipped,
            "num_label_tokens": int((shift_labels != IGNORE_INDEX).sum()),
            "num_text_tokens": int((token_types == TEXT).sum()),
            "num_image_tokens": num_image_tokens,
            "num_video_tokens": int((token_types == VIDEO).sum()),
            "num_vision_patches": sum(int(row["num_patches"]) for row in rows),
            "sample_lengths": [int(row["length"]) for row in rows],
        }

    def packed(self, rows: list[dict]) -> dict:
        """One pack: input_ids (1, T) long, position_ids (4, 1, T) long, shift_labels (1, T) long, label_rows
        (n,) long (`label_rows`), mm_token_type_ids (1, T) int32, cu_seqlens (n+1,) int32, max_seqlen int,
        seq_idx (1, T) int32, pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw /
        second_per_grid_ts, and the Python-int counts."""
        rows, images, clips, skipped = self.decoded(rows)
        parts = [self.sample_arrays(row) for row in rows]
        lengths = [len(p["input_ids"]) for p in parts]
        input_ids = np.concatenate([p["input_ids"] for p in parts])
        shift_labels = np.concatenate([p["shift_labels"] for p in parts])
        token_types = np.concatenate([p["token_types"] for p in parts])
        positions = np.concatenate([p["positions"] for p in parts], axis=1)
        cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        seq_idx = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        pixel_values, image_grid_thw = self.vision_inputs(rows, images)
        return {
            "input_ids": torch.from_numpy(input_ids)[None],
            "position_ids": torch.from_numpy(positions)[:, None],
            "shift_labels": torch.from_numpy(shift_labels)[None],
            "label_rows": label_rows(shift_labels),
            "mm_token_type_ids": torch.from_numpy(token_types.astype(np.int32))[None],
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
            **self.video_inputs(rows, clips),
            "cu_seqlens": torch.from_numpy(cu_seqlens),
            "max_seqlen": max(lengths),
            "seq_idx": torch.from_numpy(seq_idx)[None],
            **self.counts(input_ids, shift_labels, token_types, rows, skipped),
        }

    def padded(self, rows: list[dict]) -> dict:
        """B samples right-padded to S = the longest: input_ids (B, S) long, attention_mask (B, S) long,
        position_ids (4, B, S) long (0 on padding), shift_labels (B, S) long (-100 on padding), label_rows (n,) long
        (flat indices into B·S), mm_token_type_ids (B, S) int32, pixel_values / image_grid_thw, the video inputs,
        and the Python-int counts."""
        rows, images, clips, skipped = self.decoded(rows)
        parts = [self.sample_arrays(row) for row in rows]
        batch, width = len(parts), max(len(p["input_ids"]) for p in parts)
        input_ids = np.full((batch, width), self.pad_token_id, dtype=np.int64)
        attention_mask = np.zeros((batch, width), dtype=np.int64)
        shift_labels = np.full((batch, width), IGNORE_INDEX, dtype=np.int64)
        token_types = np.zeros((batch, width), dtype=np.int32)
        positions = np.zeros((4, batch, width), dtype=np.int64)
        for b, part in enumerate(parts):
            n = len(part["input_ids"])
            input_ids[b, :n] = part["input_ids"]
            attention_mask[b, :n] = 1
            shift_labels[b, :n] = part["shift_labels"]
            token_types[b, :n] = part["token_types"]
            positions[:, b, :n] = part["positions"]
        pixel_values, image_grid_thw = self.vision_inputs(rows, images)
        real = attention_mask.astype(bool)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "position_ids": torch.from_numpy(positions),
            "shift_labels": torch.from_numpy(shift_labels),
            "label_rows": label_rows(shift_labels),
            "mm_token_type_ids": torch.from_numpy(token_types),
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
            **self.video_inputs(rows, clips),
            **self.counts(input_ids[real], shift_labels[real], token_types[real], rows, skipped),
        }
