"""verification/throughput_compare.py (`python -m scripts.compare_throughput`): the fused-vs-unfused comparison end
to end on a tiny CPU run (two train.py processes, two offline wandb runs in one group, table, plot, JSON), and its
bookkeeping on hand-made results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from core.config_tree import ConfigError
from verification import throughput_compare as compare

TINY = "recipes/tiny-qwen2_5_vl.yaml"
# Small enough for two CPU runs in about a minute: short packs, few samples, two timed steps.
TINY_OVERRIDES = [
    "data.num_samples=48",
    "packing.max_tokens=256",
    "model.dtype=float32",
    "checkpoint.export=false",
    "train.eval_every=0",
    "logging.progress_bar=false",
]
LEVELDB_BLOCK = 32768
LEVELDB_HEADER = 7  # crc32 (4) + length (2) + record type (1)
WANDB_FILE_HEADER = 7  # ":W&B" + magic (2) + version (1)


def wandb_file_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The protobuf records of an offline `run-*.wandb` file: a W&B header, then LevelDB-log framed records
    (32 KiB blocks; a record split across blocks comes as FIRST, MIDDLE…, LAST fragments)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    records, pending, pos = [], b"", WANDB_FILE_HEADER
    while pos + LEVELDB_HEADER <= len(data):
        room = LEVELDB_BLOCK - pos % LEVELDB_BLOCK
        if room < LEVELDB_HEADER:  # block trailer padding
            pos += room
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        payload = data[pos + LEVELDB_HEADER : pos + LEVELDB_HEADER + length]
        pos += LEVELDB_HEADER + length
        if kind == 1:  # FULL
            records.append(wandb_internal_pb2.Record.FromString(payload))
        elif kind == 2:  # FIRST
            pending = payload
        elif kind == 3:  # MIDDLE
            pending += payload
        elif kind == 4:  # LAST
            records.append(wandb_internal_pb2.Record.FromString(pending + payload))
    return records


def wandb_run_record(run_dir: Path) -> wandb_internal_pb2.RunRecord:
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline wandb run under {run_dir}, found {files}"
    runs = [r.run for r in wandb_file_records(files[0]) if r.HasField("run")]
    assert runs, f"{files[0]} holds no run record"
    return runs[0]


@pytest.mark.slow
def test_fused_and_unfused_land_in_one_wandb_group(tmp_path, monkeypatch):
    """Separate train.py runs, fused and unfused alternating twice (A B A B), see the same batches, their losses
    agree closely (same math, different rope code); each variant reports the median of its repeats with the
    spread and a device-busy bound in [0, 1]; the table/PNG/JSON are written, and every offline wandb run carries
    the comparison's group and its own variant tag."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    out = tmp_path / "compare"
    argv = ["--config", TINY, "--steps", "3", "--warmup", "1", "--repeats", "2", "--out", str(out)]
    report = compare.main([*argv, "--group", "ci-compare", *TINY_OVERRIDES])

    assert report["run_order"] == [["fused", 1], ["unfused", 1], ["fused", 2], ["unfused", 2]]
    rows = report["variants"]
    assert list(rows) == ["fused", "unfused"]
    assert rows["fused"]["fused_rope"] and not rows["unfused"]["fused_rope"]
    for row in rows.values():
        assert row["timed_steps"] == 2 and [run["repeat"] for run in row["runs"]] == [1, 2]
        speeds = [run["tokens_per_s_per_gpu"] for run in row["runs"]]
        assert row["tokens_per_s_per_gpu"] == pytest.approx(sum(speeds) / 2)  # the median of two
        assert row["tokens_per_s_min"] == min(speeds) > 0 and row["tokens_per_s_max"] == max(speeds)
        assert all(run["gpu_busy"] is None for run in row["runs"])  # no GPU here: no NVML samples
    assert rows["fused"]["same_data_as_baseline"]
    assert rows["fused"]["max_abs_dloss_vs_baseline"] < 1e-3
    assert report["ratios"]["fused/unfused tokens/s"]["median"] == pytest.approx(
        rows["fused"]["tokens_per_s_per_gpu"] / rows["unfused"]["tokens_per_s_per_gpu"]
    )
    assert json.loads((out / "comparison.json").read_text())["wandb_group"] == "ci-compare"
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "comparison.md").read_text()
    assert "| fused | 2 |" in table and "| unfused | 2 |" in table

    for variant in ("fused", "unfused"):
        for repeat in (1, 2):
            run = wandb_run_record(out / variant / f"run{repeat}")
            assert run.run_group == "ci-compare"
            assert variant in run.tags


