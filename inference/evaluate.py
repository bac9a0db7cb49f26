"""Generation over a data set into a predictions file, on one process or several (accelerate), and its summary.

    records ─► PromptBuilder (inference/prompts.py) ─► Generator (inference/generation.py) ─► scores
    (inference/scoring.py) ─► predictions file (inference/predictions.py) ─► summary JSON

Several processes (`accelerate launch -m scripts.generate ...`): the records still to predict are dealt in rounds of
`batch_size` per process, record j of a round to process j mod N; after each round the main process gathers the
rounds' lines and appends them in record order, so the file is the one a single process writes. Every process then
knows whether any was asked to stop (SIGTERM, SIGINT) or met a record it cannot score, and all stop together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

from core.data_config import DataConfig
from data.collate import Collator
from data.pipeline import cache_root
from data.processing import SampleProcessor
from data.sources import open_records
from data.video import VideoSettings
from inference import predictions, scoring
from inference.generation import Generator
from inference.prompts import EvalDataError, EvalPrompt, PromptBuilder

log = logging.getLogger(__name__)
BUILTIN = "builtin"
BUILTIN_EVAL_SEED_OFFSET = 1_000_003  # the held-out built-in set's seed is the run's data.seed plus this


def context_length(model_config) -> int | None:
    """The model's position budget (the text model's max_position_embeddings), or None when it has none."""
    text = getattr(model_config, "text_config", model_config)
    return getattr(text, "max_position_embeddings", None)


def builtin_eval_settings(data: DataConfig, num_samples: int) -> DataConfig:
    """The held-out built-in set: the run's built-in data settings (video share, question kinds) with a seed no run
    trains on by default, so its images are new to the model."""
    return dataclasses.replace(data, path=BUILTIN, num_samples=num_samples, seed=data.seed + BUILTIN_EVAL_SEED_OFFSET)


def open_eval_records(data: DataConfig, path: str, num_samples: int, image_root: str | None, data_format: str | None):
    """(records, image_root, the data settings used) of `--data`: a file or directory training could read, or
    `builtin` (the held-out built-in set of `num_samples` records)."""
    if path == BUILTIN:
        settings = builtin_eval_settings(data, num_samples)
    else:
        settings = dataclasses.replace(data, path=path, image_root=image_root, format=data_format or data.format)
    settings.streaming = False  # a run that streamed its data still reads eval records by index
    records, root = open_records(settings, cache_root(settings))
    return records, root, settings


def collator_for(processor, model_config) -> Collator:
    """The training collator's image and video processing: each prompt row carries the run's pixel and frame
    settings (`prompt_builder_for`), as a training row does."""
    return Collator(
        processor.image_processor,
        image_token_id=model_config.image_token_id,
        video_token_id=model_config.video_token_id,
        pad_token_id=processor.tokenizer.pad_token_id,
    )


def prompt_builder_for(processor, model_config, data: DataConfig, image_root: str | None) -> PromptBuilder:
    """Prompts as training builds samples: the run's processor, pixel bounds, video settings and visual-token
    budget."""
    sample_processor = SampleProcessor(
        processor,
        model_config,
        data_format="messages",
        image_root=image_root,
        min_pixels=data.min_pixels,
        max_pixels=data.max_pixels,
        video=VideoSettings.from_config(data, processor.image_processor),
        max_visual_tokens=data.max_visual_tokens,
    )
    return PromptBuilder(sample_processor, data.format, context_length(model_config))


def prediction_line(prompt: EvalPrompt, answer: str | None) -> dict:
    """The predictions file's line for a prompt and its answer (a skip line when the record was skipped)."""
    line = {"index": prompt.index, "id": prompt.sample_id, "category": prompt.category}
    if prompt.row is None:
        return {**line, "skipped": prompt.skip_reason, "detail": f"{prompt.location}: {prompt.skip_detail}"}
    scores = scoring.score(answer, prompt.references)
    return {
        **line,
        "prompt": prompt.prompt_text,
        "reference": prompt.references[0],
        "references": prompt.references,
        "prediction": answer,
        "scores": scores,
    }


def predict_batch(generator: Generator, builder: PromptBuilder, records, indices: list[int]) -> list[dict]:
    """Lines for the records at `indices`: prompts built, the kept ones answered in one batch, every one scored."""
    prompts = [builder.build(records[index], index) for index in indices]
    kept = [prompt for prompt in prompts if prompt.row is not None]
    answers = iter(generator.generate(kept))
    return [prediction_line(prompt, next(answers) if prompt.row is not None else None) for prompt in prompts]


@dataclass
class PredictionRun:
    """How a predictions run ended: lines written by this launch, lines in the file, the signal that stopped it."""

    written: int
    total: int
    stopped_by: str | None
    out: Path


def predict(
    generator: Generator,
    builder: PromptBuilder,
    records,
    out: Path,
    batch_size: int = 8,
    resume: bool = False,
    overwrite: bool = False,
    limit: int | None = None,
) -> PredictionRun:
    """Write the predictions of `records` (the first `limit`) to `out` (module docstring): on every process of the
    current accelerate state, records dealt by rank, the file in record order. Raises EvalDataError on every process
    when one meets a record it cannot score; returns early with `stopped_by` set on SIGTERM / SIGINT."""
    state = PartialState()
    count = min(len(records), limit) if limit is not None else len(records)
    done = [predictions.open_for_writing(out, resume, overwrite) if state.is_main_process else None]
    if state.num_processes > 1:
        broadcast_object_list(done)
    pending = [index for index in range(count) if index not in done[0]]
    if resume and done[0]:
        log.info("resuming %s: %d of %d records already predicted", out, count - len(pending), count)
    per_round = batch_size * state.num_processes
    written = 0
    with predictions.StopSignals() as signals:
        for start in range(0, len(pending), per_round):
            mine = pending[start + state.process_index : start + per_round : state.num_processes]
            lines, error = [], None
            try:
                lines = predict_batch(generator, builder, records, mine) if mine else []
            except EvalDataError as failure:
                error = str(failure)
            payload = [(lines, signals.requested, error)]
            gathered = gather_object(payload) if state.num_processes > 1 else payload
            errors = [e for _, _, e in gathered if e]
            if errors:
                raise EvalDataError(errors[0])
            round_lines = sorted((line for part, _, _ in gathered for line in part), key=lambda line: line["index"])
            if state.is_main_process:
                predictions.append(out, round_lines)
            written += len(round_lines)
            stopped_by = next((flag for _, flag, _ in gathered if flag), None)
            if stopped_by:
                return PredictionRun(written, count - len(pending) + written, stopped_by, out)
    return PredictionRun(written, count, None, out)


def write_summary(out: Path, extra: dict | None = None, others: dict[str, Path] | None = None) -> dict:
    """Summarise a predictions file into its summary JSON (predictions.summary_path) with `extra` fields and the
    summaries of `others` ({label: predictions file}, e.g. the untrained model's) beside; returns the summary."""
    summary = {**scoring.summarize(predictions.read_predictions(out)), **(extra or {})}
    for label, path in (others or {}).items():
        summary[label] = scoring.summarize(predictions.read_predictions(path))
    predictions.summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
