"""scripts/distributed_parity.py without launching anything: the commands and overrides of each layout for any GPU
count (and that the data loaders they configure deal every layout the same packs per optimizer step), --layouts
filtering, argument errors, the merge of --baseline files into the results and table, and main() end to end with
its launches replaced."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from core.data_config import PackingConfig
from data.packing import PackItem
from data.pipeline import StepLoader
from verification import parity

ROOT = Path(__file__).resolve().parents[1]
PORT = 29512


def overrides_of(plan_entry: list[str]) -> dict[str, str]:
    """The last value of every dotted key in a list of key=value overrides (the last one wins in load_config)."""
    return dict(item.split("=", 1) for item in plan_entry)


def fake_run(
    num_processes: int, tokens_per_s: float, losses: dict[int, float], grad_norms: dict[int, float] | None = None
) -> dict:
    """What launch() returns for one finished train.py run (by default a gradient norm of 10 at every step)."""
    summary = {
        "num_processes": num_processes,
        "tokens_per_s_per_gpu": tokens_per_s,
        "mfu": 0.3,
        "peak_mem_gib": 60.0,
        "loss_end": losses[max(losses)],
        "run_dir": "unused",
        "export_dir": None,
    }
    grad_norms = dict.fromkeys(losses, 10.0) if grad_norms is None else grad_norms
    return {"summary": summary, "losses": losses, "grad_norms": grad_norms, "wall_s": 10.0, "teardown_hang": False}


def write_baseline(path: Path, args, runs: dict[str, dict], steps: int, recipe: str = "recipes/x-shape.yaml") -> None:
    """An --out file as main() writes it (JSON turns the integer steps of the losses into strings)."""
    result = parity.summarize(recipe, steps, args, runs, {}, None)
    path.write_text(json.dumps({"overrides": args.overrides, "results": [result]}))


@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp2", "resume"])
def test_commands_for_four_gpus(layout):
    """--gpus 4: the single layout is plain train.py; ddp, fsdp2 and the fsdp2 resume launch 4 processes with
    their (existing) accelerate config, on the given port."""
    command = parity.command_for(layout, 4, PORT)
    assert command[-1] == "train.py"
    if layout == "single":
        assert command[1:] == ["train.py"]
        return
    config = command[command.index("--config_file") + 1]
    assert config == f"recipes/accelerate/{'ddp' if layout == 'ddp' else 'fsdp2'}.yaml"
    assert (ROOT / config).is_file()
    assert command[command.index("--num_processes") + 1] == "4"
    assert command[command.index("--main_process_port") + 1] == str(PORT)


@pytest.mark.parametrize(("gpus", "packs_per_step"), [(2, None), (4, None), (8, None), (2, 4), (2, 8), (4, 8)])
def test_ranks_times_micro_steps_is_the_packs_per_step(gpus, packs_per_step):
    """Each layout's ranks × micro-steps equals the packs per optimizer step (default --gpus), and each layout's
    balance window equals its micro-steps, so one window is one optimizer step (data/pipeline.py, StepLoader)."""
    argv = ["--out", "x.json", "--gpus", str(gpus)]
    argv += [] if packs_per_step is None else ["--packs-per-step", str(packs_per_step)]
    args = parity.parse_args(argv)
    expected_packs = packs_per_step or gpus
    plan = parity.launch_plan(args, steps=10, with_resume=False)
    assert list(plan) == ["single", "ddp", "fsdp2"]
    for layout, overrides in plan.items():
        values = overrides_of(overrides)
        accum = int(values["train.grad_accum_steps"])
        assert parity.num_processes(layout, gpus) * accum == expected_packs
        assert int(values["packing.balance_window_steps"]) == accum
    assert overrides_of(plan["single"])["train.grad_accum_steps"] == str(expected_packs)


def loader_for(overrides: list[str], rank: int, world_size: int) -> StepLoader:
    """A StepLoader configured by a layout's accumulation/window overrides, over 37 samples of 340-500 tokens in
    1000-token packs (two per pack: 19 packs an epoch, so epoch ends leave packs over); a batch is its sample keys."""
    values = overrides_of(overrides)
    rng = random.Random(0)
    sizes = [(rng.randint(340, 500), rng.choice([0, 64, 256])) for _ in range(37)]

    def items(epoch):
        order = random.Random(epoch).sample(range(len(sizes)), len(sizes))
        return (PackItem(key=k, length=sizes[k][0], num_patches=sizes[k][1]) for k in order)

    window = int(values["packing.balance_window_steps"])
    return StepLoader(
        items,
        fetch=list,
        collate=tuple,
        packing_cfg=PackingConfig(max_tokens=1000, buffer_size=8, balance_window_steps=window),
        rank=rank,
        world_size=world_size,
        seed=1,
        epochs=None,
        grad_accum_steps=int(values["train.grad_accum_steps"]),
    )


@pytest.mark.parametrize(("gpus", "packs_per_step"), [(4, 4), (2, 4), (8, 8), (2, 8)])
def test_layouts_train_on_the_same_packs(gpus, packs_per_step):
    """With the overrides the script gives each layout, the data loaders of its ranks hand the training loop the
    same set of packs per optimizer step, for every layout, across epoch ends (data/pipeline.py, StepLoader); the
    recipes' default window (8 steps) would shuffle steps across optimizer steps differently per layout."""
    per_layout = {}
    for layout in ("single", "fsdp2"):
        overrides = parity.micro_step_overrides(layout, gpus, packs_per_step)
        ranks = parity.num_processes(layout, gpus)
        accum = int(overrides_of(overrides)["train.grad_accum_steps"])
        batches = [iter(loader_for(overrides, rank, ranks)) for rank in range(ranks)]
        per_layout[layout] = [{frozenset(next(it)) for it in batches for _ in range(accum)} for _ in range(12)]
    assert per_layout["single"] == per_layout["fsdp2"]
    assert all(len(step) == packs_per_step for step in per_layout["single"])


