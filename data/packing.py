"""Which samples go into which pack, and which pack goes to which data-parallel rank at which step.

Pure planning on (length, patches) — no tensors — so an epoch's plan is cheap to recompute, which is how resuming
works: replan the epoch from its seed and skip the steps already taken.

- `pack_stream`: best-fit-decreasing over a buffer of samples, streaming: each buffer's least-full pack is carried
  into the next buffer instead of being emitted half empty; the final buffer flushes everything. Samples are never
  split (a sample longer than the budget is rejected before it gets here).
- `deal_steps`: packs grouped into steps of `world_size` packs (one per rank) with similar cost, cost = LLM tokens
  + vision_cost_weight × ViT patches, so no rank waits on another's bigger pack or bigger images.
- `whole_groups`: those steps in whole groups of `grad_accum_steps` (the micro-steps of one optimizer step), so an
  optimizer step never mixes two epochs.

Packs left at an epoch's end by either (too few to fill one more step) are counted in a `Leftover`, like
DataLoader's drop_last but never silently.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PackItem:
    """One sample as the planner sees it: `key` identifies it (a row index, or the row itself when streaming)."""

    key: object = field(compare=False)
    length: int
    num_patches: int
    has_images: bool = False  # whether the sample holds images / videos: the step's vision calls (STEP_VISION)
    has_videos: bool = False


@dataclass
class Pack:
    items: list[PackItem] = field(default_factory=list)
    tokens: int = 0
    patches: int = 0

    def add(self, item: PackItem) -> None:
        self.items.append(item)
        self.tokens += item.length
        self.patches += item.num_patches


def best_fit_decreasing(items: list[PackItem], capacity: int) -> list[Pack]:
    """Packs of total length <= capacity: longest sample first, into the fullest pack it still fits (O(n log n))."""
    packs: list[Pack] = []
    free_space: list[tuple[int, int]] = []  # sorted (free tokens, pack index)
    for item in sorted(items, key=lambda i: (-i.length, -i.num_patches)):
        if item.length > capacity:
            raise ValueError(f"sample of {item.length} tokens exceeds the pack budget {capacity}; filter it first.")
        slot = bisect.bisect_left(free_space, (item.length, -1))
        if slot < len(free_space):
            free, index = free_space.pop(slot)
        else:
            packs.append(Pack())
            free, index = capacity, len(packs) - 1
        packs[index].add(item)
        bisect.insort(free_space, (free - item.length, index))
    return packs


def pack_stream(items: Iterable[PackItem], capacity: int, buffer_size: int) -> Iterator[Pack]:
    """Packs for a stream of samples, in a deterministic order for a deterministic stream.

    Each sample lands in exactly one pack; every pack holds <= capacity tokens.
    """
    buffer: list[PackItem] = []
    for item in items:
        buffer.append(item)
        if len(buffer) >= buffer_size:
            packs = best_fit_decreasing(buffer, capacity)
            least_full = min(range(len(packs)), key=lambda i: (packs[i].tokens, i))
            buffer = list(packs[least_full].items)
            yield from (pack for i, pack in enumerate(packs) if i != least_full)
    if buffer:
        yield from best_fit_decreasing(buffer, capacity)


@dataclass
class Leftover:
    """Packs an epoch's plan leaves out at its end, and their tokens."""

    packs: int = 0
    tokens: int = 0

    def add(self, packs: Iterable[Pack]) -> None:
        for pack in packs:
            self.packs += 1
            self.tokens += pack.tokens


def pack_cost(pack: Pack, vision_cost_weight: float) -> float:
    return pack.tokens + vision_cost_weight * pack.patches


def deal_steps(
    packs: Iterable[Pack],
    world_size: int,
    window_steps: int,
    vision_cost_weight: float,
    seed: int,
    leftover: Leftover | None = None,
) -> Iterator[list[Pack]]:
    """Steps of `world_size` packs (index = rank) with balanced cost.

    Over a window of world_size × window_steps packs, packs are sorted by cost and cut into consecutive groups of
    world_size, so each step's packs cost about the same; the steps of a window are then shuffled (seeded) so
    training does not see costly packs first. A final incomplete step (fewer packs than ranks: the cheapest packs
    of the last window) is not yielded; its packs are added to `leftover` when the packs are exhausted.
    """
    rng = random.Random(seed)
    window: list[Pack] = []
    window_size = world_size * window_steps

    def flush(chunk: list[Pack]) -> list[list[Pack]]:
        chunk = sorted(chunk, key=lambda p: -pack_cost(p, vision_cost_weight))
        whole = len(chunk) - len(chunk) % world_size
        if leftover is not None:
            leftover.add(chunk[whole:])
        steps = [chunk[i : i + world_size] for i in range(0, whole, world_size)]
        rng.shuffle(steps)
        return steps

    for pack in packs:
        window.append(pack)
        if len(window) == window_size:
            yield from flush(window)
            window = []
    if window:
        yield from flush(window)


def whole_groups(
    steps: Iterable[list[Pack]], group_size: int, leftover: Leftover | None = None
) -> Iterator[list[Pack]]:
    """The steps, yielded only in whole groups of `group_size` consecutive steps; the packs of a final incomplete
    group are added to `leftover` when the steps are exhausted (a group is held back until it is whole)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}.")
    group: list[list[Pack]] = []
    for step in steps:
        group.append(step)
        if len(group) == group_size:
            yield from group
            group = []
    if leftover is not None:
        leftover.add(pack for step in group for pack in step)


@dataclass(frozen=True)
class ConsumedSteps:
    """The first `steps` micro-steps of an epoch's plan on another layout (`world_size` ranks, `grad_accum_steps`
    micro-steps per optimizer step, `window_steps` = packing.balance_window_steps): what a run saved before it was
    resumed on another number of processes."""

    world_size: int
    grad_accum_steps: int
    window_steps: int
    steps: int


def packs_after(packs: Iterable[Pack], consumed: ConsumedSteps, vision_cost_weight: float, seed: int) -> Iterator[Pack]:
    """The packs of one epoch (`packs`, in stream order) that the first `consumed.steps` micro-steps of the epoch's
    plan on the consumed layout (`deal_steps` with `seed`, then `whole_groups`) did not take, in stream order.

    Dealing the rest to another layout continues the epoch with no sample repeated or left out. Holds at most the
    packs of one dealing window beyond those already taken."""
    packs = iter(packs)
    pending: dict[int, Pack] = {}  # drawn from `packs` by the old plan, not taken (yet), in stream order

    def drawn() -> Iterator[Pack]:
        for pack in packs:
            pending[id(pack)] = pack
            yield pack

    dealt = deal_steps(drawn(), consumed.world_size, consumed.window_steps, vision_cost_weight, seed)
    for _, step in zip(range(consumed.steps), whole_groups(dealt, consumed.grad_accum_steps), strict=False):
        for pack in step:
            del pending[id(pack)]
    yield from pending.values()
    yield from packs