@pytest.mark.slow
def test_heldout_samples_score_each_real_run_once_after_its_last_step(tmp_path):
    """--heldout-samples on real tiny runs (fused, unfused, padded): each run answers the held-out records once, at
    its last step, after its timed steps (train.py's timed step count is unchanged); every row reports exact match in
    [0, 1] and its per-kind scores, fused and unfused (same weights up to rounding) answer alike, and the table has
    the held-out column."""
    out = tmp_path / "compare"
    argv = ["--config", TINY, "--steps", "3", "--warmup", "1", "--repeats", "1", "--out", str(out)]
    overrides = [*TINY_OVERRIDES, "data.eval_fraction=0.1", "logging.report_to=none", "train.generate_max_new_tokens=4"]
    report = compare.main([*argv, "--variants", "fused,unfused,padded", "--heldout-samples", "3", *overrides])

    for name, row in report["variants"].items():
        assert row["timed_steps"] == 2, name
        heldout = row["heldout"]
        assert heldout["step"] == 3 and heldout["runs"] == 1, name
        assert 0.0 <= heldout["exact_match"]["median"] <= 1.0
        assert any(key.startswith("exact_match/") for key in heldout), name
        answers = Path(row["runs"][0]["run_dir"]) / "generations" / "step_00000003.jsonl"
        assert len(answers.read_text().splitlines()) == 3
        assert sorted(p.name for p in answers.parent.iterdir()) == [answers.name]  # one evaluation only
    fused_vs_unfused = report["ratios"]["fused vs unfused held-out exact match"]
    assert fused_vs_unfused["gap"] == 0.0 and fused_vs_unfused["within_repeat_spread"]
    assert "packed vs padded held-out exact match" in report["ratios"]
    assert "held-out exact match" in (out / "comparison.md").read_text()


def _result(
    variant: str,
    losses: list[float],
    efficiency: list[float],
    tokens_per_s: float,
    repeat: int = 1,
    busy: float = 0.98,
    heldout: dict | None = None,
) -> compare.RunResult:
    """A run whose GPU was `busy` during its timed steps (idle before them, as during start-up)."""
    step_time = 1000.0 / tokens_per_s
    records = [
        {
            "step": i + 1,
            "loss": loss,
            "pack_efficiency": eff,
            "step_time_s": step_time,
        }
        for i, (loss, eff) in enumerate(zip(losses, efficiency))
    ]
    summary = {
        "tokens_per_s_per_gpu": tokens_per_s,
        "mfu": tokens_per_s / 1e4,
        "peak_mem_gib": 1.0,
        "loss_end": losses[-1],
        "timed_steps": len(losses) - 1,
        "timed_seconds": (len(losses) - 1) * step_time,
        "fused_rope": variant != "unfused",
    }
    samples = [(0, 0.0), (0, 0.3), *((step, busy) for step in range(1, len(losses)) for _ in range(3))]
    samples.append((len(losses), 0.0))  # after the last step: export and teardown, not timed
    return compare.RunResult(variant, repeat, Path(variant) / f"run{repeat}", summary, records, 1.0, samples, heldout)


def test_ratios_and_loss_gaps_follow_the_baseline():
    """Ratios divide by the baseline; |Δloss| is the largest per-step gap; the padded run, which sees other
    batches, gets no loss comparison with a packed baseline; differing batches show as not the same data."""
    results = [
        _result("fused", [5.0, 4.0, 3.0], [0.9, 0.8, 0.9], 120.0),
        _result("unfused", [5.0, 4.1, 2.8], [0.9, 0.8, 0.9], 100.0),
        _result("padded", [5.5, 4.5, 3.5], [0.5, 0.4, 0.5], 60.0),
    ]
    comparison = compare.compare(results, "unfused", warmup=1)
    rows = comparison["variants"]
    assert rows["fused"]["tokens_per_s_per_gpu_ratio"] == pytest.approx(1.2)
    assert rows["fused"]["max_abs_dloss_vs_baseline"] == pytest.approx(0.2)
    assert rows["fused"]["same_data_as_baseline"] is True
    assert rows["padded"]["max_abs_dloss_vs_baseline"] is None
    assert comparison["ratios"]["packed/padded tokens/s"]["median"] == pytest.approx(2.0)
    assert "| padded |" in compare.table(comparison)

    shifted = _result("fused", [5.0, 4.0, 3.0], [0.9, 0.7, 0.9], 120.0)
    assert not compare.same_data(shifted, results[1])