def test_user_overrides_cannot_change_the_window():
    """A user's packing.balance_window_steps comes before the layout's own, which wins; other overrides pass on."""
    args = parity.parse_args(["--out", "x.json", "--gpus", "4", "packing.balance_window_steps=8", "data.seed=3"])
    values = overrides_of(parity.launch_plan(args, steps=10, with_resume=False)["single"])
    assert values["packing.balance_window_steps"] == "4"
    assert values["data.seed"] == "3"


def test_layouts_filter_and_order():
    """--layouts runs only the named layouts, in the script's order whatever order they were given in."""
    args = parity.parse_args(["--out", "x.json", "--layouts", "fsdp2,single"])
    assert list(parity.launch_plan(args, steps=10, with_resume=False)) == ["single", "fsdp2"]
    args = parity.parse_args(["--out", "x.json", "--gpus", "8", "--layouts", "fsdp2"])
    assert list(parity.launch_plan(args, steps=10, with_resume=False)) == ["fsdp2"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--layouts", "fsdp3"],
        ["--layouts", "ddp,ddp"],
        ["--layouts", ","],
        ["--gpus", "1"],
        ["--gpus", "4", "--packs-per-step", "6"],
        ["--gpus", "4", "--packs-per-step", "2"],
        ["--no-resume", "--resume-all"],
        ["--layouts", "ddp,fsdp2", "--repeat-single"],
        ["--layouts", "single", "--repeat-fast"],
        ["--layouts", "single", "--fast-override", "kernels.patch_embed=matmul"],
        ["--layouts", "single,bf16-compiled", "--fast-override", "kernels.patch_embed"],
    ],
)
def test_bad_arguments_are_refused(argv):
    """Unknown, repeated or no layouts, fewer than 2 GPUs, packs per step that the GPUs cannot share,
    contradictory resume flags, a repeat of a layout that is not run, a fast-layout override without that layout
    or not KEY=VALUE end in a usage error before anything launches."""
    with pytest.raises(SystemExit):
        parity.parse_args(["--out", "x.json", *argv])


