"""Pinned MoE routing: replay the top-k expert choices of a per-sample run in other runs of the same model.

Top-k routing is discontinuous. When a token's k-th and (k+1)-th router probabilities nearly tie, the rounding of
two runs of the same model (packed vs per-sample, bf16 vs fp32) can send it to different experts, and its whole
gradient moves from one expert to another: each run is right, yet a max-|Δ| comparison of the two cannot tell that
from a leak. `PinnedRouting` records every router's choices while each sample runs alone and forces those choices
in the other runs; their routing weights are still computed from their own router logits (so router gradients and
any leak into the hidden states stay visible), and the choices the other run would have made differently are counted.

Routers are transformers' `*TopKRouter` modules (Qwen3-VL-MoE, Qwen3.5-MoE), whose forward maps hidden states
(N, H) to (router_logits (N, E), router_scores (N, k), router_indices long (N, k)). They are found by module name,
so choices recorded on a model replay onto a deep copy of it. A model without routers makes both contexts no-ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ROUTER_CLASS_SUFFIX = "TopKRouter"


def routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's top-k routers by module name (empty for a dense model)."""
    return {
        name: module for name, module in model.named_modules() if type(module).__name__.endswith(ROUTER_CLASS_SUFFIX)
    }


def routing_weights(router_logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Weights of the chosen experts, as transformers' Qwen MoE routers compute them for their own top-k.

    router_logits: (N, E) any float dtype; indices: long (N, k) expert ids. Returns (N, k) in the logits' dtype:
    softmax over all experts in fp32, the chosen experts' probabilities, renormalised to sum to 1 per token.
    Differentiable with respect to the logits.
    """
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    chosen = probabilities.gather(-1, indices)
    return (chosen / chosen.sum(dim=-1, keepdim=True)).to(router_logits.dtype)


def _router_outputs(name: str, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not (isinstance(output, tuple) and len(output) == 3):
        raise ValueError(
            f"router {name} returned {type(output).__name__}, not (router_logits, router_scores, router_indices): "
            "verification/routing_pin.py supports the Qwen MoE routers of the installed transformers only."
        )
    return output


def _flipped_tokens(own: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """long (): tokens whose own top-k set (N, k) differs from the pinned one (N, k); order within a set is ignored."""
    return (own.sort(dim=-1).values != pinned.sort(dim=-1).values).any(dim=-1).sum()


@dataclass
class RoutingFlips:
    """The count of one replayed run, filled when its `replaying` context exits.

    flips: token choices (one per token and router) whose own top-k set differs from the pinned one;
    choices: all token choices of the run (tokens × routers). Recomputed forwards (gradient checkpointing) count once.
    """

    flips: int = 0
    choices: int = 0


class PinnedRouting:
    """Top-k choices of every router per sample: recorded in a per-sample run, forced in other runs.

    The caller sets `sample` to the index of the sample that runs alone before its forward, and keeps it until
    after its backward (gradient checkpointing runs the forward again; the recompute overwrites the same entry).
    `sample = None` means one pack of all recorded samples, concatenated in index order.
    `choices` maps (router name, sample index) to the recorded indices, long (S, k).
    """

    def __init__(self) -> None:
        self.sample: int | None = None
        self.choices: dict[tuple[str, int], torch.Tensor] = {}

    @contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator[None]:
        """Store each router's own choices for `self.sample` and leave its outputs unchanged.

        On exit (without an exception in the block) checks that every router's scores equal
        `routing_weights(router_logits, router_indices)`, since replay uses that formula; raises RuntimeError if
        the installed transformers computes them differently.
        """
        mismatches: dict[tuple[str, int], torch.Tensor] = {}

        def make_hook(name: str):
            def record(module, args, output) -> None:
                logits, scores, indices = _router_outputs(name, output)
                if self.sample is None:
                    raise ValueError("set PinnedRouting.sample to the sample's index before each recorded forward.")
                key = (name, self.sample)
                self.choices[key] = indices.detach()
                with torch.no_grad():
                    mismatches[key] = (scores != routing_weights(logits, indices)).any()

            return record

        with _hooks(model, make_hook):
            yield
        differs = torch.stack(list(mismatches.values())).tolist() if mismatches else []
        differing = sorted({name for (name, _), differ in zip(mismatches, differs, strict=True) if differ})
        if differing:
            raise RuntimeError(
                f"router(s) {', '.join(differing)} compute routing weights differently from "
                "verification.routing_pin.routing_weights (fp32 softmax over all experts, the top-k renormalised, cast "
                "to the logits' dtype); replaying pinned choices would change the model. Update routing_weights to "
                "the installed transformers' router formula."
            )

    @contextmanager
    def replaying(self, model: torch.nn.Module) -> Iterator[RoutingFlips]:
        """Force the recorded choices of `self.sample` (or, when None, of all samples in order) on every router.

        Each router returns (its own router_logits, routing_weights(router_logits, pinned), pinned). Yields a
        RoutingFlips that holds this run's counts once the context exits. Raises ValueError when a router routes a
        different number of tokens than were recorded for it, or nothing was recorded for it.
        """
        count = RoutingFlips()
        # keyed by (router, sample): a recomputed forward overwrites its entry instead of counting twice
        flips: dict[tuple[str, int | None], torch.Tensor] = {}
        choices: dict[tuple[str, int | None], int] = {}

        def make_hook(name: str):
            def replay(module, args, output):
                logits, _, own = _router_outputs(name, output)
                pinned = self._pinned(name, own)
                key = (name, self.sample)
                flips[key], choices[key] = _flipped_tokens(own, pinned), pinned.shape[0]
                return logits, routing_weights(logits, pinned), pinned

            return replay

        with _hooks(model, make_hook):
            yield count
        count.flips = int(torch.stack(list(flips.values())).sum()) if flips else 0
        count.choices = sum(choices.values())

    def _pinned(self, name: str, own: torch.Tensor) -> torch.Tensor:
        """long (N, k) recorded choices of router `name` for the current run, checked against its own (N, k)."""
        samples = [self.sample] if self.sample is not None else sorted(i for n, i in self.choices if n == name)
        missing = [i for i in samples if (name, i) not in self.choices]
        if not samples or missing:
            raise ValueError(
                f"no routing recorded for router {name}, sample(s) {missing or 'any'}: run the per-sample reference "
                "inside PinnedRouting.recording first, with the same model structure."
            )
        pinned = torch.cat([self.choices[name, i] for i in samples]).to(own.device)
        if pinned.shape != own.shape:
            which = f"sample {self.sample}" if self.sample is not None else f"samples {samples} concatenated"
            raise ValueError(
                f"router {name} routes {tuple(own.shape)} (tokens, top-k) but the choices recorded for {which} are "
                f"{tuple(pinned.shape)}: replay onto the same samples, in the same order, with the same top-k."
            )
        return pinned


@contextmanager
def _hooks(model: torch.nn.Module, make_hook) -> Iterator[None]:
    """Register `make_hook(name)` as a forward hook on each router of `model` for the duration of the block."""
    handles = [module.register_forward_hook(make_hook(name)) for name, module in routers(model).items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
