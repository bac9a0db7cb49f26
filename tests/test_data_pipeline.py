"""The data pipeline end to end (data/pipeline.py): loaders, processing, bad inputs, collated batches, resume."""

import itertools
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from datasets import Dataset, Image, List
from torch.utils.data import get_worker_info

from core.config import load_config
from core.data_config import PackingConfig
from core.families import MODEL_TYPES, hf_config
from core.special_tokens import EOS_ID
from data.formats import DataError
from data.packing import Leftover, PackItem
from data.pipeline import STEP_VISION, StepLoader, build_data, load_processor
from data.processing import IGNORE_INDEX, PROCESSED_FEATURES, empty_row
from data.sources import builtin_path
from data.synthetic import write_builtin_dataset
from modeling import vision_plan
from modeling.build import build_model
from verification.packing_check import sample_position_ids, samples_from_batch


def recipe(name: str, cache, *overrides: str):
    return load_config(f"recipes/{name}.yaml", [f"data.cache_dir={cache}", "data.num_workers=0", *overrides])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def build(cfg, rank=0, world_size=1):
    model_config = hf_config(cfg.model)
    processor = load_processor(cfg.model, cfg.data)
    return (
        *build_data(cfg.data, cfg.packing, processor, model_config, rank, world_size, cfg.train.grad_accum_steps),
        processor,
        model_config,
    )


def epoch_rows(loader, epoch=0):
    """Processed rows of every sample the loader plans for an epoch, in plan order."""
    return [row for step in loader.steps(epoch) for pack in step for row in loader.fetch([i.key for i in pack.items])]


def sample_slices(batch):
    cu = batch["cu_seqlens"].tolist()
    return [slice(a, b) for a, b in itertools.pairwise(cu)]


def test_labels_never_cross_a_sample_boundary(cache):
    """shift_labels[t] is the label of token t+1 of the same sample, and -100 at each sample's last token;
    label_rows lists exactly the labelled positions, ascending; cu_seqlens is int32 starting at 0 and ending at T,
    max_seqlen a Python int; packs respect the budget."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=60", "packing.max_tokens=1024")
    train, _, _, _, _ = build(cfg)
    step_rows = [train.fetch([i.key for i in step[0].items]) for step in train.steps(0)]
    for rows, batch in zip(step_rows, train, strict=False):
        assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"][0] == 0
        assert batch["cu_seqlens"][-1] == batch["input_ids"].shape[1] <= 1024
        assert isinstance(batch["max_seqlen"], int)
        assert batch["max_seqlen"] == max(s.stop - s.start for s in sample_slices(batch))
        labelled = (batch["shift_labels"][0] != IGNORE_INDEX).nonzero().flatten()
        assert batch["label_rows"].dtype == torch.long and torch.equal(batch["label_rows"], labelled)
        assert len(labelled) == batch["num_label_tokens"] > 0
        for row, part in zip(rows, sample_slices(batch), strict=True):
            expected = [*row["labels"][1:], IGNORE_INDEX]
            assert batch["shift_labels"][0, part].tolist() == expected
            assert batch["seq_idx"][0, part].unique().numel() == 1
        if train.step_in_epoch >= 3:
            break


def test_labels_cover_exactly_the_assistant_replies(cache):
    """Trained tokens are the assistant replies with their closing <|im_end|>, nothing from system/user turns."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=30")
    train, _, _, processor, _ = build(cfg)
    records = {r["id"]: r for r in map(json.loads, builtin_path(cfg.data, str(cache)).open())}
    for row in epoch_rows(train):
        replies = [t["value"] for t in records[row["sample_id"]]["conversations"] if t["from"] == "gpt"]
        trained = [token for token in row["labels"] if token != IGNORE_INDEX]
        assert trained.count(EOS_ID) == len(replies)
        assert processor.tokenizer.decode(trained) == "".join(reply + "<|im_end|>" for reply in replies)


@pytest.mark.parametrize("family", MODEL_TYPES)
def test_positions_restart_and_equal_model_rope_index(cache, family):
    """Row 0 restarts at 0 in every sample; rows 1-3 equal the real model's get_rope_index on that sample alone
    for every family of the registry (chunked Qwen2/2.5-VL, interleaved Qwen3-VL/3.5 and their MoE variants), videos
    included (Qwen2.5-VL with second_per_grid_ts, Qwen3-VL/3.5 timestamped per temporal patch); pixel rows, grids and
    patch counts agree."""
    cfg = recipe(f"tiny-{family}", cache, "data.num_samples=40", "packing.max_tokens=1024", "data.video_share=0.5")
    train, _, _, _, model_config = build(cfg)
    model = build_model(cfg.model)
    batch = next(iter(train))
    assert batch["pixel_values"].shape[0] == batch["image_grid_thw"].prod(-1).sum()
    assert batch["pixel_values_videos"].shape[0] == batch["video_grid_thw"].prod(-1).sum()
    assert (
        batch["image_grid_thw"].prod(-1).sum() + batch["video_grid_thw"].prod(-1).sum() == batch["num_vision_patches"]
    )
    samples = samples_from_batch(batch, model_config.vision_config.spatial_merge_size)
    for part, sample in zip(sample_slices(batch), samples, strict=True):
        positions = batch["position_ids"][:, :, part]
        assert torch.equal(positions[0, 0], torch.arange(part.stop - part.start))
        assert torch.equal(positions, sample_position_ids(model, sample))
    assert any(s.video_grid_thw is not None and s.video_grid_thw[:, 0].max() > 1 for s in samples)


