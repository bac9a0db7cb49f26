"""`train.generate_every`: answers to a fixed held-out set while the model trains, scored, in metrics.jsonl and wandb.

The set is the first `train.generate_samples` records of the run's held-out split (the records train.py never trains
on, data.eval_fraction; a mixture's sources in turn, each by its own eval share), their prompts built once, as
training builds its samples. Every `generate_every` steps
(and after the last) `GenerationEval(step)` answers them greedily with the training model itself, scores them
(inference/scoring.py) and returns a metrics record ({"step", "gen_exact_match", "gen_anls", ..., and
"gen_exact_match/<category>" per category}); on the main process it also writes the answers to
`<run>/generations/step_<N>.jsonl` and, when wandb tracks the run, logs a Table of image, question, reference and
answer, so a person can read what the model says as it trains.

Distributed: every rank answers the same prompts in the same batches, with transformers' `synced_gpus` keeping them
in step until the longest answer ends, so each forward is a forward of every rank: FSDP2's all-gathers pair up (the
root's own parameters gathered around each generate call, inference/generation.py), and DDP's replicas never
diverge. With train.generate_every = 0 (the default) nothing of this is built.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from accelerate import Accelerator

from core.data_config import source_data_config
from data.pipeline import source_records
from data.row_meta import eval_period
from inference import evaluate, scoring
from inference.generation import GenerationSettings, Generator
from inference.prompts import EvalPrompt

log = logging.getLogger(__name__)
BATCH_SIZE = 8  # prompts per generate call
TABLE_KEY = "generations"


def _source_prompts(data, max_samples: int | None, processor, model_config) -> Iterator[EvalPrompt]:
    """Prompts of one source's held-out records that are not skipped, in record order (none when the source holds
    none out: a mixture's source with eval_fraction 0)."""
    period = eval_period(data.eval_fraction)
    if not period:
        return
    records, image_root = source_records(data, max_samples)
    builder = evaluate.prompt_builder_for(processor, model_config, data, image_root)
    if data.streaming:  # an IterableDataset has no length: its held-out records are every period-th it yields
        held_out = ((index, record) for index, record in enumerate(records) if index % period == 0)
    else:
        held_out = ((index, records[index]) for index in range(0, len(records), period))
    for index, record in held_out:
        prompt = builder.build(record, index)
        if prompt.row is not None:
            yield prompt


def held_out_prompts(cfg, processor, model_config, count: int) -> list[EvalPrompt]:
    """Prompts of the first `count` held-out records that are not skipped (their records in order; a mixture's
    sources taken in turn, one prompt each)."""
    if cfg.data.sources:
        sources = [(source_data_config(cfg.data, s), s.max_samples) for s in cfg.data.sources]
    else:
        sources = [(cfg.data, None)]
    streams = [_source_prompts(data, cap, processor, model_config) for data, cap in sources]
    prompts = []
    while streams and len(prompts) < count:
        for stream in list(streams):
            prompt = next(stream, None)
            if prompt is None:
                streams.remove(stream)
            elif len(prompts) < count:
                prompts.append(prompt)
    return prompts


class GenerationEval:
    """The held-out generation evaluation of a training run (module docstring); call it with the step."""

    def __init__(
        self,
        accelerator: Accelerator,
        module,
        hf_model,
        processor,
        prompts: list[EvalPrompt],
        settings,
        run_dir,
        cfg_data,
    ):
        self.accelerator = accelerator
        self.prompts = prompts
        self.run_dir = Path(run_dir)
        self.generator = Generator(
            hf_model,
            processor.tokenizer,
            evaluate.collator_for(processor, hf_model.config),
            settings,
            max_positions=evaluate.context_length(hf_model.config),
            autocast=accelerator.autocast,
            synced=accelerator.num_processes > 1,
            root=module,
        )

    @classmethod
    def build(cls, cfg, accelerator: Accelerator, module, processor, run_dir) -> GenerationEval:
        """For train.py: the HF model inside the prepared training module, the run's processor and held-out data."""
        hf_model = accelerator.unwrap_model(module).model
        prompts = held_out_prompts(cfg, processor, hf_model.config, cfg.train.generate_samples)
        if not prompts:
            log.warning("train.generate_every: the held-out split has no usable record; nothing will be generated")
        settings = GenerationSettings(max_new_tokens=cfg.train.generate_max_new_tokens)
        log.info("train.generate_every=%d: %d held-out prompts", cfg.train.generate_every, len(prompts))
        return cls(accelerator, module, hf_model, processor, prompts, settings, run_dir, cfg.data)

    def __call__(self, step: int) -> dict:
        started = time.perf_counter()
        lines = []
        for start in range(0, len(self.prompts), BATCH_SIZE):
            batch = self.prompts[start : start + BATCH_SIZE]
            answers = self.generator.generate(batch)
            lines += [evaluate.prediction_line(prompt, answer) for prompt, answer in zip(batch, answers, strict=True)]
        summary = scoring.summarize(lines)
        record = {"step": step, **{f"gen_{metric}": value for metric, value in summary["scores"].items()}}
        for category, scores in summary["by_category"].items():
            if category != scoring.UNCATEGORIZED:
                record[f"gen_exact_match/{category}"] = scores["exact_match"]
        record["gen_s"] = time.perf_counter() - started
        if self.accelerator.is_main_process:
            self._write(step, lines)
        return record

    def _write(self, step: int, lines: list[dict]) -> None:
        directory = self.run_dir / "generations"
        directory.mkdir(exist_ok=True)
        (directory / f"step_{step:08d}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        trackers = [tracker.name for tracker in self.accelerator.trackers]
        if "wandb" in trackers:
            self.accelerator.log({TABLE_KEY: self._table(step, lines)}, step=step)

    def _table(self, step: int, lines: list[dict]):
        import wandb

        from data.formats import load_image

        table = wandb.Table(columns=["step", "id", "image", "question", "reference", "answer", "exact_match"])
        for prompt, line in zip(self.prompts, lines, strict=True):
            images = prompt.row["images"]
            image = wandb.Image(load_image(images[0])) if images else None
            reference = " | ".join(line["references"])
            table.add_data(
                step, line["id"], image, line["prompt"], reference, line["prediction"], line["scores"]["exact_match"]
            )
        return table
