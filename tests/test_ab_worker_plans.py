"""scripts/ab_worker_plans.py: the two modes alternate in ABBA order, and the step-plans mode hands the step batches
without the workers' vision plans (so it plans them itself) while the other keeps them."""

from __future__ import annotations

import json

from accelerate.state import AcceleratorState

from scripts import ab_worker_plans
from training import step, vision_plan

TINY = "recipes/tiny-qwen2_5_vl.yaml"
TINY_OVERRIDES = ["data.num_samples=32", "packing.max_tokens=256", "model.dtype=float32", "kernels.mrope=unfused"]


def test_blocks_alternate_and_only_the_step_plans_mode_drops_the_worker_plans(tmp_path, monkeypatch):
    seen: list[bool] = []
    forward = step.TrainModule.forward

    def recording(self, batch):
        if batch.get("image_grid_thw") is not None:
            seen.append(vision_plan.HOST_PLANS in batch)
        return forward(self, batch)

    monkeypatch.setattr(step.TrainModule, "forward", recording)
    out = tmp_path / "ab.json"
    argv = ["--config", TINY, "--rounds", "2", "--block", "1", "--warmup", "0", "--out", str(out), *TINY_OVERRIDES]
    try:
        report = ab_worker_plans.main([*argv, f"data.cache_dir={tmp_path / 'cache'}"])
    finally:  # the next test that builds an Accelerator must not inherit this one's state
        AcceleratorState._reset_state(reset_partial_state=True)
    modes = [block["mode"] for block in report["blocks"]]
    assert modes == ["worker plans", "step plans", "step plans", "worker plans"]
    assert seen == [mode == "worker plans" for mode in modes], "each block's batch: plans kept only in its own mode"
    assert json.loads(out.read_text()) == report
    assert report["step_plans_over_worker_plans"] > 0