def test_every_kept_sample_once_per_epoch_and_resume(cache):
    """An epoch's plan holds every kept training sample exactly once; a loader restored from state_dict mid-epoch
    (and across the epoch boundary) yields exactly the batches the original would have yielded next."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=60", "packing.max_tokens=768")
    train, _, stats, _, _ = build(cfg)
    ids = [row["sample_id"] for row in epoch_rows(train)]
    assert len(ids) == len(set(ids)) == stats.kept_train
    steps_per_epoch = len(list(train.steps(0)))
    original = iter(train)
    for _ in range(steps_per_epoch - 2):
        next(original)
    state = train.state_dict()
    expected = [next(original)["input_ids"] for _ in range(4)]  # crosses into epoch 1
    resumed, _, _, _, _ = build(cfg)
    resumed.load_state_dict(state)
    got = [batch["input_ids"] for _, batch in zip(range(4), resumed, strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert ids != [row["sample_id"] for row in epoch_rows(train, epoch=1)]  # reshuffled per epoch


def test_ranks_split_each_step(cache):
    """With world_size 2, each rank yields its own pack of every step; together they cover every kept sample
    except the packs of a final step too small for both ranks."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=60", "packing.max_tokens=512")
    rank0, _, stats, _, _ = build(cfg, rank=0, world_size=2)
    rank1, _, _, _, _ = build(cfg, rank=1, world_size=2)
    steps = list(rank0.steps(0))
    per_rank = [[len(b["sample_lengths"]) for _, b in zip(steps, loader, strict=False)] for loader in (rank0, rank1)]
    assert per_rank == [[len(step[rank].items) for step in steps] for rank in (0, 1)]
    tail = stats.kept_train - sum(len(p.items) for step in steps for p in step)
    assert tail >= 0 and sum(map(sum, per_rank)) == stats.kept_train - tail
    assert rank0.state_dict() == rank1.state_dict()


