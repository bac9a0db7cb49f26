"""The recipe schema: one typed tree with sections model, data, packing, kernels, train, checkpoint, logging.

`load_config(path, overrides)` is the single entry point; train.py and every script use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from data.config import DataConfig, PackingConfig
from training import config_tree
from training.config_tree import ConfigError


@dataclass
class ModelConfig:
    name_or_path: str | None = None  # checkpoint dir or hub id; None = random init from `config`
    config: dict | None = None  # a Hugging Face config (model_type, text_config, vision_config, ...) for random init
    processor: str | None = None  # processor dir; default: name_or_path, or the built-in tiny processor
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    gradient_checkpointing_llm: bool = False
    gradient_checkpointing_vision: bool = False
    freeze_vision: bool = False
    freeze_merger: bool = False
    freeze_llm: bool = False

    def validate(self) -> None:
        if (self.name_or_path is None) == (self.config is None):
            raise ConfigError(
                "set exactly one of model.name_or_path (a checkpoint) or model.config (random init from a config)."
            )
        if self.freeze_vision and self.freeze_merger and self.freeze_llm:
            raise ConfigError("model.freeze_vision, freeze_merger and freeze_llm are all true: nothing would train.")


@dataclass
class KernelsConfig:
    mrope: Literal["fused", "unfused", "auto"] = "auto"  # auto: fused when supported, else unfused with a warning


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"
    max_steps: int = 100
    seed: int = 0
    lr: float = 1e-4
    lr_vision: float | None = None  # None: same as lr
    lr_merger: float | None = None
    weight_decay: float = 0.0
    adam_betas: tuple[float, ...] = (0.9, 0.95)
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    max_grad_norm: float = 1.0
    grad_accum_steps: int = 1
    eval_every: int = 0  # 0 = no periodic eval
    eval_batches: int = 4

    def validate(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1, got {self.max_steps}.")
        if self.grad_accum_steps < 1:
            raise ConfigError(f"train.grad_accum_steps must be >= 1, got {self.grad_accum_steps}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}.")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"train.adam_betas needs two values, got {list(self.adam_betas)}.")


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0 = only at the end
    keep_last: int = 2
    export: bool = True  # save_pretrained + processor at the end


@dataclass
class LoggingConfig:
    report_to: Literal["wandb", "none"] = "wandb"  # wandb goes offline automatically without a login
    project: str = "qwen-vl-packed"
    run_name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    every_steps: int = 10


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def load_config(path: str | None, overrides: list[str] | None = None) -> Config:
    """Load a recipe and dotted overrides (`train.max_steps=10`) into the typed tree; raises ConfigError."""
    return config_tree.load(Config, path, overrides)


def save_config(config: Config, path: str) -> None:
    config_tree.save(config, path)
