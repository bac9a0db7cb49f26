"""The memory estimate against the measured peaks it is calibrated on (trainer/memory_calibration.json): every point
within the target (measured / estimated 0.90 to 1.05: within 10%, never more than 5% over the estimate), and no run
that ran refused by the check; each point says where, when and with what it was measured."""

from __future__ import annotations

import json
import re

import pytest

from scripts import estimate_memory as cli
from trainer.memory_check import REFERENCE_GPUS
from trainer.memory_estimate import CALIBRATION_FILE

CALIBRATION = json.loads(CALIBRATION_FILE.read_text())
POINTS = CALIBRATION["points"]
FIELDS = {"run", "recipe", "overrides", "processes", "sharding", "peak_gib", "gpu", "date", "commit", "source"}


def capacity(gpu: str) -> float:
    """The memory of the GPU a point ran on (the reference figures of trainer/memory_check.py)."""
    h100, h200 = REFERENCE_GPUS
    return h200.capacity_gib if "H200" in gpu else h100.capacity_gib


def test_every_point_records_its_gpu_date_commit_and_source():
    """Each point holds the run, its recipe, overrides and launch, the peak, the GPU, an ISO date, the commit (or that
    none was recorded) and the file or issue it comes from; an excluded point says why; the issue's six H100 peaks of
    2026-12-06 are there."""
    for point in POINTS:
        assert point.keys() >= FIELDS, point["run"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", point["date"]) and point["gpu"].startswith("NVIDIA")
        assert point.get("excluded", "x") != ""
    issue = {(p["recipe"], p["peak_gib"]) for p in POINTS if p["date"] == "2026-12-06" and p["commit"] == "ab9e10a"}
    assert len(issue) == 6 and ("recipes/qwen3_vl-2b.yaml", 69.2) in issue


@pytest.mark.parametrize("point", [p for p in POINTS if not p.get("excluded")], ids=lambda p: p["run"][:60])
def test_each_measured_peak_is_within_the_target_and_its_run_is_admitted(point):
    """measured / estimated peak within the calibration's target, and the estimate's total (allocator and runtime
    margins added) within the memory of the GPU that ran it: the check would not have refused it."""
    estimate = cli.estimate_point(point)
    ratio = point["peak_gib"] / estimate.peak_gib
    assert cli.within_target(ratio, CALIBRATION["target"]), f"{point['run']}: measured / estimated {ratio:.3f}"
    assert estimate.total_gib <= capacity(point["gpu"]), point["run"]


def test_the_target_is_the_documented_one():
    """The target the points are held to: within 10% and never more than 5% above the estimate."""
    assert CALIBRATION["target"] == {"measured_over_estimate_min": 0.90, "measured_over_estimate_max": 1.05}
