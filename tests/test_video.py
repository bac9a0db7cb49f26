"""Video inputs (data/video.py, formats, processing): record layouts, frames and files, patches, timestamps, skips."""

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from transformers.video_utils import VideoMetadata

from core.config import load_config
from core.families import hf_config
from data.formats import SampleError, normalize_record
from data.pipeline import build_data, load_processor
from data.processing import SampleProcessor
from data.video import (
    VideoDecoderMissing,
    VideoSettings,
    load_clip,
    second_per_grid,
    video_patches,
)

VIDEO_ID = 6  # the tiny processor's <|video_pad|>


def tiny(family: str, cache, *overrides: str):
    cfg = load_config(f"recipes/tiny-{family}.yaml", [f"data.cache_dir={cache}", "data.num_workers=0", *overrides])
    return cfg, load_processor(cfg.model, cfg.data), hf_config(cfg.model)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("video-cache")


def write_frames(directory: Path, count: int, size=(112, 84), prefix="f") -> list[str]:
    """`count` PNG frames of a red dot moving right; their file names (relative to `directory`)."""
    names = []
    for i in range(count):
        image = Image.new("RGB", size, (250, 250, 250))
        ImageDraw.Draw(image).ellipse((5 + 9 * i, 30, 25 + 9 * i, 50), fill=(200, 30, 30))
        names.append(f"{prefix}{i}.png")
        image.save(directory / names[-1])
    return names


def write_mp4(path: Path, frames: int = 30, fps: int = 10, size=(96, 64)) -> None:
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), 240, dtype=np.uint8)
            pixels[20:40, 2 * i : 2 * i + 20] = (200, 30, 30)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())


def llava(value: str, **keys) -> dict:
    return {"conversations": [{"from": "human", "value": value}, {"from": "gpt", "value": "Right."}], **keys}


def test_record_layouts_name_the_same_videos():
    """A string is one file; a flat frame list is one video; a list of files or of frame lists is several videos;
    `video` and LLaMA-Factory's `videos` read alike; messages take inline video parts; counts must match."""
    frames = ["a.png", "b.png"]
    one_list = normalize_record(llava("<video> go", video=frames), "auto")[2]
    assert one_list == [{"path": None, "bytes": None, "frames": [{"path": p, "bytes": None} for p in frames]}]
    assert normalize_record(llava("<video> go", videos=frames), "auto")[2] == one_list
    assert [v["path"] for v in normalize_record(llava("<video><video>", video=["x.mp4", "y.MOV"]), "auto")[2]] == [
        "x.mp4",
        "y.MOV",
    ]
    as_dicts = normalize_record(llava("<video><video>", videos=[{"path": "x.mp4"}, {"path": "y.mp4"}]), "auto")[2]
    assert [v["path"] for v in as_dicts] == ["x.mp4", "y.mp4"] and not as_dicts[0]["frames"]
    two = normalize_record(llava("<video> <video>", videos=[frames, ["c.png"]]), "auto")[2]
    assert [len(v["frames"]) for v in two] == [2, 1]
    mixed = normalize_record(llava("<image> then <video>", image="i.png", video="v.mp4"), "auto")
    assert [item["type"] for item in mixed[0][0]["content"]] == ["image", "text", "video"]
    message = {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "go?"}]}
    record = {"messages": [message, {"role": "assistant", "content": "Right."}]}
    assert normalize_record(record, "auto")[2] == one_list
    with pytest.raises(SampleError) as error:
        normalize_record(llava("<video> <video>", video=frames), "auto")
    assert error.value.reason == "video_count_mismatch"


def test_frame_lists_are_taken_at_video_fps_and_capped(tmp_path):
    """A frame list keeps every frame at data.video_fps; over data.video_max_frames it keeps an even spread, first
    and last included, and its seconds per temporal patch grow accordingly (Qwen2.5-VL's tp / sampled fps)."""
    refs = [{"path": str(tmp_path / name), "bytes": None} for name in write_frames(tmp_path, 10)]
    clip = load_clip({"path": None, "bytes": None, "frames": refs}, fps=2.0, max_frames=64)
    assert clip.indices == list(range(10)) and second_per_grid(clip, 2) == 1.0
    capped = load_clip({"path": None, "bytes": None, "frames": refs}, fps=2.0, max_frames=4)
    assert capped.indices == [0, 3, 6, 9] and second_per_grid(capped, 2) == pytest.approx(2.5)


