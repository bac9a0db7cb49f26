"""fp32 master weights held by the optimizer while the module computes on `model.dtype` matmul weights
(`train.master_weights: optimizer`), for one process.

In the default mode ("module") the module's parameters are fp32 and autocast casts every matmul weight to the compute
dtype at every use (again in each gradient-checkpoint recompute). In "optimizer" mode those weights are cast once to
`model.dtype` (bf16) and the optimizer steps fp32 master copies of the trainable ones. Which (`computes_in_matmul`):
the weight and bias of every nn.Linear, nn.Conv2d and nn.Conv3d, and any other parameter of two or more dimensions
outside an nn.Embedding or nn.Conv1d (MoE routers, expert stacks such as `gate_up_proj` (E, 2I, H)).
Everything else stays fp32 in the module, as in module mode, and the optimizer steps it directly (it is its own
master: no copy, no hook): the embeddings and the output embedding (lm_head, tied to embed_tokens or not), the ViT's
patch embedding, norm
weights and biases, 1-D parameters outside Linear/Conv (Gated DeltaNet's A_log, dt_bias) and nn.Conv1d parameters
(Gated DeltaNet's depthwise conv, which fla's kernel reads as it is, not through autocast). Buffers (rotary
frequencies) are not touched. So the residual stream and the norms stay fp32 and, on a dense model, the forward and
backward compute what module mode computes, bit for bit (tests/test_master_weights.py): the bf16 weights are the
masters rounded as autocast's cast rounds them. The one intended difference is MoE experts: transformers' default
grouped_mm experts call F.grouped_mm, which autocast does not cast, on the fp32 expert stacks in module mode (fp32
expert matmuls); here they multiply in bf16, as under FSDP2.

    backward    each bf16 gradient, once accumulated into its parameter, is added into the master's fp32 .grad and
                freed: micro-batches accumulate in fp32 and no bf16 gradient of the cast weights exists at once; the
                fp32 parameters accumulate their own fp32 .grad, as in module mode
    step        clipping and AdamW act on `optimizer_params`, the masters and the fp32 parameters (fp32 gradients,
                fp32 states); then one foreach copy rounds the masters into the bf16 parameters
    checkpoint  the masters are a checkpointed object of accelerate's save_state (custom_checkpoint_0.pkl: fp32, by
                parameter name) beside the model weights (the cast ones in bf16, the others fp32); load_state
                restores them and the bf16 copy

This is what FSDP2's MixedPrecisionPolicy (param_dtype bf16, reduce_dtype fp32) does across GPUs, so under FSDP2 the
key changes nothing. Under DDP it is refused: DDP would all-reduce the bf16 gradients in bf16.

Bytes of state per trainable cast parameter: 2 (bf16 weight) + 4 (master) + 4 (master gradient) + 8 (AdamW moments) =
18, against 16 in "module" mode plus the 2 of autocast's bf16 copy of each weight, held from its first use in the
forward to the end of the backward. Per trainable fp32 parameter: 4 + 4 (gradient) + 8 (AdamW moments) = 16, as in
module mode (the lm_head's bf16 copy is made by the loss, trainer/loss.py, and dropped at the end of its forward, as
in module mode). Per frozen parameter: 2 instead of 4 (+2) when cast, else 4.
"""

from __future__ import annotations

import functools
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from core.config import Config
from core.config_tree import ConfigError

log = logging.getLogger(__name__)
STATE_NAME = "custom_checkpoint_0.pkl"  # accelerate's file for the first object registered for checkpointing


def auto_mode(model_dtype: str, fsdp: bool, num_processes: int, on_cuda: bool) -> tuple[str, str]:
    """train.master_weights=auto for a launch of `num_processes` processes (under FSDP2 or not) on CUDA or not, and
    why (trainer/defaults.py resolves it at launch; trainer/memory_estimate.py before any process starts)."""
    if fsdp:
        return "module", "FSDP2 computes in bf16 on fp32 masters itself"
    if num_processes > 1:
        return "module", "DDP would reduce bf16 gradients in bf16"
    if not on_cuda:
        return "module", "no CUDA"
    if model_dtype != "bfloat16":
        return "module", f"model.dtype={model_dtype}"
    return "optimizer", "one CUDA process, bfloat16"


