"""Train a Qwen-VL model on packed sequences.

    python train.py --config recipes/smoke.yaml [dotted.key=value ...] [--resume]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train.py --config recipes/qwen2_5_vl-3b.yaml

Recipe → typed config → model (+ fused rope, packed forward, freezing, checkpointing) → data → optimizer
(training/setup.py) → loop (training/loop.py) → export and summary. The run directory (`train.output_dir`)
receives config.yaml, metrics.jsonl, summary.json, checkpoints/, final/ and wandb/.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from training import checkpoint, loop, tracking
from training.config import load_config, save_config
from training.config_tree import ConfigError
from training.setup import build_accelerator, build_training

log = logging.getLogger("train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/smoke.yaml")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint, if any")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=50")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides + (["checkpoint.resume=latest"] if args.resume else []))
    accelerator = build_accelerator(cfg, log_with=tracking.log_with(cfg))
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING, format="%(message)s")
    run_dir = Path(cfg.train.output_dir)
    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")
    setup = build_training(cfg, accelerator)
    wandb_dir = tracking.start(accelerator, cfg, run_dir)

    checkpointer = checkpoint.Checkpointer(accelerator, run_dir, cfg.checkpoint)
    start_step = 0
    resume_from = checkpoint.resolve_resume(cfg.checkpoint.resume, run_dir)
    if resume_from is not None:
        start_step, data_state = checkpointer.load(resume_from)
        setup.train_loader.load_state_dict(data_state)
        log.info("resumed from %s at step %d", resume_from, start_step)
    if start_step >= cfg.train.max_steps:  # a finished run: keep its summary and export as they are
        log.info("%s already reached train.max_steps=%d; raise it to train further", run_dir, cfg.train.max_steps)
        accelerator.end_training()
        summary_file = run_dir / "summary.json"
        return json.loads(summary_file.read_text()) if summary_file.is_file() else {"steps": start_step}

    result = loop.train(
        cfg,
        accelerator,
        setup.module,
        setup.optimizer,
        setup.scheduler,
        setup.train_loader,
        setup.eval_loader,
        setup.flop_profile,
        checkpointer,
        run_dir,
        start_step,
    )
    export_dir = None
    if cfg.checkpoint.export:
        export_dir = checkpoint.export(accelerator, setup.module, setup.processor, run_dir / "final", cfg.model.dtype)
    summary = loop.summarize(accelerator, result, run_dir, wandb_dir, export_dir, setup.fused_rope)
    accelerator.wait_for_everyone()  # ranks tear the process group down together (gloo hangs otherwise)
    accelerator.end_training()
    return summary


def cli(argv: list[str] | None = None) -> int | str:
    """main() with the user's mistakes as one line for sys.exit (a non-zero status) instead of a traceback: the
    message says how to fix them, and a traceback would only bury it."""
    try:
        main(argv)
    except ConfigError as error:
        return f"config error: {error}"
    except loop.NonFiniteError as error:
        return f"error: {error}"
    return 0


if __name__ == "__main__":
    sys.exit(cli())