def test_train_loader_steps_are_whole_optimizer_steps(cache):
    """build_data groups the train loader's micro-steps by train.grad_accum_steps (the eval loader's by 1): an
    epoch's plan is a whole number of optimizer steps, and its tokens plus the counted leftover's are all the
    epoch's packed tokens. 56 samples make 11 packs: one is left by the 2-rank dealing and 4 by the partial group
    of 2 micro-steps (the numbers are the test's data, checked so the leftover is not vacuous)."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=56", "packing.max_tokens=512", "train.grad_accum_steps=3")
    train, evaluation, _, _, _ = build(cfg, rank=1, world_size=2)
    assert (train.grad_accum_steps, evaluation.grad_accum_steps) == (3, 1)
    leftover = Leftover()
    steps = list(train.steps(0, leftover))
    packs = list(train.packs(0))
    assert len(packs) == 11 and len(steps) == 3 and all(len(step) == 2 for step in steps)
    assert leftover.packs == len(packs) - 2 * len(steps) == 5
    planned = sum(pack.tokens for step in steps for pack in step)
    assert planned + leftover.tokens == sum(pack.tokens for pack in packs)


def test_padded_mode_batches(cache):
    """Padded batches: padding has attention_mask 0 and label -100, real tokens match the samples, and label_rows
    indexes the labelled positions of the flattened (B·S) batch."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=40", "packing.mode=padded", "packing.padded_batch_size=4")
    train, _, _, _, _ = build(cfg)
    rows = train.fetch([i.key for i in next(iter(train.steps(0)))[0].items])
    batch = next(iter(train))
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (4, max(r["length"] for r in rows))
    assert batch["position_ids"].shape[:2] == (4, 4)
    assert batch["attention_mask"].sum(1).tolist() == [r["length"] for r in rows]
    assert (batch["shift_labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert torch.equal(batch["label_rows"], (batch["shift_labels"].flatten() != IGNORE_INDEX).nonzero().flatten())


def good_records(tmp_path, count=8):
    """LLaVA records from the generator (images, and frame-list videos), with absolute paths."""
    directory = tmp_path / "src"
    records = [json.loads(line) for line in write_builtin_dataset(directory, count, seed=5).open()]
    for record in records:
        if isinstance(record.get("image"), str):
            record["image"] = str(directory / record["image"])
        elif record.get("image"):
            record["image"] = [str(directory / p) for p in record["image"]]
        if record.get("video"):
            record["video"] = [str(directory / p) for p in record["video"]]
    assert any("video" in r for r in records)
    return records


def to_messages(record, image_as_bytes=False):
    """The same conversation in role/content form, images as content items (or bytes in an `images` column),
    the video (a frame list) as an inline {"type": "video", "video": frames} item."""
    messages = []
    for turn in record["conversations"]:
        items = []
        for piece in re.split("(<image>|<video>)", turn["value"]):
            if piece == "<image>":
                items.append({"type": "image", "text": None})
            elif piece == "<video>":
                items.append({"type": "video", "video": record["video"]})
            elif piece.strip():
                items.append({"type": "text", "text": piece})
        messages.append({"role": "user" if turn["from"] == "human" else "assistant", "content": items})
    images = record.get("image", [])
    images = [images] if isinstance(images, str) else images
    out = {"id": record["id"], "messages": messages}
    out["images"] = [{"bytes": Path(p).read_bytes(), "path": None} for p in images] if image_as_bytes else images
    return out


def kept_token_sets(cfg):
    train, _, stats, _, _ = build(cfg)
    return stats, sorted(tuple(row["input_ids"]) for row in epoch_rows(train))


def test_loaders_agree_across_formats(tmp_path, cache):
    """LLaVA JSON, LLaVA JSONL, messages JSONL and parquet (embedded image bytes) give identical samples, videos
    included."""
    records = good_records(tmp_path)
    (tmp_path / "llava.json").write_text(json.dumps(records))
    (tmp_path / "llava.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "messages.jsonl").write_text("".join(json.dumps(to_messages(r)) + "\n" for r in records))
    rows = [to_messages(r, image_as_bytes=True) for r in records]
    table = Dataset.from_list(rows).cast_column("images", List(Image()))
    table.to_parquet(str(tmp_path / "messages.parquet"))
    results = {}
    for name in ("llava.json", "llava.jsonl", "messages.jsonl", "messages.parquet"):
        cfg = recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / name}", "data.eval_fraction=0")
        stats, tokens = kept_token_sets(cfg)
        assert stats.kept_train == len(records) and not stats.skipped, name
        results[name] = tokens
    assert len({tuple(v) for v in results.values()}) == 1


def bad_records(tmp_path, good):
    """One record per skip reason, built from a good single-image record."""
    single = next(r for r in good if isinstance(r.get("image"), str))
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    turns = single["conversations"]
    return {
        "missing_image": {**single, "id": "bad-missing", "image": str(tmp_path / "nope.png")},
        "corrupt_image": {**single, "id": "bad-corrupt", "image": str(corrupt)},
        "image_count_mismatch": {**single, "id": "bad-count", "image": [single["image"], single["image"]]},
        "no_assistant_turn": {**single, "id": "bad-noreply", "conversations": turns[:1]},
        "empty_text": {**single, "id": "bad-empty", "conversations": [turns[0], {"from": "gpt", "value": " "}]},
        "too_long": {"id": "bad-long", "conversations": [{"from": "human", "value": "cat " * 1500}, turns[1]]},
        "unknown_format": {"id": "bad-format", "question": "?", "answer": "!"},
    }


def test_bad_inputs_are_counted_and_good_samples_survive(tmp_path, cache):
    """Each kind of bad record is skipped and counted under its reason; every good record is kept."""
    good = good_records(tmp_path)
    bad = bad_records(tmp_path, good)
    lines = [json.dumps(r) for r in [*good[:4], *bad.values(), *good[4:]]]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    cfg = recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / 'mixed.jsonl'}", "data.eval_fraction=0")
    train, _, stats, _, _ = build(cfg)
    assert dict(stats.skipped) == {reason: 1 for reason in bad}
    assert stats.kept_train == len(good) and stats.records == len(good) + len(bad)
    assert sorted(r["sample_id"] for r in epoch_rows(train)) == sorted(r["id"] for r in good)


def test_on_error_raise_names_the_sample(tmp_path, cache):
    """With data.on_error=raise, a bad record stops the run with an error that names it."""
    good = good_records(tmp_path)
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad_records(tmp_path, good)["missing_image"]) + "\n")
    cfg = recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / 'bad.jsonl'}", "data.on_error=raise")
    with pytest.raises(ValueError, match="bad-missing"):
        build(cfg)


def test_more_bad_inputs_are_skips_not_crashes(tmp_path, cache):
    """A conversation opening with the assistant, an image no processor can resize (aspect ratio 250), a truncated
    JSONL line and a line that is not a JSON object are counted skips; the good records all survive."""
    from PIL import Image

    good = good_records(tmp_path)
    single = next(r for r in good if isinstance(r.get("image"), str))
    sliver = tmp_path / "sliver.png"
    Image.new("RGB", (2000, 8), "red").save(sliver)
    turns = single["conversations"]
    lines = [json.dumps(r) for r in good]
    lines += [
        json.dumps({"id": "bad-first", "conversations": [turns[1], {"from": "human", "value": "and?"}]}),
        json.dumps({**single, "id": "bad-sliver", "image": str(sliver)}),
        '{"id": "bad-truncated", "conversations": [ {"from": "human"',
        "[1, 2, 3]",
    ]
    (tmp_path / "more.jsonl").write_text("\n".join(lines) + "\n")
    cfg = recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / 'more.jsonl'}", "data.eval_fraction=0")
    _, _, stats, _, _ = build(cfg)
    assert dict(stats.skipped) == {"unknown_format": 3, "corrupt_image": 1}
    assert stats.kept_train == len(good)