def test_resume_plan():
    """Only fsdp2 checkpoints (halfway) and exports, and only when the resume check is planned; its micro-steps
    are those of the resumed run."""
    args = parity.parse_args(["--out", "x.json", "--gpus", "4", "--packs-per-step", "8"])
    with_resume = parity.launch_plan(args, steps=12, with_resume=True)
    fsdp2 = overrides_of(with_resume["fsdp2"])
    assert (fsdp2["checkpoint.every_steps"], fsdp2["checkpoint.export"]) == ("6", "true")
    assert overrides_of(with_resume["ddp"])["checkpoint.every_steps"] == "0"
    assert overrides_of(parity.launch_plan(args, steps=12, with_resume=False)["fsdp2"])["checkpoint.export"] == "false"
    assert parity.micro_step_overrides("resume", 4, 8) == parity.micro_step_overrides("fsdp2", 4, 8)


def test_baseline_fills_one_gpu_reference_and_adds_columns(tmp_path):
    """A 4-GPU fsdp2-only run with a 2-GPU baseline of the same packs per step and steps: scaling vs 1 GPU uses the
    baseline's single tokens/s, vs baseline the baseline's fsdp2; both loss gaps are per-step maxima."""
    base_args = parity.parse_args(["--out", "b.json", "--gpus", "2", "--packs-per-step", "4", "data.seed=1"])
    base_single = fake_run(1, 4000.0, {1: 12.0, 2: 9.0, 3: 7.0})
    base_fsdp2 = fake_run(2, 3800.0, {1: 12.0, 2: 9.01, 3: 7.02})
    write_baseline(tmp_path / "b.json", base_args, {"single": base_single, "fsdp2": base_fsdp2}, steps=3)

    args = parity.parse_args(["--out", "r.json", "--gpus", "4", "--layouts", "fsdp2", "data.seed=1"])
    baseline = parity.load_baseline([str(tmp_path / "b.json")])["x-shape"]
    run = fake_run(4, 3600.0, {1: 12.0, 2: 9.03, 3: 6.99})
    result = parity.summarize("recipes/x-shape.yaml", 3, args, {"fsdp2": run}, {}, baseline)

    row = result["layouts"]["fsdp2"]
    assert row["grad_accum_steps"] == 1
    assert row["single_from"] == "baseline"
    assert row["scaling_efficiency"] == pytest.approx(3600.0 / 4000.0)
    assert row["max_abs_dloss_vs_single"] == pytest.approx(
        max(abs(run["losses"][s] - base_single["losses"][s]) for s in (1, 2, 3))
    )
    assert row["vs_baseline"]["num_processes"] == 2
    assert row["vs_baseline"]["scaling_efficiency"] == pytest.approx(3600.0 / 3800.0)
    assert row["vs_baseline"]["max_abs_dloss"] == pytest.approx(
        max(abs(run["losses"][s] - base_fsdp2["losses"][s]) for s in (1, 2, 3))
    )
    assert {layout: base["losses_compared"] for layout, base in result["baseline"].items()} == {
        "single": True,
        "fsdp2": True,
    }

    lines = parity.table([result], tol=0.05).splitlines()
    assert "vs baseline" in lines[0] and len(lines) == 3
    assert "(baseline)" in lines[2] and "vs 2 GPUs" in lines[2]
    assert parity.passed(result, tol=0.05)
    assert not parity.passed(result, tol=0.01)


