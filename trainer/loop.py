"""The training loop: optimizer steps `start_step + 1 … train.max_steps` (trainer/step.py), with metrics
(trainer/metrics.py's MetricsLogger), evaluation and checkpoints on the way; a non-finite loss stops the run
before anything is saved; a stop request (lifecycle/preemption.py) ends it after the current step with a checkpoint.

    train.py / scripts/profile_step.py ─► Steps (prefetched batches → step.optimizer_step) ─► MetricsLogger
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.profiler import record_function

from core.config import Config, TrainConfig
from data.prefetch import Prefetcher
from lifecycle.checkpoint import Checkpointer, latest_checkpoint
from lifecycle.preemption import Preempted
from trainer import metrics
from trainer.setup import TrainingSetup
from trainer.step import PHASE, evaluate, optimizer_step


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm stopped being finite: the weights are no longer worth saving."""


@dataclass
class StepResult:
    """One optimizer step: its host batches, the LLM learning rate it used, and its detached device scalars."""

    host_batches: list[dict]
    lr: float
    loss_sum: torch.Tensor  # summed CE over this rank's micro-batches
    label_count: torch.Tensor  # this rank's label tokens
    grad_norm: torch.Tensor  # before clipping


class Steps:
    """Optimizer steps, one per `run()`: `train.grad_accum_steps` prefetched micro-batches through `optimizer_step`.
    What `train` and scripts/profile_step.py run; `state_dict()` is the loader position after the last step."""

    def __init__(self, accelerator: Accelerator, setup: TrainingSetup, train_cfg: TrainConfig):
        self.accelerator, self.setup, self.train_cfg = accelerator, setup, train_cfg
        self.batches = Prefetcher(setup.train_loader, pin=accelerator.device.type == "cuda")
        setup.module.train()

    def run(self) -> StepResult:
        with record_function(PHASE + "data_wait"):
            host_batches = [next(self.batches) for _ in range(self.train_cfg.grad_accum_steps)]
        setup = self.setup
        lr = _llm_lr(setup.optimizer)  # what this step really uses (the scheduler sets the next step's after it)
        loss_sum, label_count, grad_norm = optimizer_step(
            self.accelerator,
            setup.module,
            setup.optimizer,
            setup.scheduler,
            setup.grad_params,
            host_batches,
            self.train_cfg.max_grad_norm,
        )
        return StepResult(host_batches, lr, loss_sum, label_count, grad_norm)

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def close(self) -> None:
        self.batches.close()


