"""Train a Qwen-VL model on packed sequences.

    python train.py --config recipes/smoke.yaml [dotted.key=value ...] [--resume]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train.py --config recipes/qwen2_5_vl-3b.yaml

Recipe → typed config → model (+ fused rope, packed forward, freezing, checkpointing) → data → optimizer →
loop (training/loop.py) → export and summary. The run directory (`train.output_dir`) receives config.yaml,
metrics.jsonl, summary.json, checkpoints/, final/ and wandb/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import set_seed

from data.pipeline import build_data, load_processor
from mrope_kernels.patch import apply_rope_choice
from training import checkpoint, distributed, loop, metrics, optim, parts, tracking
from training.config import load_config, save_config
from training.config_tree import ConfigError
from training.modeling import build_model
from training.packed import enable_packed_forward

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
    # gradient_accumulation_steps stays 1: loop.accumulate_gradients normalises by the global label count itself
    # (accelerate would divide once more). The scheduler steps once per optimizer step, not once per process.
    accelerator = Accelerator(
        mixed_precision=loop.mixed_precision(cfg.model.dtype),
        log_with=tracking.log_with(cfg),
        step_scheduler_with_optimizer=False,
        **distributed.accelerator_kwargs(cfg.model.dtype),
    )
    distributed.check_world_size(accelerator.num_processes)
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING, format="%(message)s")
    set_seed(cfg.train.seed)
    run_dir = Path(cfg.train.output_dir)
    if accelerator.is_main_process:
        save_config(cfg, run_dir / "config.yaml")

    # Model: fp32 master weights (autocast computes in model.dtype), fused rope, packed attention, parts.
    model = build_model(dataclasses.replace(cfg.model, dtype="float32"), seed=cfg.train.seed)
    rope = apply_rope_choice(model, cfg.kernels.mrope)
    enable_packed_forward(model)
    parts.freeze(
        model, {"vision": cfg.model.freeze_vision, "merger": cfg.model.freeze_merger, "llm": cfg.model.freeze_llm}
    )
    parts.enable_gradient_checkpointing(
        model, llm=cfg.model.gradient_checkpointing_llm, vision=cfg.model.gradient_checkpointing_vision
    )
    log.info(
        "rope: %s; trainable parameters per part: %s", "fused" if rope else "unfused", parts.trainable_counts(model)
    )

    processor = load_processor(cfg)
    train_loader, eval_loader, _ = build_data(
        cfg, processor, model.config, accelerator.process_index, accelerator.num_processes
    )

    flop_profile = metrics.FlopProfile.from_model(model)
    module = loop.TrainModule(model)
    optimizer = optim.build_optimizer(model, cfg.train, accelerator.device.type)
    scheduler = optim.build_scheduler(optimizer, cfg.train)
    module, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    wandb_dir = tracking.start(accelerator, cfg, run_dir)

    checkpointer = checkpoint.Checkpointer(accelerator, run_dir, cfg.checkpoint)
    start_step = 0
    resume_from = checkpoint.resolve_resume(cfg.checkpoint.resume, run_dir)
    if resume_from is not None:
        start_step, data_state = checkpointer.load(resume_from)
        train_loader.load_state_dict(data_state)
        log.info("resumed from %s at step %d", resume_from, start_step)
    if start_step >= cfg.train.max_steps:  # a finished run: keep its summary and export as they are
        log.info("%s already reached train.max_steps=%d; raise it to train further", run_dir, cfg.train.max_steps)
        accelerator.end_training()
        summary_file = run_dir / "summary.json"
        return json.loads(summary_file.read_text()) if summary_file.is_file() else {"steps": start_step}

    result = loop.train(
        cfg,
        accelerator,
        module,
        optimizer,
        scheduler,
        train_loader,
        eval_loader,
        flop_profile,
        checkpointer,
        run_dir,
        start_step,
    )
    export_dir = None
    if cfg.checkpoint.export:
        export_dir = checkpoint.export(accelerator, module, processor, run_dir / "final", cfg.model.dtype)
    summary = loop.summarize(accelerator, result, run_dir, wandb_dir, export_dir, rope is not None)
    accelerator.wait_for_everyone()  # ranks tear the process group down together (gloo hangs otherwise)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:  # a recipe/override mistake: the message says how to fix it, no traceback needed
        sys.exit(f"config error: {error}")