def test_shipped_pair_differs_only_in_the_rope_and_names_its_ratio():
    """shipped-unfused is the recipe as shipped with transformers' rope and nothing else changed; beside shipped its
    fused/unfused ratio and loss gap are named, and it is the default baseline when no eager unfused run is there."""
    assert compare.VARIANT_OVERRIDES["shipped-unfused"] == {"kernels.mrope": "unfused"}
    results = [
        _result("shipped", [5.0, 4.0, 3.0], [0.9, 0.8, 0.9], 130.0),
        _result("shipped-unfused", [5.0, 4.05, 3.0], [0.9, 0.8, 0.9], 100.0),
    ]
    ratios = compare.compare(results, "shipped-unfused", warmup=1)["ratios"]
    assert ratios["shipped fused/unfused tokens/s"]["median"] == pytest.approx(1.3)
    assert ratios["shipped fused vs unfused max |dloss|"] == pytest.approx(0.05)


def test_one_variant_is_measured_alone(tmp_path):
    """A single variant (its repeats' spread, no peer) gets its row, table and plot. Its step time is train.py's
    timed wall time over its timed steps (summary.json), whatever the log interval; the plot draws tokens/s where
    a record has it (the logged steps) and the loss at every step."""
    runs = [
        _result("bf16-compiled", [5.0, 4.0, 3.0, 2.5], [0.9] * 4, rate, repeat) for repeat, rate in ((1, 90), (2, 110))
    ]
    for run in runs:
        for record in run.records:
            del record["step_time_s"]  # a step between logs carries no rates
        run.records[-1]["tokens_per_s_per_gpu"] = run.summary["tokens_per_s_per_gpu"]
    comparison = compare.compare(runs, "bf16-compiled", warmup=2)
    row = comparison["variants"]["bf16-compiled"]
    assert row["tokens_per_s_per_gpu"] == pytest.approx(100.0)
    assert row["step_time_s"] == pytest.approx((1000 / 90 + 1000 / 110) / 2)
    assert comparison["ratios"] == {}
    assert "| bf16-compiled |" in compare.table(comparison)
    compare.plot(runs, 2, "one variant", tmp_path / "comparison.png")
    assert (tmp_path / "comparison.png").stat().st_size > 0


def test_a_failed_run_is_listed_and_the_others_still_count(tmp_path, monkeypatch):
    """A run that fails (or is killed at its timeout) goes into `failed` and the comparison goes on: the other runs
    give the medians; with no finished run of the baseline there is nothing to compare with, and main says so."""

    def fake_run(variant, repeat, *args):
        if (variant, repeat) == ("fused", 1):
            raise RuntimeError("variant fused run 1 failed (killed after --run-timeout 300 s); end of train.log:\n...")
        rate = {"fused": 120.0, "unfused": 100.0}[variant] + repeat
        return _result(variant, [5.0, 4.0, 3.0], [0.9, 0.8, 0.9], rate, repeat)

    monkeypatch.setattr(compare, "run_variant", fake_run)
    argv = ["--config", TINY, "--steps", "3", "--warmup", "1", "--repeats", "2", "--out", str(tmp_path / "a")]
    report = compare.main(argv)
    assert report["failed"] == [
        {
            "variant": "fused",
            "repeat": 1,
            "error": "variant fused run 1 failed (killed after --run-timeout 300 s); end of train.log:",
        }
    ]
    assert [run["repeat"] for run in report["variants"]["fused"]["runs"]] == [2]
    assert report["variants"]["fused"]["tokens_per_s_per_gpu"] == pytest.approx(122.0)
    assert report["variants"]["unfused"]["tokens_per_s_per_gpu"] == pytest.approx(101.5)
    assert json.loads((tmp_path / "a" / "comparison.json").read_text())["failed"] == report["failed"]

    monkeypatch.setattr(compare, "run_variant", lambda *a: fake_run("fused", 1))
    with pytest.raises(RuntimeError, match="no run of the baseline"):
        compare.main([*argv[:-1], str(tmp_path / "b")])