@pytest.mark.parametrize("mismatch", ["packs_per_step", "steps", "overrides", "legacy file"])
def test_baseline_losses_need_the_same_packs(tmp_path, mismatch):
    """A baseline that trained on other packs (other packs per step, steps or overrides, or a file written before
    they were recorded) still gives tokens/s ratios, but no loss gaps."""
    base_argv = ["--out", "b.json", "--gpus", "2", "--packs-per-step", "2" if mismatch == "packs_per_step" else "4"]
    base_argv += ["data.seed=2"] if mismatch == "overrides" else []
    base_args = parity.parse_args(base_argv)
    base_runs = {"single": fake_run(1, 4000.0, {1: 12.0, 2: 9.0}), "fsdp2": fake_run(2, 3800.0, {1: 12.0, 2: 9.0})}
    write_baseline(tmp_path / "b.json", base_args, base_runs, steps=3 if mismatch == "steps" else 2)
    if mismatch == "legacy file":
        report = json.loads((tmp_path / "b.json").read_text())
        del report["overrides"], report["results"][0]["packs_per_step"]
        (tmp_path / "b.json").write_text(json.dumps(report))

    args = parity.parse_args(["--out", "r.json", "--gpus", "4", "--layouts", "fsdp2"])
    baseline = parity.load_baseline([str(tmp_path / "b.json")])["x-shape"]
    result = parity.summarize(
        "recipes/x-shape.yaml", 2, args, {"fsdp2": fake_run(4, 3600.0, {1: 13.0, 2: 10.0})}, {}, baseline
    )

    row = result["layouts"]["fsdp2"]
    assert row["scaling_efficiency"] == pytest.approx(3600.0 / 4000.0)
    assert row["vs_baseline"]["scaling_efficiency"] == pytest.approx(3600.0 / 3800.0)
    assert row["max_abs_dloss_vs_single"] is None and row["vs_baseline"]["max_abs_dloss"] is None
    assert {layout: base["losses_compared"] for layout, base in result["baseline"].items()} == {
        "single": False,
        "fsdp2": False,
    }
    assert parity.passed(result, tol=0.05)


def test_later_baseline_files_replace_layouts(tmp_path):
    """--baseline p4.json,p8.json (the 8-GPU recipe): single comes from the p4 file (tokens/s only, other packs),
    fsdp2 from the p8 file, whose losses are compared; a recipe missing from every file has no baseline."""
    p4_args = parity.parse_args(["--out", "p4.json", "--gpus", "2", "--packs-per-step", "4"])
    p4_runs = {"single": fake_run(1, 4000.0, {1: 12.0, 2: 9.0}), "fsdp2": fake_run(2, 3900.0, {1: 12.0, 2: 9.5})}
    write_baseline(tmp_path / "p4.json", p4_args, p4_runs, steps=2)
    p8_args = parity.parse_args(["--out", "p8.json", "--gpus", "2", "--packs-per-step", "8", "--layouts", "fsdp2"])
    write_baseline(tmp_path / "p8.json", p8_args, {"fsdp2": fake_run(2, 3800.0, {1: 12.0, 2: 9.1})}, steps=2)

    args = parity.parse_args(["--out", "r.json", "--baseline", f"{tmp_path / 'p4.json'}, {tmp_path / 'p8.json'}"])
    baselines = parity.load_baseline(args.baseline)
    assert set(baselines) == {"x-shape"}
    assert baselines["x-shape"]["fsdp2"]["path"] == str(tmp_path / "p8.json")
    args = parity.parse_args(["--out", "r.json", "--gpus", "8", "--layouts", "fsdp2"])
    run = fake_run(8, 3500.0, {1: 12.0, 2: 9.0})
    row = parity.summarize("recipes/x-shape.yaml", 2, args, {"fsdp2": run}, {}, baselines["x-shape"])["layouts"][
        "fsdp2"
    ]
    assert row["scaling_efficiency"] == pytest.approx(3500.0 / 4000.0)
    assert row["max_abs_dloss_vs_single"] is None
    assert row["vs_baseline"]["scaling_efficiency"] == pytest.approx(3500.0 / 3800.0)
    assert row["vs_baseline"]["max_abs_dloss"] == pytest.approx(0.1)


def test_own_single_run_is_the_reference_without_baseline():
    """With single in --layouts and no baseline, the multi-GPU rows compare with this run's single layout; the
    single row has no comparison and the JSON has no baseline entry."""
    args = parity.parse_args(["--out", "r.json", "--gpus", "4"])
    runs = {
        "single": fake_run(1, 4000.0, {1: 12.0, 2: 9.0}),
        "ddp": fake_run(4, 3700.0, {1: 12.0, 2: 9.2}),
        "fsdp2": fake_run(4, 3600.0, {1: 12.0, 2: 9.0}),
    }
    result = parity.summarize("recipes/x-shape.yaml", 2, args, runs, {}, None)
    assert "baseline" not in result
    single, ddp = result["layouts"]["single"], result["layouts"]["ddp"]
    assert single["grad_accum_steps"] == 4 and single["scaling_efficiency"] is None
    assert ddp["single_from"] == "this run" and ddp["vs_baseline"] is None
    assert ddp["scaling_efficiency"] == pytest.approx(3700.0 / 4000.0)
    assert ddp["max_abs_dloss_vs_single"] == pytest.approx(0.2)
    assert "vs baseline" not in parity.table([result], tol=0.05)
    assert not parity.passed(result, tol=0.05)