def test_empty_data_file_is_a_clear_error(tmp_path, cache):
    """A JSONL file (or JSON list) with no records fails with an error naming data.path, not deep in datasets."""
    for name, text in (("empty.jsonl", ""), ("empty.json", " []\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="holds no records"):
            build(recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / name}"))


def test_on_error_raise_is_not_bypassed_by_the_cache(tmp_path, cache):
    """A run with data.on_error=raise fails on a bad record even when an earlier on_error=skip run cached it."""
    good = good_records(tmp_path)
    lines = [json.dumps(r) for r in good] + [json.dumps(bad_records(tmp_path, good)["missing_image"])]
    (tmp_path / "cached.jsonl").write_text("\n".join(lines) + "\n")
    overrides = (f"data.path={tmp_path / 'cached.jsonl'}", "data.eval_fraction=0")
    assert build(recipe("tiny-qwen2_5_vl", cache, *overrides))[2].skipped["missing_image"] == 1
    with pytest.raises(ValueError, match="bad-missing"):
        build(recipe("tiny-qwen2_5_vl", cache, *overrides, "data.on_error=raise"))


def test_streaming_matches_in_memory(tmp_path, cache):
    """Streaming mode plans the same set of samples as the in-memory mode, and counts skips the same way."""
    good = good_records(tmp_path)
    lines = [json.dumps(r) for r in good] + [json.dumps(bad_records(tmp_path, good)["corrupt_image"])]
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    overrides = (f"data.path={tmp_path / 's.jsonl'}", "data.eval_fraction=0")
    stats, in_memory = kept_token_sets(recipe("tiny-qwen2_5_vl", cache, *overrides))
    streaming_cfg = recipe("tiny-qwen2_5_vl", cache, *overrides, "data.streaming=true")
    train, _, streaming_stats, _, _ = build(streaming_cfg)
    assert sorted(tuple(r["input_ids"]) for r in epoch_rows(train)) == in_memory
    assert streaming_stats.skipped == stats.skipped and streaming_stats.kept_train == stats.kept_train


def test_processed_cache_follows_its_inputs(tmp_path, cache, monkeypatch):
    """The processed cache is reused while nothing it depends on changed, and rebuilt when an image file is
    deleted (a missing_image skip), restored (kept again), broken and fixed in place, the data file is rewritten
    with the same size and mtime, or a pixel bound changes; inspect_data.py's bare model config and train.py's
    built model share one cache."""
    from PIL import Image as PILImage

    from data import processing

    calls = []
    original = processing.SampleProcessor.process
    monkeypatch.setattr(processing.SampleProcessor, "process", lambda self, *a: calls.append(1) or original(self, *a))
    good = good_records(tmp_path)
    data_file = tmp_path / "c.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in good))
    overrides = (f"data.path={data_file}", "data.eval_fraction=0")

    def build_counting(*more):
        calls.clear()
        cfg = recipe("tiny-qwen2_5_vl", cache, *overrides, *more)
        model_config = build_model(cfg.model).config  # what train.py passes: dtype set, unlike hf_config's
        stats = build_data(cfg.data, cfg.packing, load_processor(cfg.model, cfg.data), model_config)[2]
        return stats, len(calls)

    assert build_counting()[1] == len(good)
    assert build_counting()[1] == 0
    assert kept_token_sets(recipe("tiny-qwen2_5_vl", cache, *overrides)) and not calls  # inspect_data's config
    image = Path(next(r["image"] for r in good if isinstance(r.get("image"), str)))
    moved = image.with_suffix(".moved")
    image.rename(moved)
    stats, processed = build_counting()
    assert processed > 0 and stats.skipped["missing_image"] >= 1
    moved.rename(image)  # the same file again: the first build's rows are right, and are reused
    stats, _ = build_counting()
    assert not stats.skipped and stats.kept_train == len(good)
    image.write_bytes(b"broken")  # rewritten in place: reprocessed (a corrupt_image skip), then fixed again
    stats, processed = build_counting()
    assert processed > 0 and stats.skipped["corrupt_image"] == 1
    PILImage.new("RGB", (40, 30), "blue").save(image, format="PNG")
    stats, processed = build_counting()
    assert processed > 0 and not stats.skipped and stats.kept_train == len(good)
    stat = data_file.stat()
    data_file.write_text(data_file.read_text().replace(good[0]["id"], good[0]["id"][::-1]))
    os.utime(data_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert build_counting()[1] > 0
    assert build_counting("data.max_pixels=20000")[1] > 0


def test_the_empty_row_is_a_processed_row_of_every_column():
    """empty_row, from which skipped rows and load-time stand-ins are made, has every PROCESSED_FEATURES column and
    nothing else, encodes under those features, sets what it is given and refuses a column the schema lacks."""
    row = empty_row(sample_id="s", skip_reason="too_long", length=3)
    assert set(row) == set(PROCESSED_FEATURES)
    assert Dataset.from_list([row], features=PROCESSED_FEATURES)[0] == row
    assert row["sample_id"] == "s" and row["skip_reason"] == "too_long" and row["length"] == 3
    assert row["skip_detail"] == "" and row["images"] == [] and row["num_patches"] == 0
    with pytest.raises(KeyError, match="image_count"):
        empty_row(image_count=1)


def test_an_image_gone_at_load_time_is_a_counted_stand_in(tmp_path, cache):
    """An image deleted after the cache was built (while the run reads it) turns its sample into a stand-in with no
    labels, counted in the batch, in loader workers too; the packs keep their planned lengths; with
    data.on_error=raise it is an error naming the sample."""
    good = good_records(tmp_path)
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    overrides = (f"data.path={tmp_path / 'g.jsonl'}", "data.eval_fraction=0", "data.num_workers=2")
    train, *_ = build(recipe("tiny-qwen2_5_vl", cache, *overrides))
    raising, *_ = build(recipe("tiny-qwen2_5_vl", cache, *overrides, "data.on_error=raise"))
    rows = epoch_rows(train)
    lengths = next(iter(train))["sample_lengths"]
    assert sorted(lengths) == sorted(r["length"] for r in rows)  # the tiny recipe packs all 8 into one batch
    train.load_state_dict({"epoch": 0, "step_in_epoch": 0})
    shutil.rmtree(tmp_path / "src" / "images")
    batch = next(iter(train))
    assert batch["sample_lengths"] == lengths and batch["pixel_values"] is None
    assert batch["num_skipped_samples"] == sum(1 for r in rows if r["images"] or r["videos"]) > 0
    with pytest.raises(ValueError, match=r"missing_(image|video)"):
        next(iter(raising))


@pytest.mark.slow
def test_worker_processes_give_the_same_batches(cache):
    """Collating in DataLoader workers yields the same batches, in the same order, as collating inline, and the
    loader position advances the same way."""
    overrides = ("data.num_samples=60", "packing.max_tokens=512")
    inline, _, _, _, _ = build(recipe("tiny-qwen2_5_vl", cache, *overrides))
    workers, _, _, _, _ = build(recipe("tiny-qwen2_5_vl", cache, *overrides, "data.num_workers=2"))
    inline.load_state_dict({"epoch": 0, "step_in_epoch": 1})
    workers.load_state_dict({"epoch": 0, "step_in_epoch": 1})
    for (_, a), (_, b) in zip(zip(range(5), inline, strict=False), zip(range(5), workers, strict=False), strict=True):
        assert a.keys() == b.keys()
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
        assert a["max_seqlen"] == b["max_seqlen"] and a["sample_lengths"] == b["sample_lengths"]
    assert inline.state_dict() == workers.state_dict()


def test_loader_workers_plan_the_vision_grids(cache, step_plans):
    """With a `plan` hook (train.py's: the tower's VisionPlanner) every batch collated in the DataLoader workers
    carries its grids' host plans, which the step takes as they are (it plans nothing itself) and which equal what
    it would have planned from the grids."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=60", "packing.max_tokens=512", "data.num_workers=2")
    visual = build_model(cfg.model).model.visual
    processor = load_processor(cfg.model, cfg.data)
    loader, _, _ = build_data(
        cfg.data, cfg.packing, processor, hf_config(cfg.model), plan=vision_plan.VisionPlanner(visual).add_host_plans
    )
    batches = [batch for _, batch in zip(range(4), loader, strict=False)]
    assert any(batch.get("image_grid_thw") is not None for batch in batches)
    plans = vision_plan.VisionPlans(visual)
    for batch in batches:
        assert batch.get(vision_plan.HOST_PLANS, {}).keys() == {
            k for k in vision_plan.GRID_KEYS if batch.get(k) is not None
        }
        inputs = {key: batch[key] for key in vision_plan.GRID_KEYS if batch.get(key) is not None}
        plans.prepare_batch(inputs, vision_plan.host_grids(batch), batch.get(vision_plan.HOST_PLANS))
        assert step_plans == [], "the step planned a grid the workers had planned"
        for grid in inputs.values():
            expected = vision_plan.VisionPlanner(visual).host_kwargs(grid)
            got = plans._plans[id(grid)].kwargs
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value, name


def test_eval_loader_is_one_pass_over_held_out_samples(cache):
    """The eval loader stops after one epoch and its packs hold exactly the held-out samples, none of which is
    in the training plan."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=60", "data.eval_fraction=0.1")
    train, evaluation, stats, _, _ = build(cfg)
    batches = list(evaluation)
    assert sum(len(b["sample_lengths"]) for b in batches) == stats.kept_eval > 0
    held_out = {row["sample_id"] for row in epoch_rows(evaluation)}
    assert held_out.isdisjoint(row["sample_id"] for row in epoch_rows(train))


def test_no_kept_sample_is_an_error_not_a_silent_hang(tmp_path, cache):
    """A dataset whose every record is skipped makes the endless training loader raise, not spin forever."""
    (tmp_path / "none.jsonl").write_text(json.dumps({"id": "x", "question": "?"}) + "\n")
    cfg = recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / 'none.jsonl'}")
    train, _, stats, _, _ = build(cfg)
    assert stats.skipped["unknown_format"] == 1
    with pytest.raises(ValueError, match="no batch"):
        next(iter(train))


def test_parallel_processing_matches_serial(tmp_path):
    """datasets.map with num_proc=2 produces the same processed samples as one process."""
    rows = {}
    for num_proc in (1, 2):
        overrides = ("data.num_samples=24", f"data.num_proc={num_proc}")
        cfg = recipe("tiny-qwen2_5_vl", tmp_path / f"cache{num_proc}", *overrides)
        rows[num_proc] = kept_token_sets(cfg)[1]
    assert rows[1] == rows[2] and len(rows[1]) > 0


class SyntheticItems:
    """`items(epoch)` of synthetic_loader; a class, as loader workers (a forkserver's children) unpickle it."""

    def __init__(self, samples: int):
        rng = random.Random(0)
        self.samples = samples
        self.sizes = [(rng.randint(340, 500), rng.choice([0, 64, 256])) for _ in range(samples)]

    def __call__(self, epoch: int):
        order = random.Random(epoch).sample(range(self.samples), self.samples)
        return (PackItem(key=k, length=self.sizes[k][0], num_patches=self.sizes[k][1]) for k in order)


HELD_IN_THE_TRAINING_PROCESS = threading.Lock()


class LockTakingItems(SyntheticItems):
    """SyntheticItems whose plan, in a loader worker, takes HELD_IN_THE_TRAINING_PROCESS."""

    def __call__(self, epoch: int):
        if get_worker_info() is not None:
            if not HELD_IN_THE_TRAINING_PROCESS.acquire(timeout=5):
                raise RuntimeError("the worker inherited a lock that another thread of the training process held")
            HELD_IN_THE_TRAINING_PROCESS.release()
        return super().__call__(epoch)


def synthetic_loader(samples, rank=0, world_size=1, grad_accum_steps=1, window=1, num_workers=0, items=SyntheticItems):
    """A StepLoader over `samples` samples of 340-500 tokens in 1000-token packs, so every pack holds exactly two
    (three never fit) and an epoch has ceil(samples / 2) packs; reshuffled per epoch; a batch is its sample keys."""
    packing = PackingConfig(max_tokens=1000, buffer_size=8, balance_window_steps=window)
    return StepLoader(
        items(samples),
        fetch=list,
        collate=tuple,
        packing_cfg=packing,
        rank=rank,
        world_size=world_size,
        seed=1,
        epochs=None,
        num_workers=num_workers,
        grad_accum_steps=grad_accum_steps,
    )


def test_loader_workers_start_clean_while_another_thread_holds_a_lock():
    """Batches are collated ahead in a thread (data/prefetch.py) while the main thread runs, so workers start while
    other threads hold locks. Forked, a worker would get such a lock copied in its held state and wait on it
    forever (here: 5 s, then an error); started from the forkserver, it imports the module afresh."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with HELD_IN_THE_TRAINING_PROCESS:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        batches = list(itertools.islice(synthetic_loader(9, num_workers=2, items=LockTakingItems), 4))
    finally:
        release.set()
        holder.join()
    inline = itertools.islice(synthetic_loader(9), 4)
    assert [list(batch) for batch in batches] == [list(batch) for batch in inline]  # workers hand tuples as lists


KILLED_TRAINING_PROCESS = """
import sys, time
sys.path[:0] = [{root!r}]
from tests.test_data_pipeline import synthetic_loader

if __name__ == "__main__":
    batches = iter(synthetic_loader(200, num_workers=2))  # 100 packs: neither worker runs out
    next(batches)
    print("READY", flush=True)
    time.sleep(600)
"""


def forkserver_processes(pid: int) -> list:
    """The loader workers' forkserver and the workers under process `pid` (psutil.Process); one that ended, or is a
    zombie, since it was listed is left out."""
    import psutil

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "forkserver" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_loader_workers_end_with_a_killed_training_process(tmp_path):
    """A training process killed while its loader workers run leaves none of the processes it started behind: the
    forkserver dies with it (data/worker_server.py) and the workers, whose parent the server is, then exit."""
    import psutil

    script = tmp_path / "killed.py"
    script.write_text(KILLED_TRAINING_PROCESS.format(root=str(Path(__file__).parents[1])))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "READY"
        assert len(forkserver_processes(process.pid)) == 3  # the server and its two workers, both busy
        spawned = psutil.Process(process.pid).children(recursive=True)  # also multiprocessing's resource tracker
    finally:
        process.kill()
        process.wait()
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


def optimizer_steps(loaders, grad_accum_steps, count):
    """Per optimizer step, the set of packs (as frozensets of sample keys) the training loop takes from the
    loaders: grad_accum_steps consecutive batches of every rank."""
    batches = [iter(loader) for loader in loaders]
    return [{frozenset(next(it)) for it in batches for _ in range(grad_accum_steps)} for _ in range(count)]


def test_one_rank_accumulating_sees_the_packs_of_two_ranks_across_epochs():
    """One rank with 2 accumulation micro-steps and balance window 2 trains on the same pack set per optimizer
    step as 2 ranks with one micro-step and window 1, across epoch ends that have an odd pack left over; every
    epoch is a whole number of optimizer steps, and the left-over pack is counted by both layouts alike."""
    samples = 9  # 5 packs per epoch
    single = synthetic_loader(samples, grad_accum_steps=2, window=2)
    ranks = [synthetic_loader(samples, rank=r, world_size=2) for r in (0, 1)]
    assert sum(1 for _ in single.packs(0)) % 2 == 1
    for epoch in range(4):
        assert sum(1 for _ in single.steps(epoch)) % 2 == 0
        assert single.leftover(epoch) == ranks[0].leftover(epoch) and single.leftover(epoch).packs == 1
    assert optimizer_steps([single], 2, count=9) == optimizer_steps(ranks, 1, count=9)


def test_resume_with_accumulation_across_an_epoch_end():
    """A loader restored from state_dict after any optimizer step yields exactly the micro-batches the original
    yields next, across epoch ends that drop a partial accumulation group."""
    original = synthetic_loader(13, grad_accum_steps=3, window=3)  # 7 packs: 6 dealt, 1 left over per epoch
    batches = iter(original)
    for step in range(5):
        for _ in range(3):
            next(batches)
        state = original.state_dict()
        expected = [next(batches) for _ in range(6)]
        resumed = synthetic_loader(13, grad_accum_steps=3, window=3)
        resumed.load_state_dict(state)
        assert [batch for _, batch in zip(range(6), resumed, strict=False)] == expected, f"after step {step + 1}"
        original.load_state_dict(state)
        batches = iter(original)


def test_fewer_packs_than_one_optimizer_step_is_a_clear_error():
    """An epoch with packs for fewer micro-steps than one optimizer step yields nothing and says why, instead of
    spinning over empty epochs or mixing epochs in one step."""
    loader = synthetic_loader(3, grad_accum_steps=4, window=4)  # 2 packs, 4 micro-steps needed
    with pytest.raises(ValueError, match="fewer packs than one optimizer step"):
        next(iter(loader))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_leftover_is_logged_once_per_epoch_by_rank_0(caplog, num_workers):
    """Rank 0 logs each epoch's left-over packs and tokens exactly once (also when DataLoader workers walk the
    plan), rank 1 logs nothing, and a resumed epoch is still reported."""
    loaders = [synthetic_loader(9, rank=r, world_size=2, num_workers=num_workers) for r in (0, 1)]
    for loader in loaders:
        loader.load_state_dict({"epoch": 0, "step_in_epoch": 1})
    with caplog.at_level(logging.INFO, logger="data.pipeline"):
        optimizer_steps(loaders, 1, count=1 + 2 + 1)  # 5 packs = 2 steps an epoch: rest of 0, all of 1, into 2
    expected = []
    for epoch in (0, 1):
        leftover = loaders[0].leftover(epoch)
        expected.append(
            f"train epoch {epoch}: 1 pack ({leftover.tokens} tokens) left over: "
            "fewer than one step of 2 ranks x 1 micro-batches"
        )
    assert [r.getMessage() for r in caplog.records if "left over" in r.getMessage()] == expected


def test_resume_inside_an_accumulation_group_warns(cache, caplog):
    """A loader state that is not at an optimizer-step boundary (saved with another grad_accum_steps) is resumed
    as saved, with a warning that the step grouping shifts until the epoch ends."""
    cfg = recipe("tiny-qwen2_5_vl", cache, "data.num_samples=56", "packing.max_tokens=512", "train.grad_accum_steps=3")
    train, *_ = build(cfg)
    with caplog.at_level("WARNING", logger="data.pipeline"):
        train.load_state_dict({"epoch": 0, "step_in_epoch": 3})
        assert not caplog.records
        train.load_state_dict({"epoch": 0, "step_in_epoch": 4})
    position = train.state_dict()
    assert (position["epoch"], position["step_in_epoch"], position["carried"]) == (0, 4, [])
    assert "inside a group of grad_accum_steps=3" in caplog.text


def malformed_records(good):
    """Record shapes that are not a valid conversation, each built from a good single-image record."""
    single = next(r for r in good if isinstance(r.get("image"), str))
    human, reply = single["conversations"]
    content = [{"type": "text", "text": "hi"}]
    return [
        {**single, "conversations": ["a turn that is a string", reply]},
        {**single, "conversations": [None, reply]},
        {**single, "conversations": [human, {"from": "gpt", "value": ["a", "list"]}]},
        {**single, "conversations": [[human], reply]},
        {**single, "conversations": [{**human, "weight": 1}, reply]},
        {**single, "conversations": [human, {"from": 7, "value": "x"}]},
        {**single, "image": [[single["image"]]]},
        {**single, "image": {"path": 5}},
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": [["nested"]]}, {"role": "assistant", "content": "x"}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": 3}]},
                {"role": "assistant", "content": "x"},
            ]
        },
        {"messages": [{"role": "user", "content": content, "extra": 1}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}, "assistant says"]},
        {**single, "id": "lone-\ud800", "conversations": [human, {"from": "gpt", "value": "a lone \udfff"}]},
    ]


def test_malformed_records_are_counted_skips_with_their_line(tmp_path, cache):
    """Every record shape that is not a valid conversation (a turn that is not a mapping, content of the wrong
    type, nested lists, unknown keys, lone surrogates, JSON nested past the recursion limit) is skipped as
    malformed_record, its detail naming the 1-based line; good records all survive, one with an unknown key that is
    null too; with data.on_error=raise the first one stops the build with an error naming its line."""
    good = good_records(tmp_path)
    malformed = malformed_records(good)
    lines = [json.dumps(r) for r in good[:2]] + [json.dumps(r) for r in malformed] + ["[" * 100000 + "]" * 100000]
    human, reply = good[2]["conversations"]
    good[2] = {**good[2], "conversations": [{**human, "weight": None}, reply]}  # null keys: arrow's key union
    lines += [json.dumps(r) for r in good[2:]]
    (tmp_path / "malformed.jsonl").write_text("\n".join(lines) + "\n")
    overrides = (f"data.path={tmp_path / 'malformed.jsonl'}", "data.eval_fraction=0")
    _, _, stats, _, _ = build(recipe("tiny-qwen2_5_vl", cache, *overrides))
    assert dict(stats.skipped) == {"malformed_record": len(malformed) + 1}
    assert stats.kept_train == len(good)
    assert stats.skip_examples["malformed_record"][0] == "builtin-000000: line 3: turn 0 is str, not an object"
    with pytest.raises(ValueError, match="line 3"):
        build(recipe("tiny-qwen2_5_vl", cache, *overrides, "data.on_error=raise"))


def test_undecodable_line_is_a_counted_skip_and_a_bom_keeps_the_first_record(tmp_path, cache):
    """A JSONL line that is not UTF-8 is skipped as undecodable_line, named by its 1-based line number, and the rest
    of the file loads; a UTF-8 BOM before the first record does not cost that record; a JSON list with a bad byte is
    a one-line error naming the file."""
    good = good_records(tmp_path)
    lines = [json.dumps(r).encode() for r in good]
    lines.insert(3, b'{"id": "latin-1", "conversations": "caf\xe9"}')
    (tmp_path / "bytes.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")
    cfg = recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / 'bytes.jsonl'}", "data.eval_fraction=0")
    _, _, stats, _, _ = build(cfg)
    assert dict(stats.skipped) == {"undecodable_line": 1}
    assert stats.skip_examples["undecodable_line"] == ["line 4: the line is not valid UTF-8"]
    assert stats.kept_train == len(good)
    (tmp_path / "bad.json").write_bytes(b"\xef\xbb\xbf[" + json.dumps(good[0]).encode() + b', "\xff"]')
    with pytest.raises(ValueError, match=r"bad.json: byte \d+ is not valid UTF-8"):
        build(recipe("tiny-qwen2_5_vl", cache, f"data.path={tmp_path / 'bad.json'}"))


def test_every_sample_too_long_says_raise_max_tokens(tmp_path, cache):
    """When every sample is longer than packing.max_tokens, the empty-epoch error says to raise it (lowering it
    helps only when there are too few packs)."""
    good = good_records(tmp_path)
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    overrides = (f"data.path={tmp_path / 'long.jsonl'}", "data.eval_fraction=0", "packing.max_tokens=16")
    train, _, stats, _, _ = build(recipe("tiny-qwen2_5_vl", cache, *overrides))
    assert stats.skipped["too_long"] + stats.skipped["video_too_long"] == len(good)
    with pytest.raises(ValueError, match=r"raise packing\.max_tokens"):
        next(iter(train))


def test_every_rank_knows_the_vision_kinds_of_the_whole_micro_step():
    """With step_vision on, each rank's batch carries (any image, any video) over all ranks' packs of its
    micro-step: the same on every rank, so ranks agree on their vision calls without a collective; a rank whose
    own pack has no video still sees that another rank's has one."""
    rng = random.Random(3)
    kinds = [(rng.random() < 0.5, rng.random() < 0.2) for _ in range(24)]

    def items(epoch):
        order = random.Random(epoch).sample(range(24), 24)
        return (PackItem(k, 400, 64, has_images=kinds[k][0], has_videos=kinds[k][1]) for k in order)

    def loader(rank):
        packing = PackingConfig(max_tokens=1000, buffer_size=8)
        collate = lambda keys: {"keys": keys}
        return StepLoader(items, list, collate, packing, rank, world_size=3, seed=1, epochs=1, step_vision=True)

    batches = [list(loader(rank)) for rank in range(3)]
    assert len(batches[0]) >= 3
    saw_other_ranks_video = False
    for step_batches in zip(*batches, strict=True):
        flags = {b[STEP_VISION] for b in step_batches}
        expected = tuple(any(kinds[k][i] for b in step_batches for k in b["keys"]) for i in (0, 1))
        assert flags == {expected}
        own_videos = [any(kinds[k][1] for k in b["keys"]) for b in step_batches]
        saw_other_ranks_video |= expected[1] and not all(own_videos)
    assert saw_other_ranks_video
    assert STEP_VISION not in next(iter(synthetic_loader(4, world_size=1)))  # off by default: batches untouched