def test_repeats_give_medians_spread_ratio_ranges_and_host_bound_flags():
    """A variant's throughput is the median of its repeats with min and max beside it; a ratio is the ratio of
    medians with the range the repeats allow (min/max .. max/min); a run whose GPU was busy less than
    HOST_BOUND_THRESHOLD of its timed steps (samples before and after them not counted) is flagged host-bound, and so
    is its variant."""
    losses, efficiency = [5.0, 4.0, 3.0], [0.9, 0.8, 0.9]
    results = [
        _result("fused", losses, efficiency, 120.0, repeat=1),
        _result("unfused", losses, efficiency, 100.0, repeat=1),
        _result("fused", losses, efficiency, 90.0, repeat=2, busy=0.6),
        _result("unfused", losses, efficiency, 104.0, repeat=2),
        _result("fused", losses, efficiency, 126.0, repeat=3),
        _result("unfused", losses, efficiency, 96.0, repeat=3),
    ]
    comparison = compare.compare(results, "unfused", warmup=1)
    fused, unfused = comparison["variants"]["fused"], comparison["variants"]["unfused"]
    assert fused["tokens_per_s_per_gpu"] == 120.0 and unfused["tokens_per_s_per_gpu"] == 100.0
    assert (fused["tokens_per_s_min"], fused["tokens_per_s_max"]) == (90.0, 126.0)
    assert fused["tokens_per_s_spread"] == pytest.approx(36.0 / 120.0)
    assert comparison["ratios"]["fused/unfused tokens/s"] == pytest.approx(
        {"median": 1.2, "min": 90.0 / 104.0, "max": 126.0 / 96.0}
    )
    assert [run["host_bound"] for run in fused["runs"]] == [False, True, False]
    assert fused["runs"][1]["gpu_busy"] == pytest.approx(0.6)
    assert fused["host_bound"] and not unfused["host_bound"]
    assert fused["gpu_busy"] == pytest.approx(0.98)
    assert "host-bound" in compare.table(comparison)
    assert "repeats allow 0.865–1.312" in compare.ratio_lines(comparison["ratios"])


def _alternating_repeats(unfused_repeat_step_3: float) -> list[compare.RunResult]:
    """Three fused runs and two unfused ones, alternating, on the same batches; the second unfused run's loss at
    step 3 is the argument (3.2: the same as its first)."""
    efficiency = [0.9, 0.8, 0.9, 0.9]
    return [
        _result("fused", [5.0, 4.0, 3.0, 2.0], efficiency, 120.0, repeat=1),
        _result("unfused", [5.0, 4.0, 3.2, 2.5], efficiency, 100.0, repeat=1),
        _result("fused", [5.0, 4.0, 3.1, 1.7], efficiency, 121.0, repeat=2),
        _result("unfused", [5.0, 4.0, unfused_repeat_step_3, 2.5], efficiency, 101.0, repeat=2),
        _result("fused", [5.0, 4.05, 3.0, 2.0], efficiency, 119.0, repeat=3),
    ]


def test_repeats_give_the_run_to_run_loss_noise_a_gap_is_read_against():
    """A variant's repeats see the same batches; the largest |Δloss| of a later repeat against its first run is
    the noise floor beside the fused-vs-unfused gap (in the row, the ratios and the table); one run has none."""
    results = _alternating_repeats(unfused_repeat_step_3=3.2)
    comparison = compare.compare(results, "unfused", warmup=1)
    fused, unfused = comparison["variants"]["fused"], comparison["variants"]["unfused"]
    assert fused["max_abs_dloss_repeats"] == pytest.approx(0.3)  # repeat 2 at step 4
    assert unfused["max_abs_dloss_repeats"] == 0.0
    ratios = comparison["ratios"]
    assert ratios["fused vs unfused max |dloss|"] == pytest.approx(0.5)
    assert ratios["fused repeats max |dloss|"] == pytest.approx(0.3)
    assert ratios["unfused repeats max |dloss|"] == 0.0
    assert "| 3.00e-01 |" in compare.table(comparison)

    alone = compare.compare(results[:2], "unfused", warmup=1)
    assert alone["variants"]["fused"]["max_abs_dloss_repeats"] is None
    assert alone["ratios"]["fused repeats max |dloss|"] is None


