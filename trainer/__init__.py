"""The trainer: what turns a config into optimizer steps, on top of the model room (modeling/) and the run's
lifecycle (lifecycle/).

`setup` builds everything a run needs before its first step (`build_training`), with the `auto` settings resolved by
`defaults`; `step` is one optimizer step (the model with its fused lm_head + cross-entropy from `loss`, accumulation,
clipping) and evaluation; `loop` feeds prefetched micro-batches to the steps and logs, evaluates and checkpoints;
`optim` builds AdamW with per-part learning rates; `metrics` counts FLOPs and writes the per-step records and the
summary; `tracking` mirrors them to wandb; `memory_estimate` estimates a run's memory per GPU before anything is
allocated and `memory_check` refuses a run that cannot fit.
"""
