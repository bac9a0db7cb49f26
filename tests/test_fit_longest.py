"""scripts/fit_longest.py: probe runs' points, the least-squares line and the predicted longest sample."""

from __future__ import annotations

import json

import pytest

from scripts import fit_longest
from training import run_files


def write_probe(run_dir, tokens: float, peak: float, processes: int) -> None:
    """A probe run's files as train.py writes them: two training records (the last one is read), a summary."""
    run_dir.mkdir(parents=True)
    step_time = 4.0
    for step, gib in ((1, peak - 10.0), (2, peak)):
        rate = tokens / step_time / processes
        record = {"step": step, "loss": 9.0, "tokens_per_s_per_gpu": rate, "step_time_s": step_time}
        run_files.append_metrics(run_dir, {**record, "peak_mem_gib": gib})
    (run_dir / run_files.SUMMARY_FILE).write_text(json.dumps({"num_processes": processes}))


def test_probe_points_fit_a_line_and_predict_where_it_fills_the_memory(tmp_path, capsys):
    """Points on peak = 22 + 0.0003 * tokens (two processes: tokens counted once) give that line back, residual 0,
    and the longest sample (137 - 22) / 0.0003; the JSON holds the same."""
    runs = []
    for tokens in (20_000, 60_000, 140_000):
        runs.append(tmp_path / f"probe-{tokens}")
        write_probe(runs[-1], tokens, 22.0 + 3e-4 * tokens, processes=2)
    assert fit_longest.probe_point(runs[0]) == pytest.approx((20_000, 28.0))
    out = tmp_path / "fit.json"
    fit_longest.main(["--memory-gib", "137", *map(str, runs), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["intercept_gib"] == pytest.approx(22.0)
    assert result["gib_per_token"] == pytest.approx(3e-4)
    assert result["largest_residual_gib"] == pytest.approx(0.0, abs=1e-9)
    assert result["longest_tokens"] == pytest.approx(115 / 3e-4)
    assert "383,333 tokens" in capsys.readouterr().out


def test_a_bent_line_shows_in_the_residual_and_bad_probes_are_refused(tmp_path):
    intercept, slope, residual = fit_longest.fit_line([(0, 10.0), (1, 12.0), (2, 13.0)])
    assert (intercept, slope) == pytest.approx((10.1666667, 1.5)) and residual == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="two or more different sample lengths"):
        fit_longest.fit_line([(5, 1.0), (5, 2.0)])
    with pytest.raises(ValueError, match="does not grow"):
        fit_longest.longest_tokens(10.0, 0.0, 137.0)