def test_repeat_single_is_one_gpu_with_the_single_overrides():
    """--repeat-single launches the single layout's exact command again, right after it, on one GPU."""
    args = parity.parse_args(["--out", "r.json", "--gpus", "4", "--repeat-single", "data.seed=1"])
    plan = parity.launch_plan(args, steps=10, with_resume=False)
    assert list(plan) == ["single", parity.REPEAT, "ddp", "fsdp2"]
    assert plan[parity.REPEAT] == plan["single"]
    assert parity.num_processes(parity.REPEAT, 4) == 1
    assert parity.command_for(parity.REPEAT, 4, PORT) == parity.command_for("single", 4, PORT)


def test_bf16_compiled_is_one_gpu_like_single_plus_its_two_keys():
    """The bf16-compiled layout runs only when named: one GPU, single's packs and overrides, then bf16 weights with
    fp32 masters in the optimizer, compile and the matmul patch embedding (the shipped one-GPU path), which a user
    override cannot undo; it is judged against single, which runs the eager fp32 reference path."""
    assert parity.FAST not in parity.launch_plan(parity.parse_args(["--out", "x.json"]), 10, with_resume=False)
    argv = ["--out", "x.json", "--layouts", "fsdp2,bf16-compiled,single", "--repeat-single", "train.compile=false"]
    plan = parity.launch_plan(parity.parse_args(argv), steps=10, with_resume=False)
    assert list(plan) == ["single", parity.REPEAT, parity.FAST, "fsdp2"]
    assert plan[parity.FAST] == [*plan["single"], *parity.LAYOUT_OVERRIDES[parity.FAST]]
    assert overrides_of(plan[parity.FAST])["train.compile"] == "true"
    assert overrides_of(plan[parity.FAST])["kernels.patch_embed"] == "matmul"
    reference = overrides_of(plan["single"])
    assert (reference["train.master_weights"], reference["kernels.patch_embed"]) == ("module", "conv")
    assert parity.num_processes(parity.FAST, 2) == 1
    assert parity.command_for(parity.FAST, 2, PORT) == parity.command_for("single", 2, PORT)
    runs = {"single": fake_run(1, 100.0, {1: 5.0, 2: 4.0}), parity.FAST: fake_run(1, 130.0, {1: 5.0, 2: 4.02})}
    row = parity.summarize("recipes/x.yaml", 2, parity.parse_args(argv), runs, {}, None)["layouts"][parity.FAST]
    assert row["max_abs_dloss_vs_single"] == pytest.approx(0.02) and row["single_from"] == "this run"


def test_fast_overrides_and_repeat_reach_the_fast_launches_only():
    """--fast-override items come last in the bf16-compiled launch (after its own keys, so they win) and nowhere
    else; --repeat-fast launches it again right after it with the same overrides, one GPU, judged like it."""
    argv = ["--out", "x.json", "--layouts", "single,bf16-compiled", "--repeat-single", "--repeat-fast"]
    argv += ["--fast-override", "data.num_workers=4", "--fast-override", "data.video_share=0.5"]
    plan = parity.launch_plan(parity.parse_args([*argv, "data.num_samples=40"]), steps=10, with_resume=False)
    assert list(plan) == ["single", parity.REPEAT, parity.FAST, parity.FAST_REPEAT]
    fast_keys = [*parity.LAYOUT_OVERRIDES[parity.FAST], "data.num_workers=4"]
    assert plan[parity.FAST] == [*plan["single"], *fast_keys, "data.video_share=0.5"]
    assert plan[parity.FAST_REPEAT] == plan[parity.FAST]
    assert "data.num_workers=4" not in plan["single"] and "data.num_samples=40" in plan["single"]
    assert parity.num_processes(parity.FAST_REPEAT, 2) == 1
    runs = {"single": fake_run(1, 100.0, {1: 5.0, 2: 4.0}), parity.FAST_REPEAT: fake_run(1, 130.0, {1: 5.0, 2: 4.1})}
    result = parity.summarize("recipes/x.yaml", 2, parity.parse_args(argv), runs, {}, None)
    assert result["layouts"][parity.FAST_REPEAT]["max_abs_dloss_vs_single"] == pytest.approx(0.1)


