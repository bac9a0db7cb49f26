"""Videos: frames (frame lists or decoded files), sampling, per-frame resize, patches and frame times.

A video reference (data/formats.py reads them from records) is a file (path or bytes, decoded with PyAV) when its
`frames` is empty, else the frames in time order, taken as sampled at data.video_fps.
Either way at most data.video_max_frames frames are kept, uniformly spread; a file is first sampled to
data.video_fps. Each frame is resized by the image processor's own rule within per-frame pixel bounds, and the
frames are grouped by the vision tower's temporal patch size exactly as transformers' Qwen video processors do
(the last frame repeated to fill the last group), without their torchvision dependency.

Bad videos raise `SampleError` with a video reason; a missing decoder raises `VideoDecoderMissing` for files only.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from data.formats import SampleError, load_image

# Families whose processor writes a "<t seconds>" timestamp before each temporal patch and whose get_rope_index
# gives every temporal patch its own (1, h, w) grid (transformers' Qwen3VLProcessor.replace_video_token).
TIMESTAMPED_VIDEO_MODEL_TYPES = frozenset(("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"))
DEFAULT_MAX_FRAME_TOKENS = 768  # Qwen2-VL's video processor default: 28·28·768 pixels per frame


class VideoDecoderMissing(RuntimeError):
    """A video file needs PyAV to decode it (frame lists need no decoder)."""


def uses_timestamps(model_config) -> bool:
    return model_config.model_type in TIMESTAMPED_VIDEO_MODEL_TYPES


@dataclass
class Clip:
    """The sampled frames of one video: RGB images of one size, the source frame number of each, the source's
    frame rate (data.video_fps for a frame list) and its frame count."""

    frames: list[Image.Image]
    indices: list[int]
    fps: float
    total: int

    @property
    def sampled_fps(self) -> float:
        """Frames per second after sampling (transformers' VideoMetadata.sampled_fps)."""
        return len(self.indices) / self.total * self.fps


def uniform_indices(total: int, count: int) -> list[int]:
    """`count` frame numbers spread evenly over 0..total-1, first and last included (count <= total)."""
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def _frame_list_clip(frames: list[dict], fps: float, max_frames: int) -> Clip:
    if not frames:
        raise SampleError("empty_video", "the video's frame list is empty")
    indices = uniform_indices(len(frames), min(len(frames), max_frames))
    images = []
    for index in indices:
        try:
            images.append(load_image(frames[index]))
        except SampleError as error:
            reason = "missing_video" if error.reason == "missing_image" else "corrupt_video"
            raise SampleError(reason, f"frame {index}: {error.detail}") from None
    return Clip(images, indices, fps, len(frames))


def _decode_file(ref: Mapping, fps: float, max_frames: int) -> Clip:
    """Sample a video file to `fps` (at most `max_frames` frames) with PyAV, decoding it once to count frames when
    the container does not say, then once more keeping only the sampled ones."""
    try:
        import av
    except ImportError:
        raise VideoDecoderMissing(
            "decoding video files needs PyAV: pip install av (see requirements.txt); frame lists need no decoder"
        ) from None
    path, data = ref.get("path"), ref.get("bytes")
    name = path or "<bytes>"
    if data is None and not (path and os.path.isfile(path)):
        raise SampleError("missing_video", f"{name}: no such file")
    source = io.BytesIO(data) if data is not None else path
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise SampleError("corrupt_video", f"{name}: no video stream")
            stream = container.streams.video[0]
            total = stream.frames or sum(1 for _ in container.decode(stream))
            rate = float(stream.average_rate or stream.guessed_rate or 0) or fps  # no rate: as a frame list
            if total == 0:
                raise SampleError("empty_video", f"{name}: no frames")
            count = min(max(1, int(total / rate * fps)), max_frames, total)  # floored, as transformers' samplers
            wanted = uniform_indices(total, count)
            container.seek(0)
            frames = []
            for number, frame in enumerate(container.decode(stream)):
                if number == wanted[len(frames)]:  # distinct and increasing (uniform_indices with count <= total)
                    frames.append(frame.to_image().convert("RGB"))
                    if len(frames) == len(wanted):
                        break
    except av.FFmpegError as error:
        raise SampleError("corrupt_video", f"{name}: {error}") from None
    if not frames:
        raise SampleError("corrupt_video", f"{name}: no frame could be decoded")
    # A container that promised more frames than it holds: keep the sampled frames it has.
    return Clip(frames, wanted[: len(frames)], rate, total)


def load_clip(ref: Mapping, fps: float, max_frames: int) -> Clip:
    """The sampled frames of a resolved video reference. SampleError: missing_video, corrupt_video, empty_video,
    video_frame_size_mismatch; VideoDecoderMissing for a file without PyAV."""
    if ref.get("frames"):
        clip = _frame_list_clip(list(ref["frames"]), fps, max_frames)
    elif ref.get("path") or ref.get("bytes"):
        clip = _decode_file(ref, fps, max_frames)
    else:
        raise SampleError("empty_video", "the video's frame list is empty")
    sizes = {frame.size for frame in clip.frames}
    if len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes))
        raise SampleError("video_frame_size_mismatch", f"frames of one video differ in size ({shown})")
    return clip


