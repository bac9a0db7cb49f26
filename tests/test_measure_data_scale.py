"""verification/data_scale.py (scripts/measure_data_scale.py): its memory sampling, and the repeated records whose
cache it prebuilds."""

from __future__ import annotations

import sys
from pathlib import Path

from core.config import load_config
from core.families import hf_config
from data import pipeline, processing
from verification.bench_data import write_llava_records
from verification.data_scale import (
    MIXTURE_WEIGHTS,
    RECIPE,
    data_overrides,
    prebuild,
    repeated_records,
    run_measured,
)
from verification.plan_totals import epoch_totals


def test_peak_memory_of_a_command_is_sampled(tmp_path):
    """run_measured records at least the memory a command holds for a while (here 300 MiB for 1.5 s), and the CPU
    time it spends (here a 0.5 s busy loop) apart from the time it sleeps."""
    hold = (
        "import time; block = bytearray(300 * 2**20); block[::4096] = b'x' * len(block[::4096]); "
        "end = time.process_time() + 0.5\nwhile time.process_time() < end: pass\ntime.sleep(1.5)"
    )
    measured = run_measured([sys.executable, "-c", hold], tmp_path / "log")
    assert measured["peak_rss_gib"] >= 0.29 and measured["peak_tree_pss_gib"] >= 0.29 and measured["wall_s"] >= 1.5
    assert 0.5 <= measured["cpu_s"] < measured["wall_s"]


def test_a_prebuilt_cache_of_repeated_records_is_the_one_a_full_build_writes(tmp_path, monkeypatch):
    """--repeat: the repeated JSONL is the source's lines over and over up to the count, and the cache that
    prebuild writes (each distinct record processed once) is found by build_data, which then processes nothing and
    plans exactly the samples that processing every record gives."""
    source = write_llava_records(tmp_path / "source", 12, images=4).parent
    repeated_records(30, source, tmp_path / "repeated")
    lines = (source / "data.jsonl").read_text().splitlines()
    assert (tmp_path / "repeated" / "data.jsonl").read_text().splitlines() == (lines * 3)[:30]
    path = f"data.path={tmp_path / 'repeated' / 'data.jsonl'}"
    monkeypatch.setattr(pipeline, "SampleProcessor", pipeline.SampleProcessor)  # prebuild swaps it; restored after
    prebuild([path, f"data.cache_dir={tmp_path / 'prebuilt'}"])
    monkeypatch.setattr(pipeline, "SampleProcessor", processing.SampleProcessor)
    processed = []
    original = processing.SampleProcessor.process
    monkeypatch.setattr(
        processing.SampleProcessor, "process", lambda self, *a: processed.append(1) or original(self, *a)
    )
    plans = {}
    for cache in ("prebuilt", "full"):
        processed.clear()
        cfg = load_config(RECIPE, [path, f"data.cache_dir={tmp_path / cache}", "data.num_workers=0"])
        train, _, stats = pipeline.build_data(
            cfg.data, cfg.packing, pipeline.load_processor(cfg.model, cfg.data), hf_config(cfg.model)
        )
        plans[cache] = (len(processed), stats.summary(), epoch_totals(train))
    assert plans["prebuilt"][0] == 0 and plans["full"][0] == 30
    assert plans["prebuilt"][1:] == plans["full"][1:]


def test_a_mixture_splits_the_records_over_its_sources(tmp_path):
    """--sources 3: the records split evenly over three sources of their own seeds, each source over --repeat its
    own records repeated, named in data.sources with the mixture's weights; the overrides load as a recipe."""
    overrides = data_overrides(10, tmp_path, repeat=2, sources=3)
    cfg = load_config(RECIPE, overrides)
    paths = [source.path for source in cfg.data.sources]
    assert cfg.data.path is None and [s.weight for s in cfg.data.sources] == list(MIXTURE_WEIGHTS[:3])
    lines = [Path(path).read_text().splitlines() for path in paths]
    assert [len(source) for source in lines] == [4, 3, 3]
    assert all(source[2:] == source[: len(source) - 2] for source in lines)  # two records, repeated
    assert len({source[0] for source in lines}) == 3  # the sources differ