def test_repeat_sets_the_loss_tolerance():
    """With a repeat, a loss curve passes within 2x the 1-GPU run's gap to its repeat (not the fixed --loss-tol,
    which still holds where it is larger); the repeat's own row is marked as the noise, not judged; without a
    repeat the fixed tolerance judges."""
    single = fake_run(1, 4000.0, {1: 12.0, 2: 9.0, 3: 7.0})
    repeat = fake_run(1, 3990.0, {1: 12.0, 2: 9.3, 3: 7.1})
    args = parity.parse_args(["--out", "r.json", "--repeat-single"])
    for ddp_step2, ok in ((9.55, True), (9.65, False)):
        ddp = fake_run(2, 3800.0, {1: 12.0, 2: ddp_step2, 3: 7.0})
        result = parity.summarize(
            "recipes/x-shape.yaml", 3, args, {"single": single, parity.REPEAT: repeat, "ddp": ddp}, {}, None
        )
        assert result["noise_max_abs_dloss"] == pytest.approx(0.3)
        assert parity.loss_tolerance(result, tol=0.05) == pytest.approx(0.6)
        assert parity.loss_tolerance(result, tol=0.8) == 0.8
        assert parity.passed(result, tol=0.05) is ok
        lines = parity.table([result], tol=0.05).splitlines()
        assert lines[3].startswith(f"| x-shape | {parity.REPEAT} |") and lines[3].endswith("(noise) |")
        assert lines[4].endswith(" ✓ |" if ok else " ✗ |")
    no_repeat = parity.summarize("recipes/x-shape.yaml", 3, args, {"single": single, "ddp": ddp}, {}, None)
    assert "noise_max_abs_dloss" not in no_repeat
    assert parity.loss_tolerance(no_repeat, tol=0.05) == 0.05


@pytest.mark.parametrize("same_packs", [True, False])
def test_baseline_repeat_lends_its_noise(tmp_path, same_packs):
    """A 4-GPU run without a single layout takes the loss tolerance from the baseline's 1-GPU run and its repeat,
    when they trained on the same packs; a baseline on other packs lends neither losses nor noise."""
    base_args = parity.parse_args(
        ["--out", "b.json", "--gpus", "2", "--packs-per-step", "4" if same_packs else "2", "--repeat-single"]
    )
    base_runs = {
        "single": fake_run(1, 4000.0, {1: 12.0, 2: 9.0}),
        parity.REPEAT: fake_run(1, 4000.0, {1: 12.0, 2: 9.4}),
    }
    write_baseline(tmp_path / "b.json", base_args, base_runs, steps=2)
    args = parity.parse_args(["--out", "r.json", "--gpus", "4", "--layouts", "fsdp2"])
    baseline = parity.load_baseline([str(tmp_path / "b.json")])["x-shape"]
    run = fake_run(4, 3600.0, {1: 12.0, 2: 9.5})
    result = parity.summarize("recipes/x-shape.yaml", 2, args, {"fsdp2": run}, {}, baseline)
    row = result["layouts"]["fsdp2"]
    if same_packs:  # a 0.5 gap, beyond --loss-tol, within 2x the baseline's noise
        assert result["noise_max_abs_dloss"] == pytest.approx(0.4)
        assert row["max_abs_dloss_vs_single"] == pytest.approx(0.5)
        assert parity.loss_tolerance(result, tol=0.05) == pytest.approx(0.8)
    else:  # other packs: neither its losses nor its noise apply
        assert "noise_max_abs_dloss" not in result and row["max_abs_dloss_vs_single"] is None
    assert parity.passed(result, tol=0.05)