def train(
    cfg: Config,
    accelerator: Accelerator,
    setup: TrainingSetup,
    checkpointer: Checkpointer,
    start_step: int = 0,
    timed_before: metrics.TimedTotals | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
    generation_eval: Callable[[int], dict] | None = None,
) -> metrics.TimedTotals:
    """Run optimizer steps `start_step + 1 … train.max_steps`; log, evaluate and checkpoint on the way.
    Returns this rank's timed totals of the whole run: `timed_before` (restored from the checkpoint) plus this
    launch's.

    `stop_requested()` is asked before the first step and after every step but the last, on every rank at the same
    point (it may be a collective: every rank must get the same answer). When it is true, the step ends as any
    other (logged, evaluated if due), a checkpoint of it is saved, and Preempted is raised.

    `generation_eval(step)` (train.generate_every; inference/during_training.py) returns a metrics record of answers
    to held-out questions; it runs every `train.generate_every` steps and after the last, on every rank."""
    if stop_requested():
        raise Preempted(start_step, None)
    tcfg, run_dir, eval_loader = cfg.train, checkpointer.run_dir, setup.eval_loader
    eval_start = eval_loader.state_dict() if eval_loader is not None else None
    logger = metrics.MetricsLogger(
        accelerator, cfg, setup.flop_profile, run_dir, start_step, timed_before or metrics.TimedTotals()
    )
    steps = Steps(accelerator, setup, tcfg)
    first_nonfinite_step = torch.zeros((), dtype=torch.long, device=accelerator.device)  # 0 = none yet; no sync
    last_saved: Path | None = None
    try:
        for step in range(start_step + 1, tcfg.max_steps + 1):
            started = time.perf_counter()
            result = steps.run()
            if tcfg.compile and step == start_step + 1:
                logger.emit(_first_compiled_step(step, result, started))
            logger.record_step(
                step, result.lr, result.host_batches, result.loss_sum, result.label_count, result.grad_norm
            )
            nonfinite = ~(torch.isfinite(result.loss_sum) & torch.isfinite(result.grad_norm))
            first_nonfinite_step = torch.where(nonfinite & (first_nonfinite_step == 0), step, first_nonfinite_step)
            stopping = step < tcfg.max_steps and stop_requested()  # the last step ends the run as usual
            do_eval = eval_loader is not None and tcfg.eval_every and step % tcfg.eval_every == 0
            do_generate = generation_eval is not None and step % tcfg.generate_every == 0
            periodic_save = cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0
            do_save = stopping or (periodic_save and step < tcfg.max_steps)
            # An evaluation or a checkpoint also ends the log interval: metrics.jsonl (and wandb, which drops a
            # step older than one it has seen) stays in step order, and a resume from the checkpoint finds every
            # earlier step.
            if logger.due(step) or do_eval or do_save or do_generate:
                _stop_if_nonfinite(accelerator, first_nonfinite_step, run_dir)
                logger.log()
            if do_eval or do_save or do_generate:
                with logger.paused():
                    if do_eval:
                        eval_loss = evaluate(accelerator, setup.module, eval_loader, tcfg.eval_batches, eval_start)
                        logger.emit({"step": step, "eval_loss": eval_loss})
                    if do_generate:
                        logger.emit(generation_eval(step))
                    if do_save:  # the check above ran for this step: no NaN weights are saved
                        last_saved = checkpointer.save(step, steps.state_dict(), dataclasses.asdict(logger.timed()))
            if stopping:
                logger.close()
                raise Preempted(step, last_saved)
        timed = logger.close()  # before the prefetcher's shutdown (it may wait on a worker): not training time
    finally:
        # On an error too: the loader's workers ignore SIGTERM (data/pipeline.py), so while the prefetcher still
        # iterates the loader, the interpreter's exit waits on them forever.
        steps.close()
    if eval_loader is not None and tcfg.eval_every and tcfg.max_steps % tcfg.eval_every:
        eval_loss = evaluate(accelerator, setup.module, eval_loader, tcfg.eval_batches, eval_start)
        logger.emit({"step": tcfg.max_steps, "eval_loss": eval_loss})
    if generation_eval is not None and tcfg.max_steps % tcfg.generate_every:
        logger.emit(generation_eval(tcfg.max_steps))
    if cfg.checkpoint.save_final:
        checkpointer.save(tcfg.max_steps, steps.state_dict(), dataclasses.asdict(timed))
    return timed


def _first_compiled_step(step: int, result: StepResult, started: float) -> dict:
    """The launch's first step with compiled blocks: its wall time (one sync, once) and the part of it dynamo and
    inductor spent compiling (`compile_s`), for metrics.jsonl and the log. Later packs reuse the graphs."""
    from torch._dynamo.utils import calculate_time_spent

    result.loss_sum.item()
    compile_s = calculate_time_spent().get("total_wall_time", 0.0)
    return {"step": step, "first_step_s": time.perf_counter() - started, "compile_s": compile_s}


def _llm_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the LLM's parameter group (of the first group when the LLM is frozen)."""
    groups = optimizer.param_groups
    return next((g["lr"] for g in groups if g.get("name") == "llm"), groups[0]["lr"])


def _stop_if_nonfinite(accelerator: Accelerator, first_nonfinite_step: torch.Tensor, run_dir: Path) -> None:
    """Raise NonFiniteError when any rank saw a non-finite loss or gradient norm (one sync; called at log intervals
    and before every save, so no checkpoint or export ever holds NaN weights)."""
    worst = accelerator.reduce(first_nonfinite_step.clone(), reduction="sum").item()  # > 0 iff some rank saw one
    if worst == 0:
        return
    step = int(first_nonfinite_step.item()) or "?"
    last = latest_checkpoint(run_dir)
    raise NonFiniteError(
        f"the loss or gradient norm became non-finite at step {step}; training stopped without saving. "
        f"{'The last good checkpoint is ' + str(last) if last else 'No checkpoint was saved'}: lower train.lr or "
        "set train.max_grad_norm > 0, and check the data."
    )
