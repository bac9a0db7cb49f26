"""Answer held-out questions with a trained run and score the answers.

    python -m scripts.generate --run runs/smoke --data builtin                      # the held-out built-in set
    python -m scripts.generate --run runs/X --data /data/eval.jsonl --out preds.jsonl [--checkpoint latest]
    accelerate launch --num_processes 4 -m scripts.generate --run runs/X --data eval.jsonl   # records by rank

`--checkpoint`: final (the export, default), latest (the newest checkpoint), init (the untrained model) or a
directory (an export, a peft adapter, a training checkpoint). Records in any layout training reads; the prompt is
the conversation up to the last assistant turn, the reference is that turn (or the record's `answers`). Images are
resized with the run's data.min/max_pixels and videos sampled with its data.video_* settings unless overridden (an
override that differs from training is logged). Writes one line per record (answer, references, scores; or the skip
reason of a record whose image is missing or corrupt) and `<out stem>.summary.json` (means overall and per
`category`); `--compare-init` also answers with the untrained model and puts its scores beside. Ctrl-C / SIGTERM
stop after the current batch with the lines so far kept (exit status 75); `--resume` continues the file.
docs/inference.md has the details.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from core.config_tree import ConfigError
from data.formats import DataError
from inference import evaluate, scoring
from inference.generation import GenerationSettings, Generator
from inference.loading import PIXEL_KEYS, load_run
from inference.predictions import PredictionsFileError
from lifecycle.preemption import EXIT_STATUS

log = logging.getLogger("generate")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """The flags generate and chat share: which weights, sampling, pixel and frame settings, dtype."""
    parser.add_argument("--run", required=True, help="the run directory (train.output_dir), e.g. runs/smoke")
    parser.add_argument("--checkpoint", default="final", help="final (default), latest, init, or a directory")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds sampling")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: model.dtype on CUDA, else fp32")
    for key in PIXEL_KEYS:
        kind = float if key == "video_fps" else int
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind, help=f"override the run's data.{key}")


def generation_settings(args: argparse.Namespace) -> GenerationSettings:
    return GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


def pixel_overrides(args: argparse.Namespace) -> dict:
    return {key: getattr(args, key) for key in PIXEL_KEYS}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generation_args(parser)
    parser.add_argument("--data", default="builtin", help="a data file or directory training could read, or builtin")
    parser.add_argument("--out", type=Path, help="predictions file (default <run>/predictions/<checkpoint>.jsonl)")
    parser.add_argument("--image-root", help="where relative image paths resolve (default: the data file's directory)")
    parser.add_argument("--format", choices=("auto", "llava", "messages"), help="record layout (default: the run's)")
    parser.add_argument("--num-samples", type=int, default=200, help="size of the held-out built-in set")
    parser.add_argument("--limit", type=int, help="only the first N records")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call, per process")
    parser.add_argument("--resume", action="store_true", help="continue a partial predictions file")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing predictions file")
    parser.add_argument("--compare-init", action="store_true", help="also score the untrained model, beside")
    return parser.parse_args(argv)


def default_out(run: Path, checkpoint: str) -> Path:
    return run / "predictions" / f"{Path(checkpoint).name}.jsonl"


def run_predictions(args: argparse.Namespace, checkpoint: str, out: Path) -> evaluate.PredictionRun:
    state = PartialState()
    loaded = load_run(args.run, checkpoint, state.device, DTYPES[args.dtype], pixel_overrides(args))
    model_config = loaded.model.config
    records, image_root, data = evaluate.open_eval_records(
        loaded.data, args.data, args.num_samples, args.image_root, args.format
    )
    builder = evaluate.prompt_builder_for(loaded.processor, model_config, data, image_root)
    collator = evaluate.collator_for(loaded.processor, model_config)
    generator = Generator(
        loaded.model,
        loaded.processor.tokenizer,
        collator,
        generation_settings(args),
        max_positions=evaluate.context_length(model_config),
    )
    result = evaluate.predict(
        generator, builder, records, out, args.batch_size, args.resume, args.overwrite, limit=args.limit
    )
    if state.is_main_process:
        log.info("%s: %d lines written (%d in the file) with %s", out, result.written, result.total, loaded.source)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state = PartialState()
    logging.basicConfig(level=logging.INFO if state.is_main_process else logging.WARNING, format="%(message)s")
    run = Path(args.run)
    out = args.out or default_out(run, args.checkpoint)
    passes = {"model": (args.checkpoint, out)}
    if args.compare_init:
        passes["init"] = ("init", out.with_name(out.stem + ".init.jsonl"))
    for checkpoint, path in passes.values():
        result = run_predictions(args, checkpoint, path)
        if result.stopped_by:
            print(
                f"stopped by {result.stopped_by}: {result.total} predictions in {path}; the same command with "
                "--resume continues it",
                file=sys.stderr,
            )
            return EXIT_STATUS
    if state.is_main_process:
        extra = {"run": str(run), "checkpoint": args.checkpoint, "data": args.data, **vars_for_summary(args)}
        others = {"init": passes["init"][1]} if args.compare_init else {}
        summary = evaluate.write_summary(out, extra, others)
        print(scoring.format_table(summary, {k: summary[k] for k in others}))
        print(f"predictions: {out}\nsummary: {out.with_name(out.stem + '.summary.json')}")
    return 0


def vars_for_summary(args: argparse.Namespace) -> dict:
    """The settings that made the predictions, for the summary JSON."""
    return {
        "generation": generation_settings(args).as_dict(),
        "pixel_overrides": {k: v for k, v in pixel_overrides(args).items() if v is not None},
    }


def cli(argv: list[str] | None = None) -> int | str:
    """main() with the user's mistakes as one line (a non-zero exit) instead of a traceback."""
    try:
        return main(argv)
    except (ConfigError, PredictionsFileError) as error:
        return f"error: {error}"
    except DataError as error:
        return f"data error: {error}"


if __name__ == "__main__":
    sys.exit(cli())
