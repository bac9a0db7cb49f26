"""The built-in dataset: seeded, deterministic synthetic images and videos with questions a tiny model can learn.

Every answer is determined by the image(s), the video or the question and uses a handful of fixed templates, so a
tiny model's loss falls well below its starting value within a few hundred steps. Image sizes and aspect ratios
vary, so samples have different image-token counts (which is what packing has to cope with). Videos are short
frame lists of a shape moving across the frame (which way it moves is the answer, so the temporal order matters),
some paired with an image in the same record.

`write_builtin_dataset(directory, num_samples, seed, video_share, kinds)` writes `images/*.png` and `data.jsonl` in
LLaVA/ShareGPT form (`conversations` with `from`/`value`, `<image>` / `<video>` placeholders, `image` a path or a
list of paths, `video` a list of frame paths, `category` the question kind), so the built-in dataset goes through
exactly the same loader as user data. Every kind but the text-only ones (TEXT_KINDS) needs the image or video to be
answered: held-out accuracy on those kinds shows whether a model looks (inference/builtin_eval.py).
The kinds' names are declared with the recipe schema (core/data_config.py's KINDS), which `data.builtin_kinds`
checks against.
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from core.caches import built_directory
from core.data_config import EXTRA_IMAGE_KINDS, IMAGE_KINDS, TEXT_KINDS, VIDEO_KINDS

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (240, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = {"white": (250, 250, 250), "black": (15, 15, 15), "gray": (128, 128, 128)}
WORDS = ("cat", "dog", "sun", "tree", "boat", "fish", "star", "moon", "bird", "cake", "ship", "rain")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six")
REGIONS = ("top left", "top right", "bottom left", "bottom right")
# (width, height) in pixels: with the tiny processors (patch 14 or 16, merge 2) these give ~16-150 image tokens.
IMAGE_SIZES = ((112, 112), (168, 112), (112, 196), (224, 224), (280, 168), (168, 308), (336, 252), (252, 336))
KIND_WEIGHTS = (3, 3, 2, 2, 2, 1, 1, 1)  # one per IMAGE_KINDS entry
TEXT_ONLY_SHARE = 0.15
VIDEO_SHARE = 0.2  # default share of video samples (data.video_share)
DIRECTIONS = {  # (start, end) of the centre in fractions of the frame
    "from left to right": ((0.2, 0.5), (0.8, 0.5)),
    "from right to left": ((0.8, 0.5), (0.2, 0.5)),
    "from top to bottom": ((0.5, 0.2), (0.5, 0.8)),
    "from bottom to top": ((0.5, 0.8), (0.5, 0.2)),
}
VIDEO_SIZES = ((112, 112), (168, 112), (112, 168), (224, 168))  # with patch 14, merge 2: 16-48 tokens per 2 frames
VIDEO_FRAMES = (3, 4, 5, 6, 8)  # odd counts too: the last temporal patch repeats the last frame


@dataclass
class Shape:
    kind: str
    color: str
    center: tuple[int, int]
    radius: int


@dataclass
class Scene:
    """What one image shows: its size, background, shapes and optional word."""

    size: tuple[int, int]
    background: str
    shapes: list[Shape] = field(default_factory=list)
    word: str | None = None


@dataclass
class SyntheticSample:
    """A conversation (alternating human/gpt turns, `<image>` / `<video>` placeholders), the scenes its images show
    and, per video, the scenes of its frames; `kind` is its question kind (one of KINDS)."""

    turns: list[tuple[str, str]]
    scenes: list[Scene]
    videos: list[list[Scene]] = field(default_factory=list)
    kind: str = ""


def _plural(noun: str, count: int) -> str:
    return noun if count == 1 else noun + "s"


def _place_shapes(rng: random.Random, size: tuple[int, int], count: int, kind: str, color: str) -> list[Shape]:
    """`count` non-overlapping shapes on a grid of cells, so counting them is unambiguous."""
    cols, rows = 3, 3
    cells = rng.sample([(c, r) for c in range(cols) for r in range(rows)], count)
    cell_w, cell_h = size[0] / cols, size[1] / rows
    radius = max(6, int(min(cell_w, cell_h) * 0.35))
    return [Shape(kind, color, (int((c + 0.5) * cell_w), int((r + 0.5) * cell_h)), radius) for c, r in sorted(cells)]


def _single_shape_in_region(rng: random.Random, size: tuple[int, int]) -> tuple[Shape, str]:
    region = rng.choice(REGIONS)
    x = size[0] * (0.25 if "left" in region else 0.75)
    y = size[1] * (0.25 if "top" in region else 0.75)
    radius = max(8, int(min(size) * 0.15))
    shape = Shape(rng.choice(SHAPES), rng.choice(list(COLORS)), (int(x), int(y)), radius)
    return shape, region


def _random_scene(rng: random.Random) -> Scene:
    return Scene(size=rng.choice(IMAGE_SIZES), background=rng.choice(list(BACKGROUNDS)))


def _image_question(rng: random.Random, kind: str) -> SyntheticSample:
    """One image-grounded conversation of the given kind."""
    scene = _random_scene(rng)
    if kind == "count":
        shape, color, count = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.randint(1, 6)
        scene.shapes = _place_shapes(rng, scene.size, count, shape, color)
        question = f"How many {shape}s are in the image?"
        answer = f"There {'is' if count == 1 else 'are'} {NUMBER_WORDS[count]} {_plural(shape, count)}."
        return SyntheticSample([("human", "<image>\n" + question), ("gpt", answer)], [scene])
    if kind == "color":
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        scene.shapes = _place_shapes(rng, scene.size, 1, shape, color)
        return SyntheticSample(
            [("human", f"<image>\nWhat colour is the {shape}?"), ("gpt", f"The {shape} is {color}.")], [scene]
        )
    if kind == "position":
        shape, region = _single_shape_in_region(rng, scene.size)
        scene.shapes = [shape]
        question = f"Where is the {shape.color} {shape.kind}?"
        return SyntheticSample([("human", f"<image>\n{question}"), ("gpt", f"It is in the {region}.")], [scene])
    if kind == "text":
        scene.word = rng.choice(WORDS)
        return SyntheticSample(
            [("human", "<image>\nWhat word is written in the image?"), ("gpt", f"The word is {scene.word}.")], [scene]
        )
    if kind == "caption":
        shape, color, count = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.randint(1, 4)
        scene.shapes = _place_shapes(rng, scene.size, count, shape, color)
        what = f"{NUMBER_WORDS[count].capitalize()} {color} {_plural(shape, count)}"
        answer = f"{what} on a {scene.background} background."
        return SyntheticSample([("human", "<image>\nDescribe the image."), ("gpt", answer)], [scene])
    if kind == "multi_count":
        second = _random_scene(rng)
        first_count, second_count = rng.sample(range(1, 7), 2)
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        scene.shapes = _place_shapes(rng, scene.size, first_count, shape, color)
        second.shapes = _place_shapes(rng, second.size, second_count, shape, color)
        winner = "first" if first_count > second_count else "second"
        question = f"<image>\n<image>\nWhich image has more {shape}s?"
        return SyntheticSample([("human", question), ("gpt", f"The {winner} image.")], [scene, second])
    if kind == "multi_color":
        second = _random_scene(rng)
        shape = rng.choice(SHAPES)
        first_color, second_color = rng.sample(list(COLORS), 2)
        scene.shapes = _place_shapes(rng, scene.size, 1, shape, first_color)
        second.shapes = _place_shapes(rng, second.size, 1, shape, second_color)
        question = f"Image 1: <image>\nImage 2: <image>\nWhat colour is the {shape} in each image?"
        answer = f"It is {first_color} in the first image and {second_color} in the second."
        return SyntheticSample([("human", question), ("gpt", answer)], [scene, second])
    if kind == "background":
        shape, color, count = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.randint(1, 3)
        scene.shapes = _place_shapes(rng, scene.size, count, shape, color)
        question = "<image>\nWhat colour is the background?"
        return SyntheticSample([("human", question), ("gpt", f"The background is {scene.background}.")], [scene])
    if kind == "multi_turn":
        shape, color, count = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.randint(1, 6)
        scene.shapes = _place_shapes(rng, scene.size, count, shape, color)
        turns = [
            ("human", f"<image>\nWhat colour are the {shape}s?"),
            ("gpt", f"They are {color}."),
            ("human", "How many are there?"),
            ("gpt", f"There {'is' if count == 1 else 'are'} {NUMBER_WORDS[count]}."),
        ]
        return SyntheticSample(turns, [scene])
    raise ValueError(f"unknown synthetic sample kind {kind!r}; expected one of {IMAGE_KINDS + EXTRA_IMAGE_KINDS}.")


def _text_only(rng: random.Random, kind: str | None = None) -> SyntheticSample:
    """An arithmetic or spelling question (`kind`; None: either, evenly)."""
    if kind is None:
        kind = "arithmetic" if rng.random() < 0.5 else "spelling"
    if kind == "arithmetic":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        turns = [("human", f"What is {a} plus {b}?"), ("gpt", f"{a} plus {b} is {a + b}.")]
        return SyntheticSample(turns, [], kind=kind)
    word = rng.choice(WORDS)
    return SyntheticSample([("human", f"Spell the word {word}."), ("gpt", " ".join(word.upper()) + ".")], [], kind=kind)


def _moving_shape(rng: random.Random) -> tuple[list[Scene], Shape, str]:
    """Frames of one shape moving in a straight line; (frames, the shape in the first frame, the direction)."""
    size, background = rng.choice(VIDEO_SIZES), rng.choice(list(BACKGROUNDS))
    direction = rng.choice(list(DIRECTIONS))
    (x0, y0), (x1, y1) = DIRECTIONS[direction]
    kind, color, count = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.choice(VIDEO_FRAMES)
    radius = max(6, int(min(size) * 0.12))
    frames = []
    for i in range(count):
        f = i / (count - 1)
        center = (int(size[0] * (x0 + f * (x1 - x0))), int(size[1] * (y0 + f * (y1 - y0))))
        frames.append(Scene(size, background, [Shape(kind, color, center, radius)]))
    return frames, frames[0].shapes[0], direction


def _video_question(rng: random.Random, kind: str) -> SyntheticSample:
    """One video-grounded conversation of the given kind."""
    frames, shape, direction = _moving_shape(rng)
    if kind == "direction":
        question = f"<video>\nWhich way does the {shape.color} {shape.kind} move?"
        return SyntheticSample([("human", question), ("gpt", f"It moves {direction}.")], [], [frames])
    if kind == "direction_and_image":
        scene = _random_scene(rng)
        color = rng.choice([shape.color, rng.choice(list(COLORS))])
        scene.shapes = _place_shapes(rng, scene.size, 1, shape.kind, color)
        same = "the same colour" if color == shape.color else "a different colour"
        question = f"<image>\n<video>\nIs the moving {shape.kind} the colour of the one in the image?"
        answer = f"It is {same}; it moves {direction}."
        return SyntheticSample([("human", question), ("gpt", answer)], [scene], [frames])
    raise ValueError(f"unknown synthetic video kind {kind!r}; expected one of {VIDEO_KINDS}.")


def _sample_of_kind(rng: random.Random, kind: str) -> SyntheticSample:
    if kind in VIDEO_KINDS:
        return _video_question(rng, kind)
    if kind in TEXT_KINDS:
        return _text_only(rng, kind)
    return _image_question(rng, kind)


def generate_samples(
    num_samples: int, seed: int, video_share: float = VIDEO_SHARE, kinds: Sequence[str] | None = None
) -> list[SyntheticSample]:
    """The conversations and scenes of the built-in dataset (no pixels drawn); same arguments, same list.

    `kinds` (a subset of KINDS): draw each sample's kind uniformly from these instead of the default mix
    (`video_share` video samples, TEXT_ONLY_SHARE of the rest text-only, the image kinds by KIND_WEIGHTS)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num_samples):
        if kinds:
            kind = rng.choice(list(kinds))
            sample = _sample_of_kind(rng, kind)
        else:
            draw = rng.random()
            if draw < video_share:
                kind = rng.choice(VIDEO_KINDS)
                sample = _video_question(rng, kind)
            elif draw < video_share + TEXT_ONLY_SHARE * (1 - video_share):
                sample = _text_only(rng)
                kind = sample.kind
            else:
                kind = rng.choices(IMAGE_KINDS, KIND_WEIGHTS)[0]
                sample = _image_question(rng, kind)
        sample.kind = kind
        samples.append(sample)
    return samples


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def draw_scene(scene: Scene) -> Image.Image:
    """Render a scene as an RGB image of `scene.size` (width, height)."""
    image = Image.new("RGB", scene.size, BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        x, y, r = shape.center[0], shape.center[1], shape.radius
        fill = COLORS[shape.color]
        if shape.kind == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif shape.kind == "square":
            draw.rectangle((x - r, y - r, x + r, y + r), fill=fill)
        else:
            draw.polygon(((x, y - r), (x - r, y + r), (x + r, y + r)), fill=fill)
    if scene.word is not None:
        ink = (255, 255, 255) if scene.background == "black" else (0, 0, 0)
        font = _font(max(14, min(scene.size) // 4))
        draw.text((scene.size[0] // 2, scene.size[1] // 2), scene.word, fill=ink, font=font, anchor="mm")
    return image


def to_llava_record(
    index: int, sample: SyntheticSample, image_paths: list[str], video_frames: list[list[str]] = ()
) -> dict:
    """A LLaVA/ShareGPT record: `image` is a path (one image), a list (several), or absent (text only); `video`
    is one video's frame list, a list of frame lists (several), or absent; `category` is the question kind."""
    record = {"id": f"builtin-{index:06d}", "conversations": [{"from": r, "value": v} for r, v in sample.turns]}
    if sample.kind:
        record["category"] = sample.kind
    if len(image_paths) == 1:
        record["image"] = image_paths[0]
    elif image_paths:
        record["image"] = image_paths
    if len(video_frames) == 1:
        record["video"] = video_frames[0]
    elif video_frames:
        record["video"] = list(video_frames)
    return record


def write_builtin_dataset(
    directory: str | os.PathLike,
    num_samples: int,
    seed: int,
    video_share: float = VIDEO_SHARE,
    kinds: Sequence[str] | None = None,
) -> Path:
    """Write the built-in dataset (images/ + data.jsonl) into `directory` unless it is already there and reads back.

    Returns the path of data.jsonl. Written into a temporary sibling and renamed, with a manifest of its files
    (core/caches.py), so a crash never leaves a half-written dataset that a later run would trust, and a damaged
    one is written again.
    """
    directory = built_directory(
        Path(directory),
        functools.partial(_write_samples, num_samples=num_samples, seed=seed, video_share=video_share, kinds=kinds),
        "the built-in dataset",
    )
    return directory / "data.jsonl"


def _write_samples(directory: Path, num_samples: int, seed: int, video_share: float, kinds) -> None:
    (directory / "images").mkdir()
    with open(directory / "data.jsonl", "w") as out:
        for index, sample in enumerate(generate_samples(num_samples, seed, video_share, kinds)):
            paths = []
            for image_index, scene in enumerate(sample.scenes):
                relative = f"images/{index:06d}_{image_index}.png"
                draw_scene(scene).save(directory / relative, optimize=False, compress_level=1)
                paths.append(relative)
            videos = []
            for video_index, frames in enumerate(sample.videos):
                videos.append([f"images/{index:06d}_v{video_index}_{i}.png" for i in range(len(frames))])
                for relative, scene in zip(videos[-1], frames, strict=True):
                    draw_scene(scene).save(directory / relative, optimize=False, compress_level=1)
            out.write(json.dumps(to_llava_record(index, sample, paths, videos)) + "\n")


def corpus_texts(num_samples: int = 4000, seed: int = 1234) -> list[str]:
    """Conversation texts of the generator plus the chat template's fixed words, to train the tiny tokenizer on."""
    template_words = ["system\nYou are a helpful assistant.", "user\n", "assistant\n"] * 200
    turns = [
        text.replace("<image>", "").replace("<video>", "")
        for sample in generate_samples(num_samples, seed)
        for _, text in sample.turns
    ]
    stamps = [f"<{tenths / 10:.1f} seconds>" for tenths in range(100)]  # Qwen3-VL/3.5 video timestamps
    return template_words + turns + stamps
