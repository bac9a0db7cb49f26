"""Vision plans (modeling/vision_plan.py): the tower's grid metadata computed on the host equals what transformers
derives from the grid, is what the tower uses, changes no loss or gradient, and leaves unplanned calls alone."""

import pickle
import sys

import pytest
import torch
from torch import nn

from core.families import MODEL_TYPES
from modeling import parts, vision_plan
from modeling.packed import enable_packed_forward, packed_model_inputs
from trainer import step
from verification.packing_check import SampleSpec, pack_samples

FAMILIES = MODEL_TYPES  # every family of the registry, so a new one cannot be missed
IMAGE_PACK = (  # images only: the video call is a dummy
    SampleSpec(3, ((2, 4), (4, 2)), text_between=3),
    SampleSpec(5),
    SampleSpec(2, ((4, 8),), text_after=1),  # wider than the tiny Qwen2.5-VL window: several windows
)
VIDEO_PACK = (  # images and videos, odd t
    SampleSpec(0, videos=((3, 4, 4),), text_after=5),
    SampleSpec(4, ((2, 4),), text_between=3, videos=((2, 2, 4), (1, 4, 2)), text_after=2),
)
PACKS = {"images": IMAGE_PACK, "videos": VIDEO_PACK}

# The helpers each visual forward calls, by the name it imported them under, and the plan key each one pops.
HELPER_KEYS = {
    "get_vision_position_ids": "position_ids",
    "get_vision_attention_seqlens": "cu_seqlens",
    "get_vision_window_index": "window_index",
    "get_vision_interpolation_indices_and_weights": "interp_indices",
    "get_max_seqlen": "max_seqlen",  # also read by every vision attention, from its own `max_seqlen` argument
}


def modeling_module(model: nn.Module):
    return sys.modules[type(model.model.visual).__module__]


def packed_model(tiny_model, family: str) -> nn.Module:
    model = tiny_model(family)
    enable_packed_forward(model)
    return model