def _transformers_video_patchify():
    """transformers' own Qwen2VLVideoProcessor.patchify, compiled from its source (the module imports torchvision,
    which this environment lacks; the method itself is plain torch)."""
    source = Path(transformers.__file__).parent / "models/qwen2_vl/video_processing_qwen2_vl.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    method.decorator_list = []
    namespace = {"torch": torch}
    exec(compile(ast.Module([method], []), str(source), "exec"), namespace)
    return namespace["patchify"]


@pytest.mark.parametrize("frames", [4, 5])
def test_video_patches_equal_transformers_video_patchify(tmp_path, cache, frames):
    """Frame-by-frame patches stacked by temporal_patch_size equal transformers' video patchify of the same frames
    (odd frame counts: the last frame repeated), so the ViT sees what the real video processor would give it."""
    _, processor, _ = tiny("qwen2_5_vl", cache)
    image_processor = processor.image_processor
    refs = [{"path": str(tmp_path / n), "bytes": None} for n in write_frames(tmp_path, frames, size=(112, 56))]
    clip = load_clip({"path": None, "bytes": None, "frames": refs}, fps=2.0, max_frames=64)
    raw = {"do_resize": False, "do_rescale": False, "do_normalize": False}  # compare the layout on raw pixels
    patches, grid = video_patches(image_processor, raw, clip)
    video = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1).float() for f in clip.frames])[None]
    patchify = _transformers_video_patchify()
    expected, *expected_grid = patchify(None, video, image_processor.patch_size, image_processor.merge_size, 2)
    assert grid == expected_grid
    assert torch.equal(patches, expected[0])