class CollateFailingAt:
    """`collate` of a StepLoader that raises the DataError a bad sample raises under data.on_error=raise when its
    batch holds sample `key`; a class, as loader workers unpickle it."""

    def __init__(self, key: int):
        self.key = key

    def __call__(self, keys: list) -> tuple:
        if self.key in keys:
            raise DataError(f"sample {self.key}: missing_image: gone.png: No such file (data.on_error=skip skips it)")
        return tuple(keys)


def test_a_data_error_in_a_loader_worker_is_the_same_one_line():
    """A DataError raised while a loader worker collates reaches the training process as a DataError with exactly
    the worker's one-line message (train.py prints it as `data error: ...`), not PyTorch's multi-line re-raise; the
    batches before it arrive as they would inline."""
    bad = next(iter(SyntheticItems(9)(0))).key  # in the first pack of epoch 0
    packing = PackingConfig(max_tokens=1000, buffer_size=8, balance_window_steps=1)
    loaders = [
        StepLoader(SyntheticItems(9), list, CollateFailingAt(bad), packing, 0, 1, 1, None, num_workers=workers)
        for workers in (0, 2)
    ]
    for loader in loaders:
        with pytest.raises(DataError) as raised:
            list(itertools.islice(loader, 10))
        assert str(raised.value) == f"sample {bad}: missing_image: gone.png: No such file (data.on_error=skip skips it)"