def video_size_kwargs(
    image_processor,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_min_pixels: int | None = None,
    video_max_pixels: int | None = None,
) -> dict:
    """Image-processor call kwargs bounding each frame's pixels: data.video_min/max_pixels; by default the image
    bounds (data.min/max_pixels or the processor's), the upper one capped at DEFAULT_MAX_FRAME_TOKENS LLM tokens
    per frame so a long video at full image resolution cannot take the whole pack (or the GPU's memory)."""
    size = image_processor.size
    low = video_min_pixels or min_pixels or size["shortest_edge"]
    high = video_max_pixels
    if high is None:
        tokens_cap = DEFAULT_MAX_FRAME_TOKENS * (image_processor.patch_size * image_processor.merge_size) ** 2
        high = max(low, min(max_pixels or size["longest_edge"], tokens_cap))
    return {"size": {"shortest_edge": low, "longest_edge": high}}


@dataclass(frozen=True)
class VideoSettings:
    """How videos become frames: frame-list rate / file sampling rate, frame cap, per-frame image-processor kwargs."""

    fps: float
    max_frames: int
    size_kwargs: dict

    @classmethod
    def from_config(cls, data_cfg, image_processor) -> VideoSettings:
        """From the recipe's `data` section (core.data_config.DataConfig)."""
        size = video_size_kwargs(
            image_processor,
            data_cfg.min_pixels,
            data_cfg.max_pixels,
            data_cfg.video_min_pixels,
            data_cfg.video_max_pixels,
        )
        return cls(data_cfg.video_fps, data_cfg.video_max_frames, size)


def video_grid(image_processor, size_kwargs: dict, clip: Clip) -> list[int]:
    """(t, h, w) patch grid of a clip: t = ceil(frames / temporal_patch_size), h and w from the image processor's
    resize rule (smart_resize) on the frame size."""
    patch, merge = image_processor.patch_size, image_processor.merge_size
    size = size_kwargs["size"]
    width, height = clip.frames[0].size
    try:
        height, width = smart_resize(
            height, width, factor=patch * merge, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
        )
    except ValueError as error:  # e.g. an aspect ratio beyond 200
        raise SampleError("corrupt_video", f"{clip.frames[0].width}x{clip.frames[0].height} frames: {error}") from None
    temporal = image_processor.temporal_patch_size
    return [-(-len(clip.frames) // temporal), height // patch, width // patch]


def video_patches(image_processor, size_kwargs: dict, clip: Clip) -> tuple[torch.Tensor, list[int]]:
    """pixel_values_videos (t·h·w, C·tp·p·p) float32 and the grid (t, h, w) of one clip.

    Each frame goes through the image processor alone (temporal_patch_size 1: its patches in the merge-window order
    the vision tower reads); consecutive frames are then stacked on the temporal axis, the last frame repeated to
    fill the last group, which is the layout of transformers' Qwen2VLVideoProcessor.patchify.
    """
    temporal = image_processor.temporal_patch_size
    out = image_processor(images=clip.frames, temporal_patch_size=1, return_tensors="pt", **size_kwargs)
    frames = len(clip.frames)
    grid = out["image_grid_thw"][0].tolist()
    per_frame = out["pixel_values"].float().view(frames, grid[1] * grid[2], -1, image_processor.patch_size**2)
    if pad := -frames % temporal:
        per_frame = torch.cat([per_frame, per_frame[-1:].expand(pad, -1, -1, -1)])
    groups = per_frame.view(-1, temporal, *per_frame.shape[1:])  # (t, tp, h·w, C, p·p)
    patches = groups.permute(0, 2, 3, 1, 4).reshape(-1, temporal * per_frame.shape[2] * per_frame.shape[3])
    return patches, [groups.shape[0], grid[1], grid[2]]


def second_per_grid(clip: Clip, temporal_patch_size: int) -> float:
    """Seconds spanned by one temporal patch (Qwen2.5-VL's second_per_grid_ts: temporal_patch_size / sampled fps)."""
    return temporal_patch_size / clip.sampled_fps


def grid_timestamps(clip: Clip, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch as Qwen3VLProcessor computes them: the mean time of the patch's first and
    last frame, the last frame number repeated to fill the last patch (tests check it against the processor's)."""
    indices = list(clip.indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [index / clip.fps for index in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]
