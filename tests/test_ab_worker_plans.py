"""scripts/ab_worker_plans.py: train.py's run with the two modes in ABBA blocks, one log interval each; the
step-plans blocks hand the step batches without the workers' vision plans (so it plans them itself), the others
keep them."""

from __future__ import annotations

import json

from accelerate.state import AcceleratorState

from scripts import ab_worker_plans
from training import step, vision_plan

TINY = "recipes/tiny-qwen2_5_vl.yaml"
TINY_OVERRIDES = [
    "data.num_samples=32",
    "data.eval_fraction=0",
    "packing.max_tokens=256",
    "model.dtype=float32",
    "kernels.mrope=unfused",
    "logging.report_to=none",
    "logging.progress_bar=false",
    "checkpoint.export=false",
]


def test_blocks_alternate_and_only_the_step_plans_blocks_drop_the_worker_plans(tmp_path, monkeypatch):
    kept: list[bool] = []
    forward = step.TrainModule.forward

    def recording(self, batch):
        kept.append(vision_plan.HOST_PLANS in batch)
        return forward(self, batch)

    monkeypatch.setattr(step.TrainModule, "forward", recording)
    out = tmp_path / "run"
    argv = ["--config", TINY, "--out", str(out), "--rounds", "2", "--block", "1", "--warmup", "1", *TINY_OVERRIDES]
    try:
        report = ab_worker_plans.main([*argv, f"data.cache_dir={tmp_path / 'cache'}"])
    finally:  # the next test that builds an Accelerator must not inherit this one's state
        AcceleratorState._reset_state(reset_partial_state=True)
    modes = [block["mode"] for block in report["blocks"]]
    assert modes == ["worker plans", "step plans", "step plans", "worker plans"]
    assert [b["last_step"] for b in report["blocks"]] == [2, 3, 4, 5]
    assert kept == [True] + [mode == "worker plans" for mode in modes], "plans kept in the warm-up and A blocks"
    assert json.loads((out / "ab.json").read_text()) == report
    assert report["step_plans_over_worker_plans"] > 0


def test_block_modes():
    mode = [ab_worker_plans.block_mode(s, warmup=5, block=5) for s in range(1, 26)]
    assert mode[:5] == [None] * 5
    assert mode[5:] == ["worker plans"] * 5 + ["step plans"] * 10 + ["worker plans"] * 5
