"""Pinned MoE routing (verification/routing_pin.py) and its use in the packed vs per-sample check."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling.packed import enable_packed_forward
from verification.packing_check import RELATIVE_TOLERANCE, SampleSpec, compare_packed_to_per_sample
from verification.routing_pin import PinnedRouting, routers

ROOT = Path(__file__).resolve().parents[1]

MOE_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")
PACK = (
    SampleSpec(0, ((4, 4),), text_after=9),  # the pack starts with an image
    SampleSpec(40),  # text only
    SampleSpec(1),  # one token
    SampleSpec(3, ((2, 4),), text_after=5),
)


def text_ids(model, length: int, seed: int = 0) -> torch.Tensor:
    """long (1, length) random text token ids (above the special ids)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(16, model.config.text_config.vocab_size, (1, length), generator=generator)


def assert_passes(model, samples):
    report = compare_packed_to_per_sample(model, samples)
    assert report.grads, "no gradients compared"
    assert not report.failures(RELATIVE_TOLERANCE[model.dtype]), "\n".join(
        report.failures(RELATIVE_TOLERANCE[model.dtype])
    )
    return report


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fp32_pack_equals_per_sample_with_pinned_routing_and_no_flips(tiny_samples, tiny_model, family):
    """fp32 MoE: packed == per-sample with routing pinned, and the packed run's own top-k agrees with the per-sample
    choice for every token of every router (no flips), counted once per token and router."""
    model = tiny_model(family)
    enable_packed_forward(model)
    samples = tiny_samples(model, PACK)
    report = assert_passes(model, samples)
    assert report.routing_choices == sum(len(s) for s in samples) * len(routers(model)) > 0
    assert report.routing_flips == 0


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_pack_equals_per_sample_with_pinned_routing(tiny_samples, tiny_model, family):
    """bf16 on the CPU: packed == per-sample within bf16 rounding for both MoE families, with routing pinned in the
    packed run and in the fp32 copy that measures the per-sample run's own rounding."""
    model = tiny_model(family, dtype="bfloat16")
    enable_packed_forward(model)
    report = assert_passes(model, tiny_samples(model, PACK, seed=1))
    assert report.routing_choices > 0
    assert report.logits.own_rounding > 0


def test_gradient_checkpointing_recompute_counts_each_choice_once(tiny_samples, tiny_model):
    """With gradient checkpointing the routers run again in the backward; they replay the same pinned choices (the
    pack still equals per-sample) and the recompute overwrites its count instead of adding to it."""
    model = tiny_model("qwen3_5_moe")
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    enable_packed_forward(model)
    samples = tiny_samples(model, PACK)
    report = assert_passes(model, samples)
    assert report.routing_choices == sum(len(s) for s in samples) * len(routers(model))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replay_forces_the_recorded_choices(tiny_model, family):
    """Replayed choices reach the experts: after rolling every recorded expert id, the experts receive exactly the
    rolled ids with weights renormalised from the router's own softmax at those ids, and every choice counts as a
    flip (a shifted top-k set of k < E experts is never the same set)."""
    model = tiny_model(family)
    input_ids = text_ids(model, 12)
    pins = PinnedRouting()
    pins.sample = 0
    with pins.recording(model):
        model(input_ids=input_ids, use_cache=False)
    num_experts = model.config.text_config.num_experts
    rolled = {key: (choice + 1) % num_experts for key, choice in pins.choices.items()}
    pins.choices.update(rolled)

    router_outputs, expert_inputs = {}, {}
    modules = dict(model.named_modules())
    with pins.replaying(model) as flips:
        handles = []
        for name, router in routers(model).items():
            experts = modules[name.rsplit(".", 1)[0] + ".experts"]
            handles.append(router.register_forward_hook(lambda m, a, out, n=name: router_outputs.__setitem__(n, out)))
            handles.append(
                experts.register_forward_pre_hook(lambda m, args, n=name: expert_inputs.__setitem__(n, args))
            )
        model(input_ids=input_ids, use_cache=False)
        for handle in handles:
            handle.remove()

    assert set(expert_inputs) == set(routers(model)) != set()
    for name, (_, indices, weights) in expert_inputs.items():
        logits = router_outputs[name][0]
        torch.testing.assert_close(indices, rolled[name, 0], rtol=0, atol=0)
        probabilities = logits.float().softmax(dim=-1)
        chosen = torch.stack([probabilities[token, indices[token]] for token in range(indices.shape[0])])
        torch.testing.assert_close(weights, chosen / chosen.sum(dim=-1, keepdim=True))
    assert flips.flips == flips.choices == input_ids.shape[1] * len(routers(model))


def test_recording_refuses_a_router_formula_it_cannot_replay(tiny_model, monkeypatch):
    """If transformers' router computes its scores differently from routing_weights (here: top-k probabilities not
    renormalised), recording raises instead of letting replay silently change the model."""
    model = tiny_model("qwen3_vl_moe")
    router_class = type(next(iter(routers(model).values())))
    original_forward = router_class.forward

    def unnormalised_forward(self, hidden_states):
        logits, _, indices = original_forward(self, hidden_states)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float)
        return logits, probabilities.gather(-1, indices).to(logits.dtype), indices

    monkeypatch.setattr(router_class, "forward", unnormalised_forward)
    pins = PinnedRouting()
    pins.sample = 0
    with pytest.raises(RuntimeError, match="compute routing weights differently"), pins.recording(model):
        model(input_ids=text_ids(model, 8), use_cache=False)


def test_replay_refuses_choices_that_do_not_fit_the_run(tiny_model):
    """Replaying onto a run with a different token count, or with nothing recorded, is a ValueError that says so."""
    model = tiny_model("qwen3_vl_moe")
    pins = PinnedRouting()
    pins.sample = 0
    with pins.recording(model):
        model(input_ids=text_ids(model, 8), use_cache=False)
    with pytest.raises(ValueError, match="routes"), pins.replaying(model):
        model(input_ids=text_ids(model, 9), use_cache=False)
    pins.sample = 1
    with pytest.raises(ValueError, match="no routing recorded"), pins.replaying(model):
        model(input_ids=text_ids(model, 8), use_cache=False)


def test_model_without_routers_is_left_alone():
    """A dense model has no routers: recording and replaying change nothing and count nothing."""
    model = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 4)
    pins = PinnedRouting()
    with pins.recording(model):
        expected = model(inputs)
    with pins.replaying(model) as flips:
        torch.testing.assert_close(model(inputs), expected, rtol=0, atol=0)
    assert routers(model) == {} and pins.choices == {}
    assert (flips.flips, flips.choices) == (0, 0)


def test_verify_packing_script_reports_routing_of_a_moe_recipe(tmp_path):
    """`python -m scripts.verify_packing` on a tiny MoE recipe (fp32) passes and prints, under each pack's row, how
    many of its token choices were pinned and that none would flip."""
    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=40", "packing.max_tokens=256"]
    command = [sys.executable, "-m", "scripts.verify_packing", "--config", "recipes/tiny-qwen3_vl_moe.yaml"]
    done = subprocess.run(
        [*command, "--packs", "2", "--rope", "unfused", *overrides], cwd=ROOT, capture_output=True, text=True
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert out.count("routing: 0 of ") == 2 and "token choices would flip (pinned)" in out, out