def enabled(cfg: Config, accelerator: Accelerator) -> bool:
    """Whether this run keeps its masters in the optimizer: `train.master_weights == "optimizer"` on one process
    with a 16-bit `model.dtype`. A no-op, said in the log, for float32 (the weights are the masters) and under
    FSDP2 (it already does this); a ConfigError under DDP (multi-process without FSDP). `auto` must be resolved
    first (trainer/defaults.py)."""
    if cfg.train.master_weights == "auto":
        raise ValueError("train.master_weights=auto is unresolved: trainer.defaults.resolve(cfg, accelerator) first.")
    if cfg.train.master_weights == "module":
        return False
    if cfg.model.dtype == "float32":
        log.info("train.master_weights=optimizer: no effect with model.dtype=float32 (the weights are the masters)")
        return False
    if accelerator.distributed_type == DistributedType.FSDP:
        log.info(
            "train.master_weights=optimizer: no effect under FSDP2, which already computes on %s parameters and "
            "keeps fp32 masters (recipes/accelerate/fsdp2.yaml, core/distributed.py)",
            cfg.model.dtype,
        )
        return False
    if accelerator.num_processes > 1:
        raise ConfigError(
            f"train.master_weights=optimizer is not supported with {accelerator.num_processes} DDP processes: DDP "
            f"would all-reduce the {cfg.model.dtype} gradients in {cfg.model.dtype}. Use train.master_weights=module, "
            "or launch with recipes/accelerate/fsdp2.yaml: FSDP2 already computes on bf16 weights with fp32 masters "
            "and an fp32 gradient reduce."
        )
    return True


_MATMUL_MODULES = (nn.Linear, nn.Conv2d, nn.Conv3d)  # weight and bias: autocast casts both at every call
_KEPT_MODULES = (nn.Embedding, nn.Conv1d)  # looked up / read by fla's conv kernel as they are, not cast by autocast


def computes_in_matmul(owner: nn.Module, param: nn.Parameter, kept_ids: set[int]) -> bool:
    """Whether `param` (held by `owner`) is cast to the compute dtype in the module: a tensor that module mode's
    autocast casts to bf16 at its every use anyway — a Linear/Conv2d/Conv3d weight or bias, or any other >= 2-D
    parameter outside an Embedding or a Conv1d (MoE routers; MoE expert stacks too, the one exception: module mode
    multiplies them in fp32, see the module docstring) — but never one of `kept_ids` (from `cast_param_ids`: the
    embeddings, the lm_head, which when tied is the same tensor as embed_tokens, and the ViT's patch embedding).

    Why: what stays fp32 (embeddings, norms, 1-D gates such as A_log and dt_bias, depthwise Conv1d) keeps the
    residual stream and the norms in fp32, so the forward equals module mode's bit for bit; what is cast, autocast
    casts at use in module mode, to the same bf16 values, since `MasterWeights.copy_to_module` rounds like its cast.
    """
    if not param.is_floating_point() or id(param) in kept_ids:
        return False
    if isinstance(owner, _MATMUL_MODULES):
        return True
    return param.ndim >= 2 and not isinstance(owner, _KEPT_MODULES)


def cast_param_ids(model: nn.Module) -> set[int]:
    """The ids of `model`'s parameters that `computes_in_matmul` casts to the compute dtype.

    The input embeddings (every nn.Embedding) and the output embedding (lm_head, an nn.Linear) stay fp32, by tensor
    identity (tied or not). The lm_head is never called as a Linear: trainer/loss.py's linear_cross_entropy casts it
    to the matmul dtype itself, as autocast would, and returns its gradient, accumulated in fp32 over the chunks, in
    the weight's dtype; a bf16 lm_head would get that gradient rounded to bf16 (and scaled by 1/label count in bf16)
    before it reached its master, while an fp32 one gets module mode's gradient exactly. The ViT's patch embedding
    (`model.model.visual.patch_embed`) stays fp32 too: called once for a pack's images and once for its videos, its
    gradients then add in fp32 as in module mode (modeling/patch_embed.py), where a bf16 weight would add them in bf16.
    """
    kept_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output_embeddings is not None:
        kept_ids.add(id(output_embeddings.weight))
    patch_embed = getattr(getattr(getattr(model, "model", None), "visual", None), "patch_embed", None)
    if patch_embed is not None:
        kept_ids |= {id(param) for param in patch_embed.parameters()}
    return {
        id(param)
        for owner in model.modules()
        for param in owner.parameters(recurse=False)
        if computes_in_matmul(owner, param, kept_ids)
    }