def test_a_still_video_equals_its_image(tmp_path, cache):
    """temporal_patch_size identical frames give exactly the image processor's pixel_values for that frame."""
    _, processor, _ = tiny("qwen3_vl", cache)
    name = write_frames(tmp_path, 1)[0]
    ref = {"path": str(tmp_path / name), "bytes": None}
    clip = load_clip({"path": None, "bytes": None, "frames": [ref, ref]}, fps=2.0, max_frames=64)
    patches, grid = video_patches(processor.image_processor, {}, clip)
    image = processor.image_processor(images=[clip.frames[0]], return_tensors="pt")
    assert grid == image["image_grid_thw"][0].tolist()
    assert torch.equal(patches, image["pixel_values"].float())


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_timestamped_tokens_equal_the_qwen3_processor(tmp_path, cache, family):
    """Qwen3-VL/3.5: a video's tokens are what Qwen3VLProcessor.replace_video_token writes (one "<t seconds>"
    stamp, vision_start, the patch's tokens, vision_end per temporal patch), tokenized."""
    _, processor, model_config = tiny(family, cache)
    refs = [{"path": str(tmp_path / n), "bytes": None} for n in write_frames(tmp_path, 7)]
    settings = VideoSettings(fps=2.0, max_frames=5, size_kwargs={})
    sample_processor = SampleProcessor(processor, model_config, video=settings)
    clip = load_clip({"path": None, "bytes": None, "frames": refs}, settings.fps, settings.max_frames)
    grid = [3, 6, 8]
    processor.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    try:
        metadata = VideoMetadata(total_num_frames=7, fps=2.0, frames_indices=clip.indices)
        text = processor.replace_video_token({"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}, 0)
    finally:
        processor.video_processor = None
    expected = processor.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert sample_processor.video_tokens(clip, grid) == expected
    assert "<0.5 seconds>" in text and expected.count(VIDEO_ID) == 3 * 12


def test_video_files_decode_at_video_fps(tmp_path, cache):
    """A video file (path or bytes) is sampled to data.video_fps with PyAV: 3 s at 10 fps → 6 frames, evenly
    spread, at the file's own frame rate; it trains like a frame list (grid and positions from the pipeline)."""
    write_mp4(tmp_path / "clip.mp4")
    clip = load_clip({"path": str(tmp_path / "clip.mp4"), "bytes": None, "frames": []}, fps=2.0, max_frames=64)
    assert clip.indices == [0, 6, 12, 17, 23, 29] and clip.fps == 10 and clip.frames[0].size == (96, 64)
    from_bytes = load_clip({"path": None, "bytes": (tmp_path / "clip.mp4").read_bytes()}, fps=2.0, max_frames=4)
    assert from_bytes.indices == [0, 10, 19, 29]
    _, processor, model_config = tiny("qwen2_5_vl", cache)
    row = SampleProcessor(processor, model_config, image_root=str(tmp_path))(llava("<video>", video="clip.mp4"), 0)
    assert row["skip_reason"] == "" and row["video_grid_thw"][0][0] == 3 and row["second_per_grid_ts"] == [1.0]


def test_missing_decoder_is_an_error_for_files_only(tmp_path, monkeypatch):
    """Without PyAV, a video file raises VideoDecoderMissing (naming the package); frame lists still load."""
    monkeypatch.setitem(sys.modules, "av", None)
    refs = [{"path": str(tmp_path / n), "bytes": None} for n in write_frames(tmp_path, 2)]
    assert len(load_clip({"path": None, "bytes": None, "frames": refs}, 2.0, 8).frames) == 2
    (tmp_path / "clip.mp4").write_bytes(b"whatever")
    with pytest.raises(VideoDecoderMissing, match="pip install av"):
        load_clip({"path": str(tmp_path / "clip.mp4"), "bytes": None, "frames": []}, 2.0, 8)


def test_bad_videos_are_counted_skips_and_good_samples_survive(tmp_path, cache):
    """Each bad video is skipped under its own reason (missing or corrupt frame, empty frame list, frames of
    different sizes, undecodable file, placeholder/video count mismatch, too many frames for the pack); the good
    image and video records are all kept."""
    pytest.importorskip("av")
    good = write_frames(tmp_path, 4)
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    big = write_frames(tmp_path, 2, size=(224, 112), prefix="big")
    long = write_frames(tmp_path, 40, size=(448, 448), prefix="long")
    records = {
        "good-video": llava("<video> where?", video=good),
        "good-image": llava("<image> what?", image=good[0]),
        "good-both": llava("<image> and <video>", image=good[0], videos=[good]),
        "missing_video": llava("<video>", video=[good[0], "nope.png"]),
        "corrupt_video": llava("<video>", video=[good[0], "corrupt.png"]),
        "empty_video": llava("<video>", video=[]),
        "video_frame_size_mismatch": llava("<video>", video=[good[0], big[0]]),
        "undecodable": llava("<video>", video="broken.mp4"),
        "video_count_mismatch": llava("<video> <video>", video=good),
        "video_too_long": llava("<video>", video=long),
    }
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": key, **record}) + "\n" for key, record in records.items()))
    cfg, processor, model_config = tiny(
        "qwen2_5_vl", cache, f"data.path={data}", "data.eval_fraction=0", "packing.max_tokens=1024"
    )
    _, _, stats = build_data(cfg.data, cfg.packing, processor, model_config)
    assert stats.kept_train == 3
    expected = {reason: 1 for reason in records if not reason.startswith("good") and reason != "undecodable"}
    expected["corrupt_video"] = 2  # the corrupt frame and the undecodable file
    assert dict(stats.skipped) == expected
    assert "video_too_long=1" in stats.summary()


def test_parquet_video_column_of_bytes_trains(tmp_path, cache):
    """A parquet dataset whose `videos` column is datasets' Video feature holding file bytes is read undecoded and
    sampled by data/video.py like a file on disk."""
    from datasets import Dataset, List, Video

    write_mp4(tmp_path / "clip.mp4")
    row = {
        "id": "p",
        **llava("<video> what?"),
        "videos": [{"path": None, "bytes": (tmp_path / "clip.mp4").read_bytes()}],
    }
    Dataset.from_list([row, {**row, "id": "q"}]).cast_column("videos", List(Video())).to_parquet(
        str(tmp_path / "v.parquet")
    )
    cfg, processor, model_config = tiny(
        "qwen3_vl", cache, f"data.path={tmp_path / 'v.parquet'}", "data.eval_fraction=0"
    )
    train, _, stats = build_data(cfg.data, cfg.packing, processor, model_config)
    assert stats.kept_train == 2 and not stats.skipped
    batch = next(iter(train))
    assert batch["video_grid_thw"][:, 0].tolist() == [3, 3]  # 6 frames at 2 fps in 2-frame temporal patches