def test_loss_gaps_over_every_pair_of_runs():
    """Beside the first runs' one draw, the gap between variants over every (fused run, unfused run) pair and the
    noise over every pair of a variant's repeats, each as median, max and count; one run has no pair."""
    results = _alternating_repeats(unfused_repeat_step_3=3.25)
    comparison = compare.compare(results, "unfused", warmup=1)
    ratios, rows = comparison["ratios"], comparison["variants"]
    assert ratios["fused vs unfused max |dloss|"] == pytest.approx(0.5)  # the first runs alone
    # fused runs 1 and 3 differ from each unfused run by 0.5 at step 4, fused run 2 by 0.8
    cross = ratios["fused vs unfused |dloss|, every pair"]
    assert cross == {"median": pytest.approx(0.5), "max": pytest.approx(0.8), "pairs": 6}
    assert rows["fused"]["dloss_vs_baseline_pairs"] == cross
    assert rows["unfused"]["dloss_vs_baseline_pairs"] is None
    # fused 1-2: 0.3 (step 4), 1-3: 0.05 (step 2), 2-3: 0.3 (step 4)
    fused_noise = ratios["fused repeats |dloss|, every pair"]
    assert fused_noise == {"median": pytest.approx(0.3), "max": pytest.approx(0.3), "pairs": 3}
    assert rows["unfused"]["dloss_repeat_pairs"] == {
        "median": pytest.approx(0.05),
        "max": pytest.approx(0.05),
        "pairs": 1,
    }
    assert "- fused vs unfused |dloss|, every pair: median 0.5, max 0.8 (6 pairs)" in compare.ratio_lines(ratios)
    assert rows["fused"]["runs"][1]["losses"] == [[1, 5.0], [2, 4.0], [3, 3.1], [4, 1.7]]

    alone = compare.compare(results[:2], "unfused", warmup=1)
    assert alone["ratios"]["fused repeats |dloss|, every pair"] is None
    assert alone["ratios"]["fused vs unfused |dloss|, every pair"]["pairs"] == 1


def _scores(exact_match: float, color: float, count: float | None = None) -> dict:
    """A run's last held-out evaluation as last_heldout returns it (per kind: color, and count when given)."""
    scores = {"step": 3, "exact_match": exact_match, "anls": exact_match, "exact_match/color": color}
    return scores if count is None else {**scores, "exact_match/count": count}


def test_heldout_scores_sit_beside_throughput_with_the_gap_and_the_repeats_spread():
    """With held-out scores, each row has exact match overall and per kind as the median over its repeats with
    min-max; ratios name the fused vs unfused and packed vs padded gaps (a - b of the medians, the range the repeats
    allow, each side's spread and whether the gap is within it); the table gains a held-out column. Without
    scores, rows say null and neither the ratios nor the table change."""
    losses, efficiency, padded_eff = [5.0, 4.0, 3.0], [0.9, 0.8, 0.9], [0.5, 0.4, 0.5]
    results = [
        _result("fused", losses, efficiency, 120.0, repeat=1, heldout=_scores(0.50, 0.25, 1.0)),
        _result("unfused", losses, efficiency, 100.0, repeat=1, heldout=_scores(0.50, 0.25, 1.0)),
        _result("padded", losses, padded_eff, 60.0, repeat=1, heldout=_scores(0.25, 0.0)),
        _result("fused", losses, efficiency, 121.0, repeat=2, heldout=_scores(0.75, 0.5, 1.0)),
        _result("unfused", losses, efficiency, 101.0, repeat=2, heldout=_scores(0.625, 0.5, 0.75)),
        _result("padded", losses, padded_eff, 61.0, repeat=2, heldout=_scores(0.25, 0.0)),
        _result("fused", losses, efficiency, 119.0, repeat=3, heldout=_scores(0.625, 0.5, 1.0)),
    ]
    comparison = compare.compare(results, "unfused", warmup=1)
    fused = comparison["variants"]["fused"]["heldout"]
    assert fused["step"] == 3 and fused["runs"] == 3
    assert fused["exact_match"] == {"median": 0.625, "min": 0.5, "max": 0.75}
    assert fused["exact_match/color"] == {"median": 0.5, "min": 0.25, "max": 0.5}
    assert "exact_match/count" not in comparison["variants"]["padded"]["heldout"]
    assert [run["heldout"]["exact_match"] for run in comparison["variants"]["fused"]["runs"]] == [0.5, 0.75, 0.625]

    gap = comparison["ratios"]["fused vs unfused held-out exact match"]
    assert gap["gap"] == pytest.approx(0.625 - 0.5625)
    assert (gap["min"], gap["max"]) == pytest.approx((0.5 - 0.625, 0.75 - 0.5))
    assert (gap["spread_a"], gap["spread_b"]) == pytest.approx((0.25, 0.125))
    assert gap["within_repeat_spread"] is True
    assert gap["by_kind"] == pytest.approx({"color": 0.5 - 0.375, "count": 1.0 - 0.875})
    packed = comparison["ratios"]["packed vs padded held-out exact match"]
    assert packed["gap"] == pytest.approx(0.375) and packed["spread_b"] == 0.0
    assert packed["within_repeat_spread"] is False and packed["by_kind"] == pytest.approx({"color": 0.5})
    table = compare.table(comparison)
    assert "held-out exact match" in table.splitlines()[0]
    assert "| 0.625 (0.500–0.750) at step 3 |" in table
    assert "fused vs unfused held-out exact match: gap +0.062" in compare.ratio_lines(comparison["ratios"])

    for result in results:
        result.heldout = None
    plain = compare.compare(results, "unfused", warmup=1)
    assert all(row["heldout"] is None for row in plain["variants"].values())
    assert not any("held-out" in name for name in plain["ratios"])
    assert "held-out" not in compare.table(plain)


