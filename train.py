"""Train a Qwen-VL model on packed sequences.

    python train.py --config recipes/smoke.yaml [dotted.key=value ...] [--resume]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train.py --config recipes/qwen2_5_vl-3b.yaml

`--resume` finishes whatever the run had not: steps, the export, summary.json. It refuses settings that differ from
the run's config.yaml where that breaks exactness (lifecycle/resume.py; `--allow-config-change` uses them anyway),
passes over a checkpoint whose files no longer match its record to the newest one that does, and refuses one saved
by another number of processes (lifecycle/trusted_resume.py; `--allow-world-size-change` continues it).
One run holds a run directory at a time (lifecycle/run_lock.py). SIGTERM or SIGINT stops the run after the current
step with a checkpoint and exit status 75 (lifecycle/preemption.py); docs/cluster.md shows a requeue script.

Recipe → typed config → model (+ fused rope, packed forward, freezing, checkpointing) → data → optimizer
(trainer/setup.py) → loop (trainer/loop.py; metrics in trainer/metrics.py) → export and summary. The run
directory (`train.output_dir`, lifecycle/run_files.py) receives config.yaml, metrics.jsonl, summary.json,
checkpoints/, final/ and wandb/.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# Only what reads the command line and the recipe is imported here; torch, transformers and accelerate come once the
# config is valid (in main), so --help and a recipe mistake answer in about a second, and the scoring libraries
# only in a run that generates.
from core.config import load_config
from core.config_tree import ConfigError
from data.formats import DataError
from lifecycle import preemption, resume, run_files, run_lock, stack_dump

if TYPE_CHECKING:
    from lifecycle import checkpoint
    from trainer import metrics

log = logging.getLogger("train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/smoke.yaml")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint, if any")
    parser.add_argument(
        resume.ALLOW_FLAG,
        action="store_true",
        help="with --resume: use settings that differ from the run's config.yaml even where that breaks exactness",
    )
    parser.add_argument(
        resume.ALLOW_WORLD_SIZE_FLAG,
        action="store_true",
        help="with --resume: continue a checkpoint saved by another number of processes (not bit-exact)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=50")
    return parser.parse_args(argv)


def prepare_run_dir(cfg) -> Path:
    """The run directory, created; a ConfigError naming train.output_dir when it cannot be."""
    run_dir = Path(cfg.train.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"train.output_dir={run_dir} cannot be created: {error.strerror or error}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"train.output_dir={run_dir} is not writable.")
    return run_dir


def restore(setup, checkpointer: checkpoint.Checkpointer, directory: Path) -> tuple[int, metrics.TimedTotals]:
    """Load the checkpoint into the prepared objects; (its step, the run's timed totals so far). The optimizer keeps
    the config's hyperparameters, not the checkpoint's (they differ only with --allow-config-change)."""
    from trainer import metrics, optim

    configured = optim.config_hyperparameters(setup.optimizer)
    step, state = checkpointer.load(directory)
    optim.reapply_hyperparameters(setup.optimizer, setup.scheduler, configured)
    setup.train_loader.load_state_dict(state["data"])
    log.info("resumed from %s at step %d", directory, step)
    return step, metrics.TimedTotals(**state.get("timing", {}))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides + (["checkpoint.resume=latest"] if args.resume else []))
    from core import distributed
    from trainer import defaults, memory_check, tracking
    from trainer.setup import build_accelerator

    with preemption.SignalWatch(cfg.checkpoint.preempt_timeout_s) as signals:
        accelerator = build_accelerator(cfg, log_with=tracking.log_with(cfg))
        level = logging.INFO if accelerator.is_main_process else logging.WARNING
        logging.basicConfig(level=level, format="%(message)s")
        memory_check.check(cfg, accelerator)  # before anything is built: a run that cannot fit stops in one line
        cfg = defaults.resolve(cfg, accelerator)  # before config.yaml is written: the run directory records what ran
        host = distributed.HostCollectives(accelerator)
        run_dir = prepare_run_dir(cfg)
        with run_lock.hold(run_dir, accelerator.is_main_process, host) as lock:
            if lock is not None:  # the main process: it alone writes the run directory's own files
                run_files.clear_preempted(run_dir)
                signals.on_forced_exit(lambda reason: forced_exit(lock, run_dir, signals.signal_name, reason))
            try:
                return train_run(args, cfg, accelerator, host, run_dir, signals)
            except preemption.Preempted as stop:
                # every rank stops together; on several machines the signal may have reached only some of them
                stop.signal_name = next((name for name in host.gather(signals.signal_name) if name), None)
                if accelerator.is_main_process:
                    record_stop(run_dir, stop.signal_name, stop.step, "stopped after a complete step")
                distributed.finish(accelerator)
                raise


def forced_exit(lock: run_lock.RunLock, run_dir: Path, signal_name: str | None, reason: str) -> None:
    """Before the watcher ends the process (lifecycle/preemption.py): preempted.json and the lock's release, while the
    directory is still this run's."""
    if lock.held:
        record_stop(run_dir, signal_name, None, reason)
    lock.release()


def record_stop(run_dir: Path, signal_name: str | None, step: int | None, reason: str) -> None:
    """preempted.json: how this launch stopped on a signal, and the checkpoint a relaunch resumes from."""
    from lifecycle import checkpoint

    latest = checkpoint.latest_checkpoint(run_dir)
    record = {"signal": signal_name, "reason": reason, "step": step, "checkpoint": str(latest) if latest else None}
    run_files.write_preempted(run_dir, {**record, "exit_status": preemption.EXIT_STATUS})


def train_run(args, cfg, accelerator, host, run_dir: Path, signals: preemption.SignalWatch) -> dict:
    """The run in a locked run directory: resume → loop → export → summary; returns the summary."""
    from core import distributed
    from lifecycle import checkpoint, trusted_resume
    from trainer import loop, metrics, tracking
    from trainer.setup import build_training

    # before anything is loaded: saved by as many processes (or allowed not to be), its files as recorded
    resume_from = trusted_resume.choose(
        cfg.checkpoint.resume, run_dir, host, accelerator.process_index, args.allow_world_size_change
    )
    changes = resume.check_config(cfg, run_dir, resume_from is not None, args.allow_config_change)
    setup = build_training(cfg, accelerator)
    wandb_dir = tracking.start(accelerator, cfg, run_dir)

    checkpointer = checkpoint.Checkpointer(
        accelerator, run_dir, cfg.checkpoint, host, lambda: checkpoint.state_nbytes(setup.module, setup.optimizer)
    )
    start_step, timed = 0, metrics.TimedTotals()
    if resume_from is not None:
        start_step, timed = restore(setup, checkpointer, resume_from)
    if accelerator.is_main_process:
        resume.record_config(cfg, run_dir, start_step if resume_from is not None else None, changes)

    export_dir = run_dir / "final"
    needs_export = cfg.checkpoint.export and not checkpoint.export_complete(export_dir)
    if start_step >= cfg.train.max_steps and run_files.has_summary(run_dir) and not needs_export:
        log.info("%s already reached train.max_steps=%d; raise it to train further", run_dir, cfg.train.max_steps)
        distributed.finish(accelerator)
        return run_files.read_summary(run_dir)
    trains = start_step < cfg.train.max_steps
    if trains:
        # a signal on any rank stops every rank after the same step
        stop = lambda: host.any(signals.requested)
        generation_eval = None
        if cfg.train.generate_every:
            from inference.during_training import GenerationEval

            generation_eval = GenerationEval.build(cfg, accelerator, setup.module, setup.processor, run_dir)
        timed = loop.train(cfg, accelerator, setup, checkpointer, start_step, timed, stop, generation_eval)
    if cfg.checkpoint.export and (trains or needs_export):  # needs_export alone: a kill interrupted the last one
        checkpoint.export(
            accelerator,
            setup.module,
            setup.processor,
            export_dir,
            cfg.model.dtype,
            host,
            cfg.lora,
            cfg.model.name_or_path,
            cfg.data,
        )
    summary = metrics.summarize(
        accelerator, cfg, timed, run_dir, wandb_dir, export_dir if cfg.checkpoint.export else None, setup.fused_rope
    )
    distributed.finish(accelerator)
    return summary


def cli(argv: list[str] | None = None) -> int | str:
    """main() with the user's mistakes as one line for sys.exit (a non-zero status) instead of a traceback: the
    message says how to fix them, and a traceback would only bury it. A stop on SIGTERM/SIGINT prints its line and
    returns preemption.EXIT_STATUS (75), which a requeue script tests."""
    try:
        main(argv)
    except ConfigError as error:
        return f"config error: {error}"
    except DataError as error:
        return f"data error: {error}"
    except preemption.Preempted as stop:
        print(f"preempted: {stop}", file=sys.stderr)
        return preemption.EXIT_STATUS
    except Exception as error:
        if not isinstance(error, one_line_errors()):
            raise
        return f"error: {error}" if str(error) else 1  # empty: a memory refusal off the main process, said there
    return 0


def one_line_errors() -> tuple[type[Exception], ...]:
    """The errors whose message alone says what to do. Their modules are imported when an exception reaches cli, not
    before: --help and a ConfigError or DataError end without them, and any later error comes after main imported
    them."""
    from core.distributed import LaunchError
    from lifecycle.checkpoint import WriteError
    from lifecycle.run_lock import RunLockError
    from lifecycle.trusted_resume import CheckpointError
    from trainer.loop import NonFiniteError
    from trainer.memory_check import MemoryFitError

    return NonFiniteError, LaunchError, RunLockError, WriteError, CheckpointError, MemoryFitError


if __name__ == "__main__":
    stack_dump.install()  # `kill -USR1 <pid>`: every thread's Python stack on stderr, for the whole run
    sys.exit(cli())
