"""Talk to a trained run: an interactive terminal session, or one question for scripts.

    python -m scripts.chat --run runs/smoke                                   # interactive
    python -m scripts.chat --run runs/smoke --prompt "What colour is the circle? img/0.png"   # one answer, then exit

An image or video goes into a message as its path: a word of the message that names an existing image file (or a
video file, or a directory of frame images) becomes that image or video at its place in the message. The
conversation carries over between turns (`/reset` starts again, `/quit` or Ctrl-D ends; an empty answer is left out
of it). Prompts are built as
training builds them, with the run's pixel and frame settings (scripts/generate.py's flags override them); answers
are greedy unless `--do-sample`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from accelerate import PartialState

from core.config_tree import ConfigError
from data.formats import VIDEO_EXTENSIONS, SampleError
from inference import evaluate
from inference.generation import Generator
from inference.loading import load_run
from scripts.generate import DTYPES, add_generation_args, generation_settings, pixel_overrides

IMAGE_EXTENSIONS = frozenset((".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"))


def user_turn(text: str) -> tuple[dict, list[dict], list[dict]]:
    """(a canonical user message, its image references, its video references) from a line of text in which words
    that name an image file, a video file or a directory of frames become that image or video."""
    content, images, videos, words = [], [], [], []

    def flush_words() -> None:
        if words:
            content.append({"type": "text", "text": " ".join(words)})
            words.clear()

    for word in text.split():
        path = Path(os.path.expanduser(word))
        suffix = path.suffix.lower()
        if path.is_file() and suffix in IMAGE_EXTENSIONS - {".gif"}:
            flush_words()
            content.append({"type": "image"})
            images.append({"path": str(path.resolve()), "bytes": None})
        elif (path.is_file() and suffix in VIDEO_EXTENSIONS) or (path.is_dir() and _frames(path)):
            flush_words()
            content.append({"type": "video"})
            frames = [{"path": str(f), "bytes": None} for f in _frames(path)] if path.is_dir() else []
            videos.append({"path": None if frames else str(path.resolve()), "bytes": None, "frames": frames})
        else:
            words.append(word)
    flush_words()
    return {"role": "user", "content": content}, images, videos


def _frames(directory: Path) -> list[Path]:
    return sorted(p.resolve() for p in directory.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)


class Chat:
    """A conversation with a loaded run: `ask(text) -> answer` keeps the turns (and their images and videos)."""

    def __init__(self, args: argparse.Namespace):
        state = PartialState()
        loaded = load_run(args.run, args.checkpoint, state.device, DTYPES[args.dtype], pixel_overrides(args))
        config = loaded.model.config
        self.builder = evaluate.prompt_builder_for(loaded.processor, config, loaded.data, image_root=None)
        collator = evaluate.collator_for(loaded.processor, config)
        self.generator = Generator(
            loaded.model,
            loaded.processor.tokenizer,
            collator,
            generation_settings(args),
            max_positions=evaluate.context_length(config),
        )
        self.source = loaded.source
        self.reset()

    def reset(self) -> None:
        self.messages, self.images, self.videos = [], [], []

    def ask(self, text: str) -> str:
        message, images, videos = user_turn(text)
        if not message["content"]:
            raise SampleError("empty_text", "the message is empty")
        messages, images, videos = [*self.messages, message], self.images + images, self.videos + videos
        answer = self.generator.generate([self.builder.conversation(messages, images, videos)])[0]
        if answer:  # an empty answer is no turn a prompt can hold: the exchange is left out of the conversation
            self.messages = [*messages, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
            self.images, self.videos = images, videos
        return answer


def interactive(chat: Chat) -> None:
    print(f"chatting with {chat.source}: image/video paths in a message are read; /reset, /quit (or Ctrl-D)")
    while True:
        try:
            text = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            chat.reset()
            continue
        if not text:
            continue
        try:
            print(f"model> {chat.ask(text)}")
        except SampleError as error:  # a missing or unreadable image: say so and keep the session
            print(f"(not sent: {error.reason}: {error.detail})")


def main(argv: list[str] | None = None) -> int | str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generation_args(parser)
    parser.add_argument("--prompt", help="one message: print the answer and exit (for scripts)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        chat = Chat(args)
        if args.prompt is not None:
            print(chat.ask(args.prompt))
            return 0
    except ConfigError as error:
        return f"error: {error}"
    except SampleError as error:
        return f"error: {error.reason}: {error.detail}"
    interactive(chat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
