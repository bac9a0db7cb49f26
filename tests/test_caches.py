"""Damaged caches (core/caches.py): each cache the data pipeline writes, cut short as a full disk or a killed copy
leaves it, is rebuilt on the next start with one warning line naming it, and the run gets the same samples."""

import json
import logging
from pathlib import Path

import pyarrow as pa
import pytest
from datasets import Dataset

from core.caches import manifest_problem, write_manifest
from core.config import load_config
from core.families import hf_config
from data.pipeline import build_data, load_processor
from data.synthetic import write_builtin_dataset

# Each kind of cache, as a glob under the cache root (the built-in data, its records and their caches live there).
DAMAGED = {
    "processed data": "records/*/generator/*/*/cache-*.arrow",  # the larger of the two map caches
    "image-file listing": "records/*/generator/*/*/cache-*.arrow",  # the smaller
    "records": "records/*/generator/*/*/generator-train.arrow",
    "records info": "records/*/generator/*/*/dataset_info.json",
    "built-in dataset file": "builtin-*/data.jsonl",
    "built-in dataset image": "builtin-*/images/000003_0.png",
    "tiny processor tokenizer": "tiny-processor-*/tokenizer.json",
    "tiny processor config": "tiny-processor-*/processor_config.json",
}


def build(cache: Path, *overrides: str):
    cfg = load_config(
        "recipes/tiny-qwen2_5_vl.yaml",
        [f"data.cache_dir={cache}", "data.num_samples=16", "data.num_workers=0", "data.eval_fraction=0", *overrides],
    )
    train, _, stats = build_data(cfg.data, cfg.packing, load_processor(cfg.model, cfg.data), hf_config(cfg.model))
    keys = [item.key for step in train.steps(0) for pack in step for item in pack.items]
    return stats.summary(), sorted((row["sample_id"], tuple(row["input_ids"])) for row in train.fetch(keys))


def replace(path: Path, content: bytes) -> None:
    """`path` now holds `content`, as a new file: the old one may still be memory-mapped by this process."""
    staging = path.with_name(path.name + ".new")
    staging.write_bytes(content)
    staging.replace(path)


def target(cache: Path, kind: str) -> Path:
    files = sorted(cache.glob(DAMAGED[kind]), key=lambda path: path.stat().st_size)
    assert files, kind
    return files[0] if kind == "image-file listing" else files[-1]


@pytest.mark.parametrize("kind", list(DAMAGED))
def test_a_cache_cut_short_is_rebuilt_with_one_line_naming_it(tmp_path, caplog, kind):
    """Truncated to half its size, every kind of cache (processed samples, the image-file listing, the records'
    arrow file and their dataset_info.json, the built-in dataset's records and images, the tiny processor's files)
    is rebuilt: the next build gives the same samples as the first, and one warning line names the damaged file
    (or the directory it is in)."""
    cache = tmp_path / "cache"
    expected = build(cache)
    damaged = target(cache, kind)
    replace(damaged, damaged.read_bytes()[: damaged.stat().st_size // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        assert build(cache) == expected
    lines = [r.getMessage() for r in caplog.records if "does not read back" in r.getMessage()]
    assert len(lines) == 1 and any(str(parent) in lines[0] for parent in (damaged, *damaged.parents[:4])), lines
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        caplog.clear()
        assert build(cache) == expected
    assert not [r for r in caplog.records if "does not read back" in r.getMessage()]  # rebuilt once, then reused


def test_a_processed_cache_that_reads_back_short_is_rebuilt(tmp_path, caplog):
    """A processed-data cache that is valid arrow but holds fewer rows than the records (cut at a record-batch
    boundary) is not trusted: it is computed again, said in one line."""
    cache = tmp_path / "cache"
    expected = build(cache)
    damaged = target(cache, "processed data")
    with pa.memory_map(str(damaged)) as source:
        table = pa.ipc.open_stream(source).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.slice(0, len(table) // 2))
    replace(damaged, sink.getvalue().to_pybytes())
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        assert build(cache) == expected
    lines = [r.getMessage() for r in caplog.records if "does not read back" in r.getMessage()]
    assert len(lines) == 1 and str(damaged) in lines[0] and "8 rows for 16 records" in lines[0]


def test_a_manifest_names_the_first_file_that_differs(tmp_path):
    """A directory matches its manifest until a file is cut, changed in place (same size), removed or added."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.txt").write_text("beta")
    write_manifest(tmp_path)
    assert manifest_problem(tmp_path) is None
    (tmp_path / "a.txt").write_text("alphx")
    assert manifest_problem(tmp_path) == "a.txt does not match its checksum"
    (tmp_path / "a.txt").write_text("al")
    assert manifest_problem(tmp_path) == "a.txt has 2 bytes, not 5"
    (tmp_path / "a.txt").unlink()
    assert manifest_problem(tmp_path) == "a.txt is missing"
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "c.txt").write_text("new")
    assert manifest_problem(tmp_path) == "c.txt is not in MANIFEST.json"
    assert manifest_problem(tmp_path / "sub") == "no MANIFEST.json"


def test_a_parquet_files_arrow_conversion_cut_short_is_converted_again(tmp_path, caplog):
    """A parquet data file's arrow conversion (datasets' builder cache), truncated, is converted again with one
    warning line naming its directory; the samples are those of the first build."""
    records = [json.loads(line) for line in write_builtin_dataset(tmp_path / "src", 12, seed=4, video_share=0.0).open()]
    for record in records:
        images = [record["image"]] if isinstance(record.get("image"), str) else record.get("image", [])
        record["images"] = [str(tmp_path / "src" / path) for path in images]
        record.pop("image", None)
        record.pop("category", None)
    Dataset.from_list(records).to_parquet(str(tmp_path / "data.parquet"))
    cache = tmp_path / "cache"
    expected = build(cache, f"data.path={tmp_path / 'data.parquet'}")
    damaged = max(cache.glob("records/*/parquet/*/*/*/parquet-train.arrow"), key=lambda path: path.stat().st_size)
    replace(damaged, damaged.read_bytes()[: damaged.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        assert build(cache, f"data.path={tmp_path / 'data.parquet'}") == expected
    lines = [r.getMessage() for r in caplog.records if "does not read back" in r.getMessage()]
    assert len(lines) == 1 and "the records cache" in lines[0] and str(cache / "records") in lines[0]
