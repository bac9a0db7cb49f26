"""Batched generation over prepared prompts: HF `model.generate` with its KV cache, greedy unless sampling is asked.

A batch is the prompts' token ids left-padded to one width (generation appends on the right), their attention mask
and `mm_token_type_ids` (Qwen2.5-VL falls back to 1-D positions without it), and the pixels of their images and
videos made by data/collate.py's `Collator` exactly as the training batches' are (the image processor with the run's
pixel bounds; videos frame by frame with the run's frame settings). The model computes its mRoPE positions itself
from the ids and grids, as it did for the same ids in training.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from core.config_tree import ConfigError
from data.collate import IMAGE, TEXT, VIDEO, Collator
from data.formats import load_image
from inference.prompts import EvalPrompt


@dataclass(frozen=True)
class GenerationSettings:
    """How answers are drawn: greedy by default; `do_sample` with temperature / top_p / top_k otherwise."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0  # > 0: no EOS before this many tokens (benchmarks time a fixed answer length)
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    repetition_penalty: float = 1.0
    seed: int = 0  # seeds sampling (greedy ignores it)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise ConfigError(f"a sampling temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    def as_dict(self) -> dict:
        return asdict(self)


def stop_token_ids(model_generation_eos, tokenizer) -> list[int]:
    """The ids that end an answer: the model's generation-config EOS ids and the chat template's turn end."""
    ids = model_generation_eos if isinstance(model_generation_eos, list) else [model_generation_eos]
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    extra = [tokenizer.eos_token_id, turn_end if isinstance(turn_end, int) and turn_end >= 0 else None]
    return sorted({i for i in [*ids, *extra] if i is not None})


class Generator:
    """`generate(prompts) -> answers` for one model: the batch inputs (module docstring), `model.generate` under
    `autocast()` (a context manager factory: the training compute dtype when the weights are fp32 masters), the new
    tokens decoded.

    `synced` keeps every process generating until the longest answer of any process ends (transformers'
    `synced_gpus`): needed when the ranks' forwards are collectives (FSDP2). `root`: the FSDP2 root module that holds
    `model` (the training module), whose own parameters (those outside the per-layer units: embeddings, lm_head,
    norms, merger) it gathers around each generate call, since generate calls the model below the root's hooks."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        collator: Collator,
        settings: GenerationSettings,
        max_positions: int | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
        synced: bool = False,
        root: torch.nn.Module | None = None,
    ):
        settings.validate()
        self.model, self.tokenizer, self.collator, self.settings = model, tokenizer, collator, settings
        self.max_positions = max_positions
        self.autocast = autocast
        self.synced = synced
        self.root = root if isinstance(root, FSDPModule) else None
        self.pad_id = collator.pad_token_id
        self.stop_ids = stop_token_ids(model.generation_config.eos_token_id, tokenizer)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its HF model
        self.takes_seconds = "second_per_grid_ts" in inspect.signature(base.forward).parameters

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def batch_inputs(self, rows: Sequence[dict]) -> dict:
        """Model inputs of processed prompt rows: input_ids / attention_mask / mm_token_type_ids (B, S) left-padded,
        and the pixels and grids of their images and videos (None-valued keys dropped)."""
        width = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids = torch.tensor(row["input_ids"], dtype=torch.long)
            input_ids[b, width - len(ids) :] = ids
            attention_mask[b, width - len(ids) :] = 1
        token_types = torch.where(
            input_ids == self.collator.image_token_id,
            IMAGE,
            torch.where(input_ids == self.collator.video_token_id, VIDEO, TEXT),
        )
        token_types = token_types * attention_mask
        images = [load_image(ref) for row in rows for ref in row["images"]]
        clips = [clip for row in rows for clip in self.collator.clips(row)]
        pixel_values, image_grid_thw = self.collator.vision_inputs(list(rows), images)
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "mm_token_type_ids": token_types,
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
            **self.collator.video_inputs(list(rows), clips),
        }
        if not self.takes_seconds:
            inputs.pop("second_per_grid_ts")  # only Qwen2.5-VL's forward takes it
        return {key: value for key, value in inputs.items() if value is not None}

    def new_token_budget(self, rows: Sequence[dict]) -> int:
        """max_new_tokens, cut so the longest prompt plus its answer fits the model's context."""
        if self.max_positions is None:
            return self.settings.max_new_tokens
        longest = max(len(row["input_ids"]) for row in rows)
        return max(1, min(self.settings.max_new_tokens, self.max_positions - longest))

    @torch.no_grad()
    def generate_rows(self, rows: Sequence[dict]) -> list[str]:
        """The answer to each processed prompt row, decoded without special tokens and stripped."""
        inputs = self.batch_inputs(rows)
        dtype = next(self.model.parameters()).dtype
        inputs = {
            key: value.to(self.device, dtype if key.startswith("pixel_values") else None)
            for key, value in inputs.items()
        }
        s = self.settings
        sampling = {"do_sample": False}
        if s.do_sample:
            sampling = {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
            torch.manual_seed(s.seed)
        was_training = self.model.training
        self.model.eval()
        if self.root is not None:
            self.root.unshard()
        try:
            with self.autocast() if self.autocast is not None else contextlib.nullcontext():
                output = self.model.generate(
                    **inputs,
                    **sampling,
                    max_new_tokens=self.new_token_budget(rows),
                    min_new_tokens=min(s.min_new_tokens, self.new_token_budget(rows)),
                    repetition_penalty=s.repetition_penalty,
                    eos_token_id=self.stop_ids,
                    pad_token_id=self.pad_id,
                    use_cache=True,
                    synced_gpus=self.synced,
                )
        finally:
            if self.root is not None:
                self.root.reshard()
            self.model.train(was_training)
        new_tokens = output[:, inputs["input_ids"].shape[1] :].cpu()
        return [text.strip() for text in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def generate(self, prompts: Sequence[EvalPrompt]) -> list[str]:
        """Answers to prompts that were not skipped (`prompt.row` set), in order."""
        rows = [prompt.row for prompt in prompts]
        if any(row is None for row in rows):
            raise ValueError("generate() takes built prompts only; skipped records have no row")
        return self.generate_rows(rows) if rows else []
