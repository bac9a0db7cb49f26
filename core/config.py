"""The recipe schema: one typed tree with sections model, data, packing, kernels, parallel, train, checkpoint,
logging, and lora (absent for a full fine-tune).

`load_config(path, overrides)` is the single entry point; train.py and every script use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core import config_tree
from core.config_tree import ConfigError, check_seed
from core.data_config import DataConfig, PackingConfig, held_out_shares
from core.families import recipe_model_config


@dataclass
class ModelConfig:
    name_or_path: str | None = None  # checkpoint dir or hub id to load; None = random init from `config`
    # the model's Hugging Face config: a mapping (model_type, text_config, vision_config, ...), a JSON file of one
    # (recipes/models/*.json: the published sizes), or a mapping with `base: <file>` merged over that file's;
    # random init when name_or_path is unset, else checked against the checkpoint's (core/families.py)
    config: dict | str | None = None
    processor: str | None = None  # processor dir; default: name_or_path, or the built-in tiny processor
    # the matmuls' compute dtype (autocast) and the export's weight dtype; the master weights stay fp32
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    # recompute the decoder layers' activations in backward (less memory, one more forward of each such layer): true
    # = every layer, false = none, N = the first N layers, auto = the fewest that fit the GPU by the memory estimate
    # (trainer/activation_checkpointing.py; the log and the run's config.yaml say what it chose)
    gradient_checkpointing_llm: bool | Literal["auto"] | int = False
    gradient_checkpointing_vision: bool | Literal["auto"] | int = False  # the same for the ViT blocks
    freeze_vision: bool = False  # train no vision-tower parameter (patch embedding, blocks)
    freeze_merger: bool = False  # train no patch-merger parameter (deepstack mergers included)
    freeze_llm: bool = False  # train no language-model parameter (embeddings, decoder layers, lm_head)

    def validate(self) -> None:
        if self.name_or_path is None and self.config is None:
            raise ConfigError(
                "set model.config (a random init, e.g. model.config=recipes/models/qwen2_5_vl-3b.json) or "
                "model.name_or_path (a checkpoint directory or hub id)."
            )
        if self.config is not None:
            recipe_model_config(self.config)  # a missing or malformed file fails here, naming model.config
        if self.freeze_vision and self.freeze_merger and self.freeze_llm:
            raise ConfigError("model.freeze_vision, freeze_merger and freeze_llm are all true: nothing would train.")
        for part in ("llm", "vision"):
            value = getattr(self, f"gradient_checkpointing_{part}")
            if not isinstance(value, bool) and value != "auto" and value < 0:
                raise ConfigError(
                    f"model.gradient_checkpointing_{part} must be true, false, auto or a number of "
                    f"{'decoder layers' if part == 'llm' else 'ViT blocks'} >= 0 (the first N recompute), got {value}."
                )


LoraTrainable = Literal["vision", "merger", "embed_tokens", "lm_head"]


@dataclass
class LoraConfig:
    rank: int = 8  # r: the adapters' inner dimension
    alpha: float | None = None  # scaling = alpha / rank (alpha / sqrt(rank) with use_rslora); null = 2 * rank
    dropout: float = 0.0  # dropout on each adapter's input; > 0 makes packed and per-sample runs draw different masks
    # the language model's linear layers to adapt: "all-linear" (every nn.Linear of the decoder, not lm_head), or
    # names that end module paths there (e.g. [q_proj, v_proj])
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    vision: bool = False  # also adapt every linear layer of the ViT blocks (the same target names apply)
    merger: bool = False  # also adapt the merger's linear layers (deepstack mergers included)
    trainable: list[LoraTrainable] = field(default_factory=list)  # parts trained fully beside the adapters
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(rank) (peft's use_rslora)
    merge_on_export: bool = True  # final/ holds the merged model beside final/adapter/; false: the adapter only

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {self.rank}.")
        if self.alpha is not None and self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be > 0 (or null for 2 * rank), got {self.alpha}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}.")
        if isinstance(self.target_modules, list) and (not self.target_modules or not all(self.target_modules)):
            raise ConfigError("lora.target_modules must be all-linear or a non-empty list of module names.")
        for part in ("vision", "merger"):
            if getattr(self, part) and part in self.trainable:
                raise ConfigError(
                    f"lora.{part}=true adapts the {part} while lora.trainable lists it to train fully: choose one "
                    f"(lora.{part}=false, or remove {part} from lora.trainable)."
                )
        if len(set(self.trainable)) != len(self.trainable):
            raise ConfigError(f"lora.trainable lists a part twice: {self.trainable}.")

    @property
    def scaling_alpha(self) -> float:
        return 2.0 * self.rank if self.alpha is None else self.alpha


@dataclass
class KernelsConfig:
    mrope: Literal["fused", "unfused", "auto"] = "auto"  # auto: fused when supported, else unfused with a warning
    # Qwen3.5 Gated DeltaNet on packs: auto = fla's varlen kernels where they run exactly, else the boundary-exact
    # torch path; the run logs which and why (modeling/gated_delta.py)
    gated_delta: Literal["auto", "torch", "fla"] = "auto"
    # ViT patch embedding: "matmul" = transformers' Conv3d as the one matmul it is, faster on GPUs, weight gradients
    # accumulated in fp32 (modeling/patch_embed.py); "conv" = transformers' Conv3d
    patch_embed: Literal["conv", "matmul"] = "matmul"
    # packed attention's varlen kernels on a GPU: auto = fa4 (FlashAttention-4, flash-attn-4) where installed and the
    # GPU is Hopper or Blackwell, else fa2; fa4 runs only head dims it computes exactly, fa2 the others
    # (modeling/attention_engines.py); the log says which part runs on which
    attention: Literal["auto", "fa2", "fa4"] = "auto"


@dataclass
class ParallelConfig:
    # ranks each pack is split over (docs/context-parallel.md); 1 = off. Data-parallel size = processes / context
    context: int = 1

    def validate(self) -> None:
        if self.context < 1:
            raise ConfigError(f"parallel.context must be >= 1 (1 = off), got {self.context}.")


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"  # the run directory: config, metrics, checkpoints, export (lifecycle/run_files.py)
    max_steps: int = 100  # optimizer steps to train; the cosine schedule ends here
    seed: int = 0  # seeds the random init and the process RNGs (the data order has data.seed)
    lr: float = 1e-4  # peak learning rate of the LLM, and of the other parts unless lr_vision / lr_merger are set
    lr_vision: float | None = None  # peak learning rate of the vision tower; None: same as lr
    lr_merger: float | None = None  # peak learning rate of the merger(s); None: same as lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay on matrices (norms and biases get none)
    adam_betas: tuple[float, ...] = (0.9, 0.95)  # AdamW's (beta1, beta2)
    warmup_steps: int = 10  # linear learning-rate warmup before the cosine decay
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 = no clipping (the norm is still logged)
    grad_accum_steps: int = 1  # micro-batches (packs) per optimizer step on each rank
    eval_every: int = 0  # evaluate the held-out split every N steps and at the end; 0 = no periodic eval
    eval_batches: int = 4  # held-out batches per rank in each evaluation (the same batches every time)
    # answer the first generate_samples held-out records every N steps and at the end, scored into metrics.jsonl and
    # a wandb Table (inference/during_training.py); 0 = off, and then nothing of it is built
    generate_every: int = 0
    generate_samples: int = 16
    generate_max_new_tokens: int = 32  # tokens per answer at most (greedy)
    # where the fp32 master weights live: "module" = an fp32 module that autocast casts at every use; "optimizer" =
    # matmul weights in model.dtype, fp32 copies in AdamW (one process; modeling/master_weights.py); "auto" =
    # optimizer for one CUDA process in bfloat16, else module (trainer/defaults.py)
    master_weights: Literal["auto", "module", "optimizer"] = "auto"
    # regional torch.compile of every decoder layer and ViT block (modeling/compile.py; the first step compiles);
    # "auto" = on with CUDA, off on the CPU (trainer/defaults.py)
    compile: bool | Literal["auto"] = "auto"
    # float8 matmuls in the decoder layers' linears (torchao, modeling/fp8.py; needs compile and a GPU of compute
    # capability >= 8.9): true / false; "auto" = false, as measured slower than bf16 (trainer/defaults.py)
    fp8: bool | Literal["auto"] = "auto"
    # before the model is built, compare the memory estimate (trainer/memory_estimate.py) with the device's: true =
    # stop in one line, with the overrides that fit, when it cannot fit; "warn" = log that line and go on; false = skip
    memory_check: bool | Literal["warn"] = True

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}.")
        check_seed("train.seed", self.seed)
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}.")
        if any(not 0.0 <= beta < 1.0 for beta in self.adam_betas):
            raise ConfigError(f"train.adam_betas must each be in [0, 1), got {list(self.adam_betas)}.")
        for name in ("lr_vision", "lr_merger"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"train.{name} must be >= 0 (or null for train.lr), got {value}.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if self.max_grad_norm < 0:
            raise ConfigError(f"train.max_grad_norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}.")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ConfigError("train.eval_every must be >= 0 (0 = off) and train.eval_batches >= 1.")
        if self.generate_every < 0 or self.generate_samples < 1 or self.generate_max_new_tokens < 1:
            raise ConfigError(
                "train.generate_every must be >= 0 (0 = off), train.generate_samples and "
                "train.generate_max_new_tokens >= 1."
            )
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
    every_steps: int = 0  # save a resumable checkpoint every N steps; 0 = only at the end
    keep_last: int = 2  # complete checkpoints kept on disk; older ones are deleted
    export: bool = True  # save_pretrained + processor at the end
    save_final: bool = True  # a resumable checkpoint after the last step (bench-* recipes turn it off: no disk traffic)
    resume: str | None = None  # "latest" (this run's newest checkpoint, if any), a checkpoint dir, or null
    preempt_timeout_s: float = 30.0  # on SIGTERM/SIGINT: seconds to end the step, save and exit 75 (docs/cluster.md)
    checksums: bool = True  # record each file's xxh3-128 in the COMPLETE marker, checked on resume (sizes always are)

    def validate(self) -> None:
        if self.every_steps < 0:
            raise ConfigError(f"checkpoint.every_steps must be >= 0 (0 = only at the end), got {self.every_steps}.")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}.")
        if not self.preempt_timeout_s > 0:
            raise ConfigError(
                f"checkpoint.preempt_timeout_s must be > 0 (seconds from a stop signal to the exit), got "
                f"{self.preempt_timeout_s}."
            )


@dataclass
class LoggingConfig:
    report_to: Literal["wandb", "none"] = "wandb"  # wandb goes offline automatically without a login
    project: str = "qwen-vl-packed"  # wandb project
    run_name: str | None = None  # wandb run name; None: the run directory's name
    group: str | None = None  # wandb group
    tags: list[str] = field(default_factory=list)  # wandb tags
    every_steps: int = 10  # steps per log interval: one device sync and one record of rates per interval
    timing_warmup_steps: int = 5  # steps excluded from the summary's throughput and MFU (allocator, autotuning)
    peak_tflops: float | None = None  # the device's dense bf16 peak for MFU; null = look it up (trainer/metrics.py)
    progress_bar: bool = True  # a tqdm bar on the main process

    def validate(self) -> None:
        if self.every_steps < 1:
            raise ConfigError(f"logging.every_steps must be >= 1, got {self.every_steps}.")
        if self.timing_warmup_steps < 0:
            raise ConfigError(f"logging.timing_warmup_steps must be >= 0, got {self.timing_warmup_steps}.")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"logging.peak_tflops must be > 0 or null, got {self.peak_tflops}.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoraConfig | None = None  # LoRA adapters on a frozen base (docs/lora.md); null = full fine-tune

    def validate(self) -> None:
        """Checks across sections (each section checks its own fields)."""
        self._validate_held_out()
        if self.train.master_weights == "optimizer" and self.model.dtype == "float16":
            raise ConfigError(
                "train.master_weights=optimizer supports model.dtype=bfloat16 only: float16 weights would need their "
                "gradients loss-scaled. Use model.dtype=bfloat16 or train.master_weights=module."
            )
        if self.parallel.context > 1 and self.packing.mode != "packed":
            raise ConfigError(
                f"parallel.context={self.parallel.context} splits packs across ranks: it needs packing.mode=packed "
                "(or parallel.context=1)."
            )
        if self.lora is not None:
            self._validate_lora(self.lora)
        for part in ("vision", "merger"):
            if getattr(self.model, f"freeze_{part}") and getattr(self.train, f"lr_{part}") is not None:
                raise ConfigError(
                    f"train.lr_{part} is set but model.freeze_{part} is true: unset one of them "
                    f"(train.lr_{part}=null or model.freeze_{part}=false)."
                )

    def _validate_held_out(self) -> None:
        """Evaluation and generation during training read held-out records: some source must hold some out."""
        shares = held_out_shares(self.data)
        if any(share > 0 for share in shares.values()):
            return
        for key, needs in (("eval_every", "needs a held-out split"), ("generate_every", "answers held-out records")):
            if not getattr(self.train, key):
                continue
            if not self.data.sources:
                raise ConfigError(f"train.{key} > 0 {needs}: set data.eval_fraction > 0 (e.g. 0.02) or train.{key}=0.")
            zeros = ", ".join(f"{where}=0" for where in shares)
            raise ConfigError(
                f"train.{key} > 0 {needs}, but no source of data.sources holds any out ({zeros}): set one of them "
                f"> 0 (e.g. 0.02), or train.{key}=0."
            )

    def _validate_lora(self, lora: LoraConfig) -> None:
        parts = ("vision", "merger", "llm")
        frozen = [f"model.freeze_{part}" for part in parts if getattr(self.model, f"freeze_{part}")]
        if frozen:
            raise ConfigError(
                f"{', '.join(frozen)} and lora are both set: with lora the whole base model is frozen and only the "
                "adapters and lora.trainable train. Unset model.freeze_*; choose what trains with lora.vision, "
                "lora.merger and lora.trainable."
            )
        for part in ("vision", "merger"):
            if getattr(self.train, f"lr_{part}") is not None and not (getattr(lora, part) or part in lora.trainable):
                raise ConfigError(
                    f"train.lr_{part} is set but nothing of the {part} trains under lora: set lora.{part}=true (adapt "
                    f"it), add {part} to lora.trainable (train it fully), or set train.lr_{part}=null."
                )


def load_config(path: str | None, overrides: list[str] | None = None) -> Config:
    """Load a recipe and dotted overrides (`train.max_steps=10`) into the typed tree; raises ConfigError."""
    return config_tree.load(Config, path, overrides)


def save_config(config: Config, path: str) -> None:
    config_tree.save(config, path)