def _accumulate_into(master: nn.Parameter, param: nn.Parameter) -> None:
    """Post-accumulate-grad hook of `param`: move its gradient into `master.grad`, adding in fp32."""
    if master.grad is None:
        master.grad = param.grad.to(master.dtype)
    else:
        master.grad.add_(param.grad)
    param.grad = None


class MasterWeights:
    """fp32 masters of a model's trainable matmul weights (`computes_in_matmul`), which are cast to `dtype` in the
    model; its other parameters stay fp32 and are their own masters.

    `params[i]` is the model's cast parameter (dtype `dtype`) whose master is `masters[i]` (fp32 on `device`, named
    `names[i]` as in `model.named_parameters()`). `optimizer_params` is everything the optimizer steps, in the model's
    parameter order: each trainable parameter's master, or the parameter itself where it stays fp32. Build it after
    the model is patched and frozen, before the optimizer: `param_groups` maps optim.param_groups onto them, `follow`
    makes every optimizer step end with the copy back. `state_dict` / `load_state_dict` (the masters only: the fp32
    parameters are in the model's own weights) make it an accelerate checkpointed object.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device):
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        self.optimizer_params: list[nn.Parameter] = []
        cast_ids = cast_param_ids(model)
        cast = kept = 0
        with torch.no_grad():
            for name, param in model.named_parameters():  # a tied parameter appears once
                if id(param) not in cast_ids:
                    kept += param.is_floating_point()
                    if param.requires_grad:
                        self.optimizer_params.append(param)
                    continue
                if param.requires_grad:
                    master = nn.Parameter(param.detach().to(device, torch.float32, copy=True))
                    param.register_post_accumulate_grad_hook(functools.partial(_accumulate_into, master))
                    self.names.append(name)
                    self.params.append(param)
                    self.masters.append(master)
                    self.optimizer_params.append(master)
                param.data = param.data.to(dtype)
                cast += 1
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        log.info(
            "master weights: %d matmul weight tensors cast to %s in the module (%d trainable, with fp32 masters in the "
            "optimizer); %d tensors kept fp32 (embeddings, lm_head, norms, gates, conv1d: their own masters)",
            cast,
            dtype,
            len(self.masters),
            kept,
        )

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """`groups` (optim.param_groups of the model) with every cast parameter replaced by its master; a parameter
        kept fp32 stays itself."""
        return [{**group, "params": [self._master_of.get(id(p), p) for p in group["params"]]} for group in groups]

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the masters into the module after every `optimizer.step()`."""
        optimizer.register_step_post_hook(lambda *_: self.copy_to_module())

    @torch.no_grad()
    def copy_to_module(self) -> None:
        """Round every master into its `dtype` parameter (one foreach pass)."""
        torch._foreach_copy_(self.params, self.masters)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: master.detach() for name, master in zip(self.names, self.masters, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the masters (and the module's copy) saved by `state_dict`; the names must match exactly."""
        if state.keys() != set(self.names):
            missing, extra = sorted(set(self.names) - set(state)), sorted(set(state) - set(self.names))
            raise ValueError(
                f"the checkpoint's master weights do not match this model's trainable matmul weights "
                f"(missing: {missing[:5]}, unexpected: {extra[:5]}): resume with the run's model and model.freeze_*."
            )
        torch._foreach_copy_(self.masters, [state[name] for name in self.names])
        self.copy_to_module()
