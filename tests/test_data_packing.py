"""Pack planning (data/packing.py): budget, completeness, rank balance, determinism."""

import random

import pytest

from data.packing import Leftover, PackItem, best_fit_decreasing, deal_steps, pack_cost, pack_stream, whole_groups


def random_items(count: int, seed: int, max_length: int = 900) -> list[PackItem]:
    rng = random.Random(seed)
    items = []
    for key in range(count):
        length = rng.randint(20, max_length)
        items.append(PackItem(key=key, length=length, num_patches=rng.choice([0, 64, 256, 1024])))
    return items


@pytest.mark.parametrize("buffer_size", [1, 7, 64, 10_000])
def test_every_sample_in_exactly_one_pack_within_budget(buffer_size):
    """Each sample lands in exactly one pack, whole, and no pack exceeds the token budget (any buffer size)."""
    items = random_items(500, seed=buffer_size)
    packs = list(pack_stream(iter(items), capacity=1024, buffer_size=buffer_size))
    keys = sorted(item.key for pack in packs for item in pack.items)
    assert keys == list(range(len(items)))
    assert all(pack.tokens == sum(i.length for i in pack.items) <= 1024 for pack in packs)


def test_best_fit_decreasing_is_near_optimal():
    """With a large buffer, BFD wastes less than one pack over the lower bound ceil(Σ len / budget)."""
    items = random_items(2000, seed=1, max_length=300)
    packs = list(pack_stream(iter(items), capacity=8192, buffer_size=512))
    lower_bound = -(-sum(i.length for i in items) // 8192)
    assert len(packs) <= lower_bound + 1


def test_oversized_sample_is_refused():
    """A sample longer than the budget is an error at planning time, never split or truncated."""
    with pytest.raises(ValueError, match="exceeds the pack budget"):
        best_fit_decreasing([PackItem(key=0, length=2000, num_patches=0)], capacity=1024)


def test_plan_is_deterministic():
    """The same items and seed give the same steps, pack for pack."""

    def plan():
        packs = pack_stream(iter(random_items(300, seed=3)), capacity=2048, buffer_size=50)
        return [[[i.key for i in p.items] for p in step] for step in deal_steps(packs, 4, 4, 1.0, seed=7)]

    assert plan() == plan()


def test_ranks_get_balanced_work():
    """Within a step, the most expensive rank's pack (tokens + patches) costs far less over the cheapest than
    when the same packs are dealt in arrival order."""
    items = random_items(3000, seed=5)
    packs = list(pack_stream(iter(items), capacity=4096, buffer_size=256))
    world = 4

    def imbalance(steps):
        return sum(max(pack_cost(p, 1.0) for p in s) - min(pack_cost(p, 1.0) for p in s) for s in steps)

    balanced = list(deal_steps(iter(packs), world, window_steps=8, vision_cost_weight=1.0, seed=0))
    arrival = [packs[i : i + world] for i in range(0, len(packs) - world + 1, world)]
    assert len(balanced) == len(arrival)
    assert imbalance(balanced) < 0.5 * imbalance(arrival)
    dealt = sorted(i.key for s in balanced for p in s for i in p.items)
    assert len(dealt) == len(set(dealt))


@pytest.mark.parametrize(("world", "window"), [(2, 1), (3, 4), (4, 8)])
def test_packs_not_dealt_are_counted_as_leftover(world, window):
    """Every pack is either dealt to exactly one rank of one step or counted in the leftover, which holds fewer
    packs than ranks; the leftover's tokens are those of the packs not dealt."""
    packs = list(pack_stream(iter(random_items(400, seed=world)), capacity=2048, buffer_size=64))
    leftover = Leftover()
    steps = list(deal_steps(iter(packs), world, window, vision_cost_weight=1.0, seed=0, leftover=leftover))
    assert all(len(step) == world for step in steps)
    dealt = [id(pack) for step in steps for pack in step]
    assert len(dealt) == len(set(dealt))
    assert len(dealt) + leftover.packs == len(packs) and leftover.packs < world
    missing = [pack for pack in packs if id(pack) not in set(dealt)]
    assert leftover.tokens == sum(pack.tokens for pack in missing)


@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_whole_groups_drop_and_count_a_final_partial_group(group_size):
    """Steps come out unchanged and in order, in whole groups only; the packs of a final partial group are counted
    in the leftover, none of a whole group is."""
    packs = list(pack_stream(iter(random_items(200, seed=group_size)), capacity=1024, buffer_size=32))
    steps = [packs[i : i + 2] for i in range(0, 14, 2)]  # 7 steps: a partial group for group sizes 2 and 3
    leftover = Leftover()
    grouped = list(whole_groups(iter(steps), group_size, leftover))
    whole = len(steps) - len(steps) % group_size
    assert grouped == steps[:whole]
    assert leftover.packs == 2 * (len(steps) - whole)
    assert leftover.tokens == sum(pack.tokens for step in steps[whole:] for pack in step)