def grads_of(module: step.TrainModule, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = module(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", FAMILIES)
def test_plan_equals_what_the_tower_derives(tiny_model, tiny_samples, family, device, monkeypatch):
    """For image and video grids, every planned value (dtype and device included) equals the one the tower's own
    forward derives from the grid on `device` when called without a plan: same helpers, same arguments; on CUDA
    computed on the host and copied from pinned memory."""
    model = packed_model(tiny_model, family).to(device)
    visual, module = model.model.visual, modeling_module(model)
    derived: dict[str, list] = {}

    def record(name: str) -> None:
        original = getattr(module, name)

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            derived.setdefault(kwargs.get("kwarg_name", name), []).append(out)
            return out

        monkeypatch.setattr(module, name, recorded)

    for name in HELPER_KEYS:
        if hasattr(module, name):
            record(name)
    batch = pack_samples(model, tiny_samples(model, VIDEO_PACK, device=device))
    for key in vision_plan.GRID_KEYS:
        derived.clear()
        grid, pixels = batch[key], batch["pixel_values" if key == "image_grid_thw" else "pixel_values_videos"]
        with torch.no_grad():
            visual(pixels, grid_thw=grid)
        plan = vision_plan.plan_kwargs(visual, grid.cpu(), device)
        expected = {"position_ids": derived["get_vision_position_ids"][0]}
        expected["cu_seqlens"], expected["max_seqlen"] = derived["get_vision_attention_seqlens"][0]
        if "get_vision_window_index" in derived:
            expected["window_index"], expected["cu_window_seqlens"] = derived["get_vision_window_index"][0]
            expected["max_window_seqlen"] = derived["max_window_seqlen"][0]
        if "get_vision_interpolation_indices_and_weights" in derived:
            expected["interp_indices"], expected["interp_weights"] = derived[
                "get_vision_interpolation_indices_and_weights"
            ][0]
        assert plan.keys() == expected.keys()
        assert ("window_index" in plan) == (family == "qwen2_5_vl")
        assert ("interp_indices" in plan) == family.startswith("qwen3")
        for name, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert plan[name].device.type == device and plan[name].dtype == value.dtype, name
                value = value.to(device)  # Qwen2.5-VL's window_index: transformers builds it on the host
                assert torch.equal(plan[name], value), name
            else:
                assert type(plan[name]) is int and plan[name] == value, name


def test_plan_without_flash_attention_leaves_max_seqlens_to_transformers(tiny_model):
    """A tower not on a flash-style attention gets max_seqlen None from transformers, so the plan gives none."""
    model = tiny_model("qwen2_5_vl")  # sdpa
    plan = vision_plan.plan_kwargs(model.model.visual, torch.tensor([[1, 4, 8]]), "cpu")
    assert "max_seqlen" not in plan and "max_window_seqlen" not in plan and "window_index" in plan


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_planned_forward_backward_equals_unplanned(tiny_model, tiny_samples, family, pack, monkeypatch):
    """TrainModule on a batch carrying host grids (to_device) gives the same loss and gradients, bit for bit
    (fp32), as on the same batch without them; and with them no tower call derives anything from a grid: every
    helper the visual forward calls finds its precomputed value (the dummy calls' included)."""
    model = packed_model(tiny_model, family)
    module = step.TrainModule(model)
    batch = pack_samples(model, tiny_samples(model, PACKS[pack], seed=1))
    assert vision_plan.HOST_GRIDS not in batch
    loss_ref, grads_ref = grads_of(module, batch)

    helpers = modeling_module(model)

    def strict(name: str, key: str) -> None:
        original = getattr(helpers, name)

        def planned_only(*args, kwargs=None, **kw):
            wanted = kw.get("kwarg_name", key)
            if kwargs is None or kwargs.get(wanted) is None:
                raise AssertionError(f"{name} derived {wanted} from the grid: the call had no plan")
            return original(*args, kwargs=kwargs, **kw)

        monkeypatch.setattr(helpers, name, planned_only)

    for name, key in HELPER_KEYS.items():
        if hasattr(helpers, name):
            strict(name, key)
    block_kwargs: list[set] = []
    model.model.visual.blocks[0].register_forward_pre_hook(
        lambda _, args, kw: block_kwargs.append(set(kw)), with_kwargs=True
    )
    planned = step.to_device(batch, torch.device("cpu"))
    assert planned[vision_plan.HOST_GRIDS].keys() == {k for k in vision_plan.GRID_KEYS if batch.get(k) is not None}
    loss, grads = grads_of(module, planned)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        assert torch.equal(grads[name], grad), name
    assert module.vision_plans._plans == {}, "the forward's plans outlived it"
    leaked = {"position_ids", "window_index", "cu_window_seqlens", "max_window_seqlen", "interp_indices"}
    assert block_kwargs and not any(leaked & keys for keys in block_kwargs), "a plan key was not consumed"


def test_planned_equals_unplanned_with_vision_gradient_checkpointing(tiny_model, tiny_samples):
    """Checkpointed vision blocks replay with the planned boundaries: same loss and gradients as unplanned."""
    model = packed_model(tiny_model, "qwen2_5_vl")
    parts.enable_gradient_checkpointing(model, llm=True, vision=True)
    model.train()
    module = step.TrainModule(model)
    batch = pack_samples(model, tiny_samples(model, VIDEO_PACK, seed=3))
    loss_ref, grads_ref = grads_of(module, batch)
    loss, grads = grads_of(module, step.to_device(batch, torch.device("cpu")))
    assert torch.equal(loss, loss_ref)
    for name, grad in grads_ref.items():
        assert torch.equal(grads[name], grad), name


def test_calls_without_a_plan_are_untouched(tiny_model, tiny_samples):
    """A tower call whose grid was not planned gets exactly the kwargs it was called with: model calls outside
    TrainModule (references, packing checks, before or after a planned forward) and the real calls of a batch
    without host grids; only the dummy image is planned then."""
    model = packed_model(tiny_model, "qwen3_vl")
    batch = pack_samples(model, tiny_samples(model, VIDEO_PACK))
    with torch.no_grad():
        before = model(**packed_model_inputs(model, batch)).logits
    module = step.TrainModule(model)
    seen: list[set] = []
    model.model.visual.register_forward_pre_hook(lambda _, args, kw: seen.append(set(kw)), with_kwargs=True)
    planned = set(vision_plan.plan_kwargs(model.model.visual, batch["image_grid_thw"], "cpu"))

    module(step.to_device(batch, torch.device("cpu")))
    assert all(planned <= keys for keys in seen) and len(seen) == 2
    seen.clear()
    with torch.no_grad():
        after = model(**packed_model_inputs(model, batch)).logits
    assert seen and all(not (planned & keys) for keys in seen)
    assert torch.equal(after, before)

    seen.clear()
    module(pack_samples(model, tiny_samples(model, IMAGE_PACK)))  # no host grids: only the dummy video is planned
    assert [bool(planned & keys) for keys in seen] == [True, False]


def test_unknown_tower_is_refused():
    with pytest.raises(ValueError, match="no vision plan for Linear"):
        vision_plan.VisionPlans(nn.Linear(2, 2))


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_worker_plans_are_the_steps_own(tiny_model, tiny_samples, family, pack):
    """A planner that went through pickling (what a DataLoader worker runs) plans a batch's grids as the step
    would: for every grid, its rows, the tower's attention implementation and the same kwargs (keys, dtypes,
    values, ints) as `plan_kwargs`, with its tensors left on the host."""
    model = packed_model(tiny_model, family)
    visual = model.model.visual
    batch = pack_samples(model, tiny_samples(model, PACKS[pack], seed=1))
    planner = pickle.loads(pickle.dumps(vision_plan.VisionPlanner(visual)))
    plans = planner.add_host_plans(batch)[vision_plan.HOST_PLANS]
    assert plans.keys() == {key for key in vision_plan.GRID_KEYS if batch.get(key) is not None}
    for key, plan in plans.items():
        assert plan["rows"] == vision_plan.host_grids(batch)[key]
        assert plan["attn"] == visual.config._attn_implementation
        expected = vision_plan.plan_kwargs(visual, batch[key], "cpu")
        assert plan["kwargs"].keys() == expected.keys()
        for name, value in expected.items():
            got = plan["kwargs"][name]
            if isinstance(value, torch.Tensor):
                assert got.device.type == "cpu" and got.dtype == value.dtype and torch.equal(got, value), name
            else:
                assert type(got) is int and got == value, name


def test_the_step_takes_the_worker_plans(tiny_model, tiny_samples, step_plans):
    """A batch that carries its loader workers' plans trains exactly as one the step plans itself (loss and
    gradients bit for bit), the tower gets the plans, and the step's host plans nothing."""
    model = packed_model(tiny_model, "qwen2_5_vl")
    module = step.TrainModule(model)
    batch = pack_samples(model, tiny_samples(model, VIDEO_PACK, seed=2))
    loss_ref, grads_ref = grads_of(module, step.to_device(batch, torch.device("cpu")))  # plans the dummy too
    step_plans.clear()
    seen: list[set] = []
    model.model.visual.register_forward_pre_hook(lambda _, args, kw: seen.append(set(kw)), with_kwargs=True)
    worker_batch = vision_plan.VisionPlanner(model.model.visual).add_host_plans(batch)
    loss, grads = grads_of(module, step.to_device(worker_batch, torch.device("cpu")))
    assert step_plans == []
    assert len(seen) == 2 and all({"position_ids", "cu_seqlens", "window_index"} <= keys for keys in seen)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("stale", ["attn", "rows"])
def test_a_stale_worker_plan_is_planned_again(tiny_model, tiny_samples, step_plans, caplog, stale):
    """A worker plan made for another attention implementation (its max seqlens would be wrong) or for other
    rows than the grid the step sees is not used: the step plans that grid itself, and says so once."""
    model = packed_model(tiny_model, "qwen3_vl")
    module = step.TrainModule(model)
    batch = pack_samples(model, tiny_samples(model, IMAGE_PACK, seed=4))
    worker_batch = vision_plan.VisionPlanner(model.model.visual).add_host_plans(batch)
    plan = worker_batch[vision_plan.HOST_PLANS]["image_grid_thw"]
    if stale == "attn":
        plan["attn"] = "flash_attention_2"
    else:
        plan["rows"] = ((1, 2, 2), *plan["rows"][1:])
    module(step.to_device(worker_batch, torch.device("cpu")))
    module(step.to_device(worker_batch, torch.device("cpu")))
    planned = [grid.tolist() for grid in step_plans]
    assert [rows for rows in planned if len(rows) > 1] == [batch["image_grid_thw"].tolist()] * 2
    assert sum("loader workers' vision plan" in record.getMessage() for record in caplog.records) == 1