@pytest.mark.parametrize(("norm", "ok"), [(10.05, True), (10.2, False), (None, True)])
def test_step1_gradient_norm_gap(norm, ok):
    """The step-1 gradient norm (same weights, same packs) is compared relative to the 1-GPU run's: 0.5% passes,
    2% fails the run whatever the loss curves; a run that did not log step 1 is not compared."""
    single = fake_run(1, 4000.0, {1: 12.0, 2: 9.0}, {1: 10.0, 2: 8.0})
    norms = {2: 8.0} if norm is None else {1: norm, 2: 8.0}
    fsdp2 = fake_run(2, 3800.0, {1: 12.0, 2: 9.0}, norms)
    args = parity.parse_args(["--out", "r.json"])
    result = parity.summarize("recipes/x-shape.yaml", 2, args, {"single": single, "fsdp2": fsdp2}, {}, None)
    gap = result["layouts"]["fsdp2"]["step1_grad_norm_rel_vs_single"]
    assert gap == (None if norm is None else pytest.approx(abs(norm - 10.0) / 10.0))
    assert parity.passed(result, tol=0.05) is ok
    assert parity.table([result], tol=0.05).splitlines()[3].count("✗") == (0 if ok else 1)


def test_load_baseline_refuses_other_json(tmp_path):
    """A file that is not a distributed_parity.py result is a clear ValueError naming the flag, not a KeyError."""
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"tokens_per_s_per_gpu": 1.0}))
    with pytest.raises(ValueError, match="--baseline"):
        parity.load_baseline([str(path)])


def test_main_writes_a_file_the_next_run_can_use_as_baseline(tmp_path, monkeypatch, capsys):
    """main() end to end with launch() replaced (nothing trains): a 2-GPU run at 4 packs per step writes a JSON
    that a 4-GPU fsdp2-only run reads as its baseline; each launch gets its layout's process count and
    micro-steps, the JSON keeps the old fields and records the new ones, and parity passes (exit 0)."""
    import torch

    launched = []

    def fake_launch(layout, recipe, run_dir, overrides, gpus, timeout):
        values = overrides_of(overrides)
        launched.append((layout, parity.num_processes(layout, gpus), int(values["train.grad_accum_steps"])))
        return fake_run(parity.num_processes(layout, gpus), 3000.0 + gpus, {1: 12.0, 2: 9.0})

    monkeypatch.setattr(parity, "launch", fake_launch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "fake GPU")
    recipe = "recipes/bench-qwen2_5_vl-7b-shape.yaml"
    common = ["--recipes", recipe, "--steps", "2", "--no-resume", "data.seed=1"]
    base = tmp_path / "p4.json"
    argv = ["--out", str(base), "--gpus", "2", "--packs-per-step", "4", "--layouts", "single,fsdp2", *common]
    assert parity.main([*argv, "--repeat-single"]) == 0
    assert launched == [("single", 1, 4), (parity.REPEAT, 1, 4), ("fsdp2", 2, 2)]
    assert "the 1-GPU run and its repeat differ by up to 0.00e+00" in capsys.readouterr().out

    launched.clear()
    out = tmp_path / "p4-4gpu.json"
    argv = ["--out", str(out), "--gpus", "4", "--layouts", "fsdp2", "--baseline", str(base), *common]
    assert parity.main(argv) == 0
    assert launched == [("fsdp2", 4, 1)]
    report = json.loads(out.read_text())
    assert (report["gpus"], report["packs_per_step"], report["baseline"]) == (4, 4, [str(base)])
    row = report["results"][0]["layouts"]["fsdp2"]
    assert {"num_processes", "tokens_per_s_per_gpu", "scaling_efficiency", "max_abs_dloss_vs_single"} <= set(row)
    assert row["single_from"] == "baseline" and row["max_abs_dloss_vs_single"] == 0.0
    assert row["vs_baseline"] == {
        "num_processes": 2,
        "scaling_efficiency": pytest.approx(3004 / 3002),
        "max_abs_dloss": 0.0,
    }
    assert "vs baseline" in capsys.readouterr().out
