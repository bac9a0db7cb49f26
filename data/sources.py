"""Where records come from: `data.path` → a `datasets` Dataset (or IterableDataset when streaming) + image root.

- "builtin": the generated dataset (data/synthetic.py), written once under the cache dir, then read as JSONL.
- .json / .jsonl files: read as one JSON string per record, so records with different shapes (an `image` that is a
  string in one record and a list in the next) never break arrow's schema inference.
- .parquet / .arrow / .csv files and plain directories: `datasets.load_dataset`; `save_to_disk` directories:
  `load_from_disk`; anything else: a hub id (`load_dataset(id, split="train")`, needs network).
Image and video columns are read undecoded ({"path","bytes"}) so bad bytes become a counted skip, not a crash in
arrow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from datasets import Dataset, Image, IterableDataset, List, Video, load_dataset, load_from_disk

from data.config import DataConfig
from data.processing import RECORD_JSON_COLUMN
from data.synthetic import write_builtin_dataset

FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def _json_records(path: str, size: int, mtime_ns: int):
    """One {RECORD_JSON_COLUMN: str} per record of a JSON list or a JSONL file (size/mtime key the cache)."""
    with open(path) as handle:
        head = handle.read(1024).lstrip()
        handle.seek(0)
        if head.startswith("["):
            for record in json.load(handle):
                yield {RECORD_JSON_COLUMN: json.dumps(record)}
            return
        for line in handle:
            if line.strip():
                yield {RECORD_JSON_COLUMN: line}


def _undecoded_images(dataset: Dataset | IterableDataset) -> Dataset | IterableDataset:
    """Image and video columns as {"path","bytes"} references: data/ decodes them (videos with its own sampling)."""
    features = dataset.features or {}
    for name, feature in features.items():
        for kind in (Image, Video):
            if isinstance(feature, kind):
                dataset = dataset.cast_column(name, kind(decode=False))
            elif isinstance(feature, List) and isinstance(feature.feature, kind):
                dataset = dataset.cast_column(name, List(kind(decode=False)))
    return dataset


def builtin_path(data_cfg: DataConfig, cache_root: str) -> Path:
    name = f"builtin-{data_cfg.seed}-{data_cfg.num_samples}-video{data_cfg.video_share:g}"
    return Path(cache_root) / name / "data.jsonl"


def open_records(data_cfg: DataConfig, cache_root: str) -> tuple[Dataset | IterableDataset, str | None]:
    """(records, image_root): the raw records of `data.path` and where relative image paths resolve."""
    path = data_cfg.path
    if path == "builtin":
        directory = builtin_path(data_cfg, cache_root).parent
        path = str(write_builtin_dataset(directory, data_cfg.num_samples, data_cfg.seed, data_cfg.video_share))
    streaming = data_cfg.streaming
    local = os.path.exists(path)
    image_root = data_cfg.image_root or (os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else None)
    if local and os.path.isdir(path):
        image_root = data_cfg.image_root or os.path.abspath(path)
    suffix = Path(path).suffix.lower()
    if local and os.path.isfile(path) and suffix in (".json", ".jsonl"):
        with open(path) as handle:
            head = handle.read(1024).strip()
        if head in ("", "[]"):
            raise ValueError(f"data.path {path} holds no records: point it at a JSON list or JSONL file of samples.")
        stat = os.stat(path)
        kwargs = {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if streaming:
            dataset = IterableDataset.from_generator(_json_records, gen_kwargs=kwargs)
        else:
            dataset = Dataset.from_generator(_json_records, gen_kwargs=kwargs, cache_dir=data_cfg.cache_dir)
    elif local and os.path.isfile(path):
        if suffix not in FILE_BUILDERS:
            raise ValueError(f"data.path {path}: unsupported file type {suffix!r}; use json(l), parquet, arrow, csv.")
        dataset = load_dataset(
            FILE_BUILDERS[suffix], data_files=path, split="train", streaming=streaming, cache_dir=data_cfg.cache_dir
        )
    elif local and (Path(path, "state.json").exists() or Path(path, "dataset_dict.json").exists()):
        dataset = load_from_disk(path)
        if not isinstance(dataset, Dataset):
            dataset = dataset["train"]
        dataset = dataset.to_iterable_dataset() if streaming else dataset
    else:
        dataset = load_dataset(path, split="train", streaming=streaming, cache_dir=data_cfg.cache_dir)
    return _undecoded_images(dataset), image_root
