"""verification/bench_data.py's long samples (scripts/make_long_samples.py): the data pipeline keeps them, one per
pack at the documented budget."""

from __future__ import annotations

import itertools

import pytest

from core.config import load_config
from data.pipeline import build_data, load_processor
from modeling.build import build_model
from verification.bench_data import write_long_samples


def test_long_samples_are_kept_one_per_pack_and_reproducible(tmp_path):
    words = 300
    path = write_long_samples(tmp_path / "a", words, count=3, seed=1)
    assert write_long_samples(tmp_path / "b", words, count=3, seed=1).read_text() == path.read_text()
    budget = 2 * words + 512
    overrides = [f"data.path={path}", "data.eval_fraction=0", f"packing.max_tokens={budget}", "data.num_workers=0"]
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", overrides)
    processor = load_processor(cfg.model, cfg.data)
    model_config = build_model(cfg.model, seed=0).config
    train, _, stats = build_data(cfg.data, cfg.packing, processor, model_config)
    assert (stats.kept_train, sum(stats.skipped.values())) == (3, 0)
    for batch in itertools.islice(train, 3):  # the train loader is endless
        (length,) = batch["sample_lengths"]
        assert words < length <= budget and batch["image_grid_thw"].shape[0] == 1


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--words"):
        write_long_samples(tmp_path, words=1, count=3)
