"""fp32 master weights held by the optimizer while the module computes on `model.dtype` weights
(`train.master_weights: optimizer`), for one process.

In the default mode ("module") the module's parameters are fp32 and autocast casts every weight to the compute
dtype at every use (again in each gradient-checkpoint recompute). In "optimizer" mode the parameters are cast once
to `model.dtype` (bf16; buffers such as rotary frequencies stay fp32) and the optimizer steps fp32 master copies of
the trainable ones:

    backward    each bf16 gradient, once accumulated into its parameter, is added into the master's fp32 .grad and
                freed: micro-batches accumulate in fp32 and no bf16 gradient of the whole model exists at once
    step        clipping and AdamW act on the masters (fp32 gradients, fp32 states); then one foreach copy rounds
                the masters into the bf16 parameters
    checkpoint  the masters are a checkpointed object of accelerate's save_state (custom_checkpoint_0.pkl: fp32, by
                parameter name) beside the bf16 model weights; load_state restores them and the bf16 copy

This is what FSDP2's MixedPrecisionPolicy (param_dtype bf16, reduce_dtype fp32) does across GPUs, so under FSDP2 the
key changes nothing. Under DDP it is refused: DDP would all-reduce the bf16 gradients in bf16.

Bytes of state per trainable parameter: 2 (bf16 weight) + 4 (master) + 4 (master gradient) + 8 (AdamW moments) =
18, against 16 in "module" mode plus the 2 of autocast's bf16 copy of each weight, held from its first use in the
forward to the end of the backward. Per frozen parameter: 2 instead of 4 (+2).
"""

from __future__ import annotations

import functools
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from core.config_tree import ConfigError
from training.config import Config

log = logging.getLogger(__name__)
STATE_NAME = "custom_checkpoint_0.pkl"  # accelerate's file for the first object registered for checkpointing


def enabled(cfg: Config, accelerator: Accelerator) -> bool:
    """Whether this run keeps its masters in the optimizer: `train.master_weights == "optimizer"` on one process
    with a 16-bit `model.dtype`. A no-op, said in the log, for float32 (the weights are the masters) and under
    FSDP2 (it already does this); a ConfigError under DDP (multi-process without FSDP)."""
    if cfg.train.master_weights == "module":
        return False
    if cfg.model.dtype == "float32":
        log.info("train.master_weights=optimizer: no effect with model.dtype=float32 (the weights are the masters)")
        return False
    if accelerator.distributed_type == DistributedType.FSDP:
        log.info(
            "train.master_weights=optimizer: no effect under FSDP2, which already computes on %s parameters and "
            "keeps fp32 masters (recipes/accelerate/fsdp2.yaml, training/distributed.py)",
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


def _accumulate_into(master: nn.Parameter, param: nn.Parameter) -> None:
    """Post-accumulate-grad hook of `param`: move its gradient into `master.grad`, adding in fp32."""
    if master.grad is None:
        master.grad = param.grad.to(master.dtype)
    else:
        master.grad.add_(param.grad)
    param.grad = None


class MasterWeights:
    """fp32 masters of a model's trainable parameters; the model itself is cast to `dtype`.

    `params[i]` is the model's parameter (dtype `dtype`) whose master is `masters[i]` (fp32 on `device`, named
    `names[i]` as in `model.named_parameters()`). Build it after the model is patched and frozen, before the
    optimizer: `param_groups` maps optim.param_groups onto the masters, `follow` makes every optimizer step end
    with the copy back. `state_dict` / `load_state_dict` make it an accelerate checkpointed object.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device):
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        with torch.no_grad():
            for name, param in model.named_parameters():  # a tied parameter appears once
                if param.requires_grad:
                    master = nn.Parameter(param.detach().to(device, torch.float32, copy=True))
                    param.register_post_accumulate_grad_hook(functools.partial(_accumulate_into, master))
                    self.names.append(name)
                    self.params.append(param)
                    self.masters.append(master)
                if param.is_floating_point():
                    param.data = param.data.to(dtype)
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        log.info(
            "master weights: %d trainable tensors in fp32 in the optimizer, the module in %s", len(self.names), dtype
        )

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """`groups` (optim.param_groups of the model) with every parameter replaced by its master."""
        return [{**group, "params": [self._master_of[id(p)] for p in group["params"]]} for group in groups]

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
                f"the checkpoint's master weights do not match this model's trainable parameters "
                f"(missing: {missing[:5]}, unexpected: {extra[:5]}): resume with the run's model and model.freeze_*."
            )
        torch._foreach_copy_(self.masters, [state[name] for name in self.names])
        self.copy_to_module()
