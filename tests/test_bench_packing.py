"""scripts/bench_packing.py on tiny dims: it trains through train.py's module and counts tokens honestly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_packing_runs_the_training_module_on_tiny_dims(tmp_path):
    """Every variant of both datasets runs; packs compute only real tokens (no padding), padded batches compute more
    than they count, and every variant counts the same real tokens of its dataset it got through."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "scripts.bench_packing", "--tiny", "--num-samples", "16", "--max-tokens", "1024"]
    command += ["--padded-batch-size", "4", "--warmup", "1", "--max-seconds", "60", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["dataset"], r["variant"]) for r in results} == {
        (d, v) for d in ("builtin", "long-tailed") for v in ("packed-varlen", "padded-sdpa", "packed-sdpa-mask")
    }
    for r in results:
        assert r["tokens_per_s"] > 0 and r["steps"] > 0
        if r["variant"].startswith("packed"):
            assert r["computed_tokens"] == r["real_tokens"]
        else:
            assert r["computed_tokens"] > r["real_tokens"]
