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

import functools
import hashlib
import json
import os
from pathlib import Path

from datasets import Dataset, Image, IterableDataset, List, Video, load_dataset, load_from_disk

from core.caches import built_dataset
from core.config_tree import ConfigError
from core.data_config import DataConfig
from data.formats import DataError
from data.processing import RECORD_JSON_COLUMN, RECORD_JSON_FEATURES, RECORD_LOCATION_COLUMN
from data.synthetic import write_builtin_dataset

FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


UTF8_BOM = b"\xef\xbb\xbf"
BUILTIN_VERSION = 3  # part of the built-in dataset's directory name: bump when its records change


def _head(path: str) -> bytes:
    """The file's first KiB without a UTF-8 BOM and surrounding whitespace (bytes: it may not decode)."""
    with open(path, "rb") as handle:
        return handle.read(1024).removeprefix(UTF8_BOM).strip()


def _json_list(path: str) -> list:
    """The records of a JSON list file; ValueError with one line saying what is wrong (a list is all or nothing:
    unlike JSONL, one bad byte leaves no record boundary to recover at)."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            records = json.load(handle)
    except UnicodeDecodeError as error:
        raise DataError(
            f"data.path {path}: byte {error.start} is not valid UTF-8 (or use JSONL, one record a line, "
            "where a bad line is skipped)"
        ) from None
    except (json.JSONDecodeError, RecursionError) as error:
        raise DataError(f"data.path {path} is not valid JSON: {error}") from None
    if not isinstance(records, list):
        raise DataError(f"data.path {path}: a .json file must hold a list of records, got {type(records).__name__}")
    return records


def _json_records(path: str, content_digest: str):
    """One {RECORD_JSON_COLUMN: str or None, RECORD_LOCATION_COLUMN: str} per record of a JSON list or a JSONL file.

    A JSONL line that is not UTF-8 comes through as None (a counted skip), not as an error for the whole file.
    `content_digest` is unused here: as a generator argument it keys the cache on the file's contents.
    """
    if _head(path).startswith(b"["):
        for index, record in enumerate(_json_list(path)):
            yield {RECORD_JSON_COLUMN: json.dumps(record), RECORD_LOCATION_COLUMN: f"item {index + 1}"}
        return
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if number == 1:
                line = line.removeprefix(UTF8_BOM)
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            yield {RECORD_JSON_COLUMN: text, RECORD_LOCATION_COLUMN: f"line {number}"}


def file_digest(path: str) -> str:
    """A content hash of a file: strong where size and mtime are not (a rewrite within the same second), and
    cheap next to processing the records."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "blake2b").hexdigest()[:32]


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


def _looks_local(path: str) -> bool:
    """A path that can only mean a local file: absolute, explicitly relative, home-based, or with a data-file suffix.
    Anything else may be a Hub id, which only the Hub can answer (slowly, without a network)."""
    explicit = path.startswith(("/", "./", "../", "~")) or os.path.isabs(path)
    return explicit or Path(path).suffix.lower() in (".json", ".jsonl", *FILE_BUILDERS)


def builtin_path(data_cfg: DataConfig, cache_root: str) -> Path:
    name = f"builtin-v{BUILTIN_VERSION}-{data_cfg.seed}-{data_cfg.num_samples}-video{data_cfg.video_share:g}"
    if data_cfg.builtin_kinds:
        name += "-" + "+".join(data_cfg.builtin_kinds)
    return Path(cache_root) / name / "data.jsonl"


def records_dir(cache_root: str, path: str) -> str:
    """Where a data file's records are converted to arrow (and its listing and processed samples cached next to
    them): a directory of its own under the cache root, so a damaged conversion is removed whole
    (core/caches.py's `built_dataset`)."""
    return os.path.join(cache_root, "records", hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16])


def open_records(data_cfg: DataConfig, cache_root: str) -> tuple[Dataset | IterableDataset, str | None]:
    """(records, image_root): the raw records of `data.path` and where relative image paths resolve."""
    path = os.path.expanduser(data_cfg.path or "builtin")
    if path == "builtin":
        directory = builtin_path(data_cfg, cache_root).parent
        path = str(
            write_builtin_dataset(
                directory, data_cfg.num_samples, data_cfg.seed, data_cfg.video_share, data_cfg.builtin_kinds
            )
        )
    streaming = data_cfg.streaming
    local = os.path.exists(path)
    if not local and _looks_local(path):
        raise ConfigError(f"data.path {path} does not exist (from {os.getcwd()}); a Hub dataset id is 'owner/name'.")
    image_root = data_cfg.image_root or (os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else None)
    if local and os.path.isdir(path):
        image_root = data_cfg.image_root or os.path.abspath(path)
    suffix = Path(path).suffix.lower()
    if local and os.path.isfile(path) and suffix in (".json", ".jsonl"):
        if _head(path) in (b"", b"[]"):
            raise DataError(f"data.path {path} holds no records: point it at a JSON list or JSONL file of samples.")
        if _head(path).startswith(b"["):
            _json_list(path)  # a broken list fails here with its one-line reason, not inside datasets' builder
        kwargs = {"path": os.path.abspath(path), "content_digest": file_digest(path)}
        if streaming:
            dataset = IterableDataset.from_generator(_json_records, gen_kwargs=kwargs, features=RECORD_JSON_FEATURES)
        else:
            directory = records_dir(cache_root, path)
            build = functools.partial(
                Dataset.from_generator,
                _json_records,
                gen_kwargs=kwargs,
                features=RECORD_JSON_FEATURES,
                cache_dir=directory,
            )
            dataset = built_dataset(build, directory, "records")
    elif local and os.path.isfile(path):
        if suffix not in FILE_BUILDERS:
            raise DataError(f"data.path {path}: unsupported file type {suffix!r}; use json(l), parquet, arrow, csv.")
        if streaming:
            dataset = load_dataset(FILE_BUILDERS[suffix], data_files=path, split="train", streaming=True)
        else:
            directory = records_dir(cache_root, path)
            build = functools.partial(
                load_dataset, FILE_BUILDERS[suffix], data_files=path, split="train", cache_dir=directory
            )
            dataset = built_dataset(build, directory, "records")
    elif local and (Path(path, "state.json").exists() or Path(path, "dataset_dict.json").exists()):
        dataset = load_from_disk(path)
        if not isinstance(dataset, Dataset):
            dataset = dataset["train"]
        dataset = dataset.to_iterable_dataset() if streaming else dataset
    else:
        dataset = load_dataset(path, split="train", streaming=streaming, cache_dir=data_cfg.cache_dir)
    return _undecoded_images(dataset), image_root