def test_last_heldout_reads_the_last_evaluation_of_a_run():
    """A run's held-out scores are its last gen_* record in metrics.jsonl, the prefix dropped and the generation's
    seconds left out; a run without one has none. --heldout-samples N asks train.py for one evaluation of N records
    at the last step, and nothing when 0."""
    metrics = [
        {"step": 1, "loss": 2.0},
        {"step": 2, "gen_exact_match": 0.1, "gen_s": 3.0},
        {"step": 4, "loss": 1.0},
        {"step": 4, "gen_exact_match": 0.5, "gen_anls": 0.6, "gen_exact_match/color": 1.0, "gen_s": 2.0},
    ]
    assert compare.last_heldout(metrics) == {"step": 4, "exact_match": 0.5, "anls": 0.6, "exact_match/color": 1.0}
    assert compare.last_heldout(metrics[:1]) is None
    assert compare.heldout_overrides(8, 14) == ["train.generate_every=14", "train.generate_samples=8"]
    assert compare.heldout_overrides(0, 14) == []


def test_heldout_samples_without_a_held_out_split_are_refused_before_any_run(monkeypatch):
    """--heldout-samples on a recipe without a held-out split (data.eval_fraction=0), a negative count, or with an
    override of the held-out keys it sets itself is refused with a clear error before any run starts."""

    def no_run(*args):
        raise AssertionError("a run started")

    monkeypatch.setattr(compare, "run_variant", no_run)
    argv = ["--config", TINY, "--steps", "3", "--warmup", "1"]
    with pytest.raises(ConfigError, match="eval_fraction"):
        compare.main([*argv, "--heldout-samples", "4", "data.eval_fraction=0"])
    with pytest.raises(ConfigError, match="--heldout-samples -1"):
        compare.main([*argv, "--heldout-samples", "-1"])
    with pytest.raises(ConfigError, match=r"train\.generate_every"):
        compare.main([*argv, "--heldout-samples", "4", "train.generate_every=1"])


def test_variant_selection_refuses_bad_requests():
    """Unknown or repeated variants are errors; Liger is left out, with the reason, where it cannot apply; one
    runnable variant is measured alone (its repeats' spread), none is an error."""
    with pytest.raises(ConfigError, match="unknown"):
        compare.select_variants("fused,fast", "qwen2_5_vl", None)
    with pytest.raises(ConfigError, match="twice"):
        compare.select_variants("fused,fused", "qwen2_5_vl", None)
    kept, left_out = compare.select_variants("fused,unfused,liger", "qwen3_vl", None)
    assert kept == ["fused", "unfused"] and "qwen3_vl" in left_out["liger"]
    kept, left_out = compare.select_variants("fused,liger", "qwen3_5", None)
    assert kept == ["fused"] and "qwen3_5" in left_out["liger"]
    with pytest.raises(ConfigError, match="no variant left"):
        compare.select_variants("liger", "qwen3_5", None)


def test_bf16_weights_variant_differs_from_fused_only_in_where_the_masters_live():
    """bf16-weights is the fused variant with train.master_weights=optimizer, bf16-compiled the compiled one (every
    other variant but the shipped pair, which leave the recipe's auto, sets module, and a user override of the key is
    refused); both are left out under --launcher (one process only); a tokens/s ratio and loss gap are named
    against fused."""
    bf16, fused = compare.VARIANT_OVERRIDES["bf16-weights"], compare.VARIANT_OVERRIDES["fused"]
    assert {k: v for k, v in bf16.items() if fused[k] != v} == {"train.master_weights": "optimizer"}
    variants = {n: v for n, v in compare.VARIANT_OVERRIDES.items() if not n.startswith("shipped")}
    on_bf16 = {n for n, v in variants.items() if v["train.master_weights"] == "optimizer"}
    assert on_bf16 == {"bf16-weights", "bf16-compiled"}
    assert {v["train.master_weights"] for n, v in variants.items() if n not in on_bf16} == {"module"}
    assert compare.VARIANT_OVERRIDES["shipped"] == {}
    assert "train.master_weights" in compare.RESERVED_KEYS
    kept, left_out = compare.select_variants("fused,bf16-weights,unfused,bf16-compiled", "qwen2_5_vl", "accelerate")
    assert kept == ["fused", "unfused"] and left_out.keys() == on_bf16
    assert all("DDP refuses it" in reason for reason in left_out.values())
    both = compare.VARIANT_OVERRIDES["bf16-compiled"]
    assert both == {**compare.VARIANT_OVERRIDES["compiled"], "train.master_weights": "optimizer"}
    assert both["train.compile"] == "true" and both["kernels.patch_embed"] == "matmul"
    assert {"train.compile", "kernels.patch_embed"} <= compare.RESERVED_KEYS
    results = [
        _result("fused", [5.0, 4.0, 3.0], [0.9, 0.8, 0.9], 100.0),
        _result("bf16-weights", [5.0, 4.05, 3.0], [0.9, 0.8, 0.9], 125.0),
    ]
    ratios = compare.compare(results, "fused", warmup=1)["ratios"]
    assert ratios["bf16-weights/fused tokens/s"]["median"] == pytest.approx(1.25)
    assert ratios["bf16-weights vs fused max |dloss|"] == pytest.approx(0.05)


def test_eager_variants_pin_what_the_shipped_defaults_change():
    """Every variant but the compiled ones and shipped runs eager with the Conv3d patch embedding whatever the
    defaults resolve to; eager-fp32 is that eager fp32-module path with two loader workers, the baseline of
    scripts/bench_recipes.py."""
    compiled = {"compiled", "bf16-compiled", "shipped", "shipped-unfused", "shipped-full-checkpointing"}
    for name, overrides in compare.VARIANT_OVERRIDES.items():
        if name not in compiled:
            assert overrides["train.compile"] == "false" and overrides["kernels.patch_embed"] == "conv", name
    assert compare.VARIANT_OVERRIDES["eager-fp32"] == {
        "train.compile": "false",
        "kernels.patch_embed": "conv",
        "train.master_weights": "module",
        "data.num_workers": "2",
    }
    kept, left_out = compare.select_variants("shipped,eager-fp32", "qwen3_5", "accelerate launch")
    assert kept == ["shipped", "eager-fp32"] and left_out == {}


def test_overrides_of_the_compared_keys_are_refused():
    """A user override of a key the comparison sets itself (here the rope choice) is refused before any run."""
    with pytest.raises(ConfigError, match=r"kernels\.mrope"):
        compare.main(["--config", TINY, "kernels.mrope=fused"])


def test_last_logged_step_reads_the_run_in_progress(tmp_path):
    """The sampler tags samples with the newest step in metrics.jsonl, ignores a half-written last line and reads
    nothing before the file exists."""
    path = tmp_path / "metrics.jsonl"
    assert compare.last_logged_step(path) is None
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "eval_loss": 1.0}\n{"step": 3, "lo')
    assert compare.last_logged_step(path) == 2


def test_the_command_line_exits_with_one_line(monkeypatch):
    """scripts/compare_throughput.py exits 0 when every run finished, else with one line: the error (a recipe or a
    run that cannot start) or how many runs failed."""
    outcomes = iter([{"failed": []}, {"failed": [{"variant": "fused"}, {"variant": "unfused"}]}])

    def fake_main(argv):
        outcome = next(outcomes, None)
        if outcome is None:
            raise ConfigError("unknown key 'train.lrr'")
        return outcome

    monkeypatch.setattr(compare, "main", fake_main)
    assert compare.command_line([]) == 0
    assert compare.command_line([]) == "[compare] 2 run(s) failed; comparison.json lists them under 'failed'"
    assert compare.command_line([]) == "[compare] error: unknown key 'train.lrr'"
