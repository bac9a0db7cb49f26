"""Generation, scoring and chat on trained runs (inference/, scripts/generate.py, scripts/chat.py): prompts built as
training builds them in every format, each scorer against hand-computed values, full and LoRA exports and checkpoints,
resume of a partial predictions file, bad records, the serving export, the in-training evaluation, and (slow tier)
two processes over gloo and a SIGTERM mid-run."""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from accelerate.state import AcceleratorState
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

import train
from core.config import load_config
from core.config_tree import ConfigError
from core.families import hf_config
from data.formats import DataError
from data.pipeline import load_processor
from data.processing import SampleProcessor
from inference import builtin_eval, evaluate, predictions, scoring
from inference.generation import GenerationSettings, Generator
from inference.loading import (
    CHECKPOINT_MODEL_FILE,
    CHECKPOINT_SHARDS_DIR,
    data_settings,
    load_run,
    read_run_config,
)
from inference.prompts import EvalDataError, PromptBuilder
from lifecycle.checkpoint import latest_checkpoint
from modeling.build import build_model
from scripts import chat, generate
from tests.tiers import tiered

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-qwen2_5_vl.yaml"
LORA = "recipes/lora-tiny.yaml"


# ----- scores -----


def test_scorers_give_the_hand_computed_values():
    """Each scorer on cases computed by hand: SQuAD-normalised exact match, ChartQA's 5% relaxed accuracy, DocVQA's
    ANLS with its 0.5 threshold, ROUGE-L F (LCS 2 of 3 and 2 tokens: P 1, R 2/3, F 0.8) and BLEU (identical = 1)."""
    assert scoring.exact_match("The  Circle is red!", "circle is RED") == 1.0
    assert scoring.exact_match("a red circle", "a blue circle") == 0.0
    assert scoring.relaxed_accuracy("10.4", "10") == 1.0  # 4% off
    assert scoring.relaxed_accuracy("10.6", "10") == 0.0  # 6% off
    assert scoring.relaxed_accuracy("50%", "0.5") == 1.0
    assert scoring.relaxed_accuracy("Red", "red") == 1.0 and scoring.relaxed_accuracy("red.", "red") == 0.0
    assert scoring.anls("helo", "hello") == pytest.approx(0.8)  # one edit over 5 characters
    assert scoring.anls("HELLO ", "hello") == 1.0
    assert scoring.anls("abc", "xyz") == 0.0  # distance 1.0 >= 0.5
    assert scoring.anls("abcd", "abxy") == 0.0  # distance exactly 0.5
    assert scoring.rouge_l("the cat", "the cat sat") == pytest.approx(0.8)
    assert scoring.sentence_bleu("the cat sat on the mat", ["the cat sat on the mat"]) == pytest.approx(1.0)
    assert 0.0 < scoring.sentence_bleu("the cat sat on a mat", ["the cat sat on the mat"]) < 1.0
    scores = scoring.score("blue", ["red", "Blue"])  # the best over references
    assert scores["exact_match"] == 1.0 and scores["anls"] == 1.0


def test_summary_counts_skips_and_means_per_category():
    """summarize: skipped lines are counted by reason and left out of the means; means per category and overall."""
    rows = [
        {"category": "color", "references": ["red"], "prediction": "red", "scores": scoring.score("red", ["red"])},
        {"category": "color", "references": ["red"], "prediction": "blue", "scores": scoring.score("blue", ["red"])},
        {"category": "count", "references": ["two"], "prediction": "two", "scores": scoring.score("two", ["two"])},
        {"category": "count", "skipped": "missing_image"},
    ]
    summary = scoring.summarize(rows)
    assert summary["records"] == 4 and summary["scored"] == 3 and summary["skipped"] == {"missing_image": 1}
    assert summary["scores"]["exact_match"] == pytest.approx(2 / 3)
    assert summary["by_category"]["color"]["exact_match"] == 0.5
    # a category's records and means are its scored records': the skipped one is left out of "count"
    assert summary["by_category"]["count"] == {"records": 1, **scoring.score("two", ["two"])}
    assert summary["by_category"]["color"]["records"] == 2
    assert "color" in scoring.format_table(summary)


# ----- prompts in every format -----


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory):
    """(processor, model config, a directory of images and frames) for the tiny Qwen2.5-VL recipe."""
    cache = tmp_path_factory.mktemp("cache")
    cfg = load_config(TINY, [f"data.cache_dir={cache}"])
    root = tmp_path_factory.mktemp("images")
    for name, color in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (112, 84), color).save(root / name)
    for i in range(4):
        Image.new("RGB", (56, 56), (60 * i, 0, 0)).save(root / f"f{i}.png")
    return load_processor(cfg.model, cfg.data), hf_config(cfg.model), root


def builder(processor, config, root, data_format="auto", max_positions=None) -> PromptBuilder:
    processor_ = SampleProcessor(processor, config, data_format="messages", image_root=str(root))
    return PromptBuilder(processor_, data_format, max_positions)


FRAMES = ["f0.png", "f1.png", "f2.png", "f3.png"]
RECORDS = {
    "llava image": {
        "image": "a.png",
        "conversations": [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "Red."}],
    },
    "messages inline image": {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "Red."},
        ]
    },
    "multi-turn two images": {
        "images": ["a.png", "b.png"],
        "conversations": [
            {"from": "human", "value": "<image>\nFirst?"},
            {"from": "gpt", "value": "Red."},
            {"from": "human", "value": "<image>\nAnd this?"},
            {"from": "gpt", "value": "Blue."},
        ],
    },
    "video frames": {
        "video": FRAMES,
        "conversations": [{"from": "human", "value": "<video>\nWhich way?"}, {"from": "gpt", "value": "Left."}],
    },
    "image and video": {
        "image": "b.png",
        "video": FRAMES,
        "conversations": [{"from": "human", "value": "<image>\n<video>\nSame?"}, {"from": "gpt", "value": "Yes."}],
    },
}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_prompt_is_the_training_sample_up_to_its_last_reply(tiny_parts, name):
    """For every layout training reads, the prompt's ids (images and videos expanded) are the processed training
    sample's ids before its last assistant reply, ending with the generation prompt; the reference is that reply and
    the grids are the training sample's."""
    processor, config, root = tiny_parts
    record = RECORDS[name]
    prompt = builder(processor, config, root).build(record, 0)
    trained = SampleProcessor(processor, config, image_root=str(root)).process(record, "x")
    labels = trained["labels"]
    start = max(i for i in range(len(labels)) if labels[i] != -100 and labels[i - 1] == -100)
    assert prompt.row["input_ids"] == trained["input_ids"][:start]
    assert processor.tokenizer.decode(prompt.row["input_ids"][-3:]).endswith("<|im_start|>assistant\n")
    assert prompt.references == [record.get("conversations", record.get("messages"))[-1].get("value", "Red.")]
    assert prompt.row["image_grid_thw"] == trained["image_grid_thw"]
    assert prompt.row["video_grid_thw"] == trained["video_grid_thw"]


def test_bad_eval_records(tiny_parts, tmp_path):
    """A missing or corrupt image is a skip with its reason; an empty reference is an error naming the record; a
    prompt that fills the model's context is skipped as too_long, never cut."""
    processor, config, root = tiny_parts
    (root / "broken.png").write_bytes(b"not a png")
    make = builder(processor, config, root)
    ask = lambda image, answer="Red.": {
        "id": "r1",
        "image": image,
        "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": answer}],
    }
    assert make.build(ask("nowhere.png"), 0).skip_reason == "missing_image"
    assert make.build(ask("broken.png"), 0).skip_reason == "corrupt_image"
    with pytest.raises(EvalDataError, match="r1"):
        make.build(ask("a.png", answer="  "), 0)
    short = builder(processor, config, root, max_positions=8).build(ask("a.png"), 0)
    assert short.skip_reason == "too_long" and short.row is None


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=("qwen2_5_vl", "qwen3_vl")))
def test_every_family_generates_in_a_batch_what_it_generates_alone(family, tmp_path):
    """For each family's tiny model, prompts with an image, a video (Qwen3-VL/3.5: timestamped) and text only,
    left-padded into one batch, get the same greedy tokens as each alone: padding moves no position and no image."""
    cfg = load_config(f"recipes/tiny-{family}.yaml", [f"data.cache_dir={tmp_path / 'cache'}"])
    model = build_model(cfg.model, seed=0).eval()
    processor = load_processor(cfg.model, cfg.data)
    root = tmp_path / "images"
    root.mkdir()
    Image.new("RGB", (112, 84), "red").save(root / "a.png")
    Image.new("RGB", (84, 140), "blue").save(root / "b.png")
    for i in range(4):
        Image.new("RGB", (56, 56), (60 * i, 0, 0)).save(root / f"f{i}.png")
    text_only = {"conversations": [{"from": "human", "value": "What is 2 plus 3?"}, {"from": "gpt", "value": "5."}]}
    records = [RECORDS["llava image"], RECORDS["video frames"], text_only, RECORDS["image and video"]]
    make = builder(processor, model.config, root)
    prompts = [make.build(record, i) for i, record in enumerate(records)]
    settings = GenerationSettings(max_new_tokens=3, min_new_tokens=3)
    assert all(prompt.row is not None for prompt in prompts), [prompt.skip_detail for prompt in prompts]
    collator = evaluate.collator_for(processor, model.config)
    generator = Generator(model, processor.tokenizer, collator, settings)
    alone = [generator.generate([prompt])[0] for prompt in prompts]
    assert generator.generate(prompts) == alone


# ----- runs -----


def run_train(recipe: str, out: Path, cache: Path, *overrides: str) -> dict:
    args = [
        "--config",
        recipe,
        f"train.output_dir={out}",
        f"data.cache_dir={cache}",
        "data.num_samples=24",
        "data.eval_fraction=0.25",
        "data.num_workers=0",
        "packing.max_tokens=512",
        "kernels.mrope=unfused",
        "train.max_steps=2",
        "train.warmup_steps=1",
        "checkpoint.every_steps=1",
        "logging.every_steps=1",
        "logging.timing_warmup_steps=1",
        "logging.progress_bar=false",
        "logging.report_to=none",
        *overrides,
    ]
    try:
        return train.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """A 2-step full fine-tune of the tiny model with the in-training generation eval every step (wandb offline),
    image bounds set by the recipe (data.max_pixels), checkpoints and the export."""
    root = tmp_path_factory.mktemp("full")
    overrides = ["train.generate_every=1", "train.generate_samples=3", "train.generate_max_new_tokens=4"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        run_train(TINY, root / "run", root / "cache", "data.max_pixels=40000", "logging.report_to=wandb", *overrides)
    return root / "run"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    run_train(LORA, root / "run", root / "cache")
    return root / "run"


def generate_lines(run: Path, out: Path, *args: str) -> list[dict]:
    base = ["--run", str(run), "--data", "builtin", "--num-samples", "6", "--max-new-tokens", "4", "--out", str(out)]
    assert generate.main([*base, "--batch-size", "2", *args]) == 0
    return predictions.read_predictions(out)


def test_generate_writes_every_record_in_order_with_scores_and_a_summary(full_run, tmp_path):
    """scripts.generate on a full fine-tune's export: a line per held-out record in record order, each with the
    record's references and its scores, and a summary whose per-category table covers them; --compare-init puts the
    untrained model's scores beside."""
    out = tmp_path / "p.jsonl"
    lines = generate_lines(full_run, out, "--compare-init")
    assert [line["index"] for line in lines] == list(range(6))
    assert all(set(line["scores"]) == set(scoring.METRICS) for line in lines if not line.get("skipped"))
    summary = json.loads(predictions.summary_path(out).read_text())
    assert summary["records"] == 6 and sum(c["records"] for c in summary["by_category"].values()) == summary["scored"]
    assert summary["init"]["records"] == 6 and summary["checkpoint"] == "final"


def test_checkpoint_directory_gives_the_exports_answers(full_run, tmp_path):
    """The last training checkpoint (the model rebuilt as training builds it, its tensors loaded) answers exactly as
    the export of the same weights does."""
    final = generate_lines(full_run, tmp_path / "final.jsonl")
    latest = generate_lines(full_run, tmp_path / "latest.jsonl", "--checkpoint", "latest")
    assert [line.get("prediction") for line in latest] == [line.get("prediction") for line in final]


def test_lora_merged_export_adapter_and_checkpoint_agree(lora_run, tmp_path):
    """A LoRA run answers the same through its merged export, through its base plus the peft adapter, through an
    adapter-only export (lora.merge_on_export: false: final/ holds adapter/ and the processor) and through its last
    checkpoint (base + adapters built as training builds them)."""
    merged = generate_lines(lora_run, tmp_path / "merged.jsonl")
    adapter = generate_lines(lora_run, tmp_path / "adapter.jsonl", "--checkpoint", str(lora_run / "final" / "adapter"))
    adapter_only = tmp_path / "adapter-only-final"
    shutil.copytree(lora_run / "final", adapter_only, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    unmerged = generate_lines(lora_run, tmp_path / "unmerged.jsonl", "--checkpoint", str(adapter_only))
    latest = generate_lines(lora_run, tmp_path / "latest.jsonl", "--checkpoint", "latest")
    answers = [line.get("prediction") for line in merged]
    for lines in (adapter, unmerged, latest):
        assert [line.get("prediction") for line in lines] == answers


def as_sharded_checkpoint(checkpoint: Path, into: Path, drop: str | None = None) -> Path:
    """A copy of a one-process checkpoint in the layout an FSDP2 run saves (recipes/accelerate/fsdp2.yaml): the
    model state written by torch.distributed.checkpoint under pytorch_model_fsdp_0/ as {"model": state}, no
    model.safetensors; `drop` leaves that tensor out."""
    shutil.copytree(checkpoint, into, ignore=shutil.ignore_patterns(CHECKPOINT_MODEL_FILE))
    state = {key: value for key, value in load_file(checkpoint / CHECKPOINT_MODEL_FILE).items() if key != drop}
    dcp.save({"model": state}, checkpoint_id=str(into / CHECKPOINT_SHARDS_DIR), no_dist=True)
    return into


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_sharded_fsdp2_checkpoint_answers_as_the_export(full_run, lora_run, tmp_path, kind):
    """A checkpoint in the layout FSDP2 saves (the model state as DCP shards, no model.safetensors) is read through
    DCP and answers exactly as the run's export, for a full fine-tune and under LoRA (only the adapters and the fully
    trained parts in the shards); shards that lack one of the model's tensors are refused in one line naming it.
    tests/test_fsdp2_requeue.py reads the checkpoints two- and one-process FSDP2 runs really write."""
    run = full_run if kind == "full" else lora_run
    latest = latest_checkpoint(run)
    sharded = as_sharded_checkpoint(latest, tmp_path / "sharded")
    final = generate_lines(run, tmp_path / "final.jsonl")
    answers = generate_lines(run, tmp_path / "sharded.jsonl", "--checkpoint", str(sharded))
    assert [line.get("prediction") for line in answers] == [line.get("prediction") for line in final]
    saved = load_file(latest / CHECKPOINT_MODEL_FILE)
    loaded = load_run(run, str(sharded)).model.state_dict()
    assert all(torch.equal(loaded[key.removeprefix("model.")], value) for key, value in saved.items())
    dropped = next(iter(saved))
    torn = as_sharded_checkpoint(latest, tmp_path / "torn", drop=dropped)
    with pytest.raises(ConfigError, match=r"does not hold this run's model: 1 tensors missing") as refused:
        load_run(run, str(torn))
    assert dropped in str(refused.value) and "\n" not in str(refused.value)


def test_resume_continues_a_partial_file_without_duplicates(full_run, tmp_path):
    """A predictions file cut by a kill (two whole lines and half a third) continued with --resume ends equal to the
    uninterrupted file: every record once, in order. Without --resume or --overwrite an existing file is refused."""
    whole = tmp_path / "whole.jsonl"
    expected = generate_lines(full_run, whole)
    partial = tmp_path / "partial.jsonl"
    text = whole.read_text().splitlines(keepends=True)
    partial.write_text(text[0] + text[1] + text[2][:20])
    assert generate_lines(full_run, partial, "--resume") == expected
    assert generate.cli(["--run", str(full_run), "--out", str(partial)]).startswith("error: ")


def test_export_is_what_a_serving_engine_reads(full_run):
    """final/ loads with AutoModelForImageTextToText and AutoProcessor and generates; its processor resizes with the
    training's pixel bounds (data.max_pixels), its generation config stops at the chat template's turn end, and its
    chat template renders an image prompt."""
    final = full_run / "final"
    model = AutoModelForImageTextToText.from_pretrained(final)
    processor = AutoProcessor.from_pretrained(final)
    assert processor.image_processor.size["longest_edge"] == 40000
    eos = model.generation_config.eos_token_id
    assert processor.tokenizer.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (400, 400), "red")], return_tensors="pt")
    assert int(inputs["image_grid_thw"].prod()) * 14 * 14 <= 40000  # resized within the training bound
    out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_generation_eval_during_training_scores_held_out_answers(full_run):
    """train.generate_every=1 writes a record of held-out answer scores per step into metrics.jsonl (overall and per
    category), each step's answers into generations/ and a wandb Table of them per evaluation."""
    records = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    generated = [r for r in records if "gen_exact_match" in r]
    assert [r["step"] for r in generated] == [1, 2]
    assert all(0.0 <= r["gen_anls"] <= 1.0 and any(k.startswith("gen_exact_match/") for k in r) for r in generated)
    lines = predictions.read_predictions(full_run / "generations" / "step_00000002.jsonl")
    assert len(lines) == 3 and all("prediction" in line for line in lines)
    tables = sorted((full_run / "wandb").glob("offline-run-*/files/media/table/generations_*.table.json"))
    assert len(tables) == 2  # one wandb Table per evaluation
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == ["step", "id", "image", "question", "reference", "answer", "exact_match"]
    assert len(table["data"]) == 3


def test_pixel_override_that_differs_from_training_is_said(full_run, caplog):
    """An override of the run's pixel bounds that differs from training is logged in one line naming the key."""
    cfg = read_run_config(full_run)
    with caplog.at_level(logging.WARNING):
        assert data_settings(cfg, {"max_pixels": 20000, "min_pixels": None}).max_pixels == 20000
    assert [r.getMessage() for r in caplog.records if "max_pixels" in r.getMessage()]


def test_chat_answers_one_message_with_an_image(full_run, tmp_path, capsys):
    """scripts.chat --prompt answers one message whose image is given by its path, then exits 0."""
    image = tmp_path / "red.png"
    Image.new("RGB", (112, 112), "red").save(image)
    assert (
        chat.main(["--run", str(full_run), "--prompt", f"What colour is the circle? {image}", "--max-new-tokens", "3"])
        == 0
    )
    assert capsys.readouterr().out.strip()
    message, images, _ = chat.user_turn(f"Is {image} red?")
    assert [item["type"] for item in message["content"]] == ["text", "image", "text"] and len(images) == 1


def test_interactive_chat_keeps_the_conversation_until_quit(full_run, tmp_path, monkeypatch, capsys):
    """The interactive session answers each message with a prompt that holds the conversation so far, leaves an empty
    answer out of it, says so and goes on when an image is unreadable, starts again on /reset and ends on /quit."""
    image = tmp_path / "blue.png"
    Image.new("RGB", (112, 112), "blue").save(image)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    lines = iter([f"Colour? {image}", "And now?", "Empty?", f"This {tmp_path / 'broken.png'}", "/reset", "Hi", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    session = chat.Chat(chat_args(full_run))
    answers, prompts = iter(["Blue.", "Still blue.", "", "Hello."]), []
    session.generator.generate = lambda batch: prompts.append(batch[0]) or [next(answers)]
    chat.interactive(session)
    out = capsys.readouterr().out
    assert out.count("model> ") == 4 and "(not sent: corrupt_image" in out
    assert [p.prompt_text.count("user:") for p in prompts] == [1, 2, 3, 1]  # the empty answer's turn is not kept
    assert "assistant: Blue." in prompts[1].prompt_text and prompts[0].row["image_grid_thw"]
    assert len(prompts[2].row["image_grid_thw"]) == 1  # the first message's image stays in the conversation


def chat_args(run: Path):
    parser = __import__("argparse").ArgumentParser()
    generate.add_generation_args(parser)
    return parser.parse_args(["--run", str(run), "--max-new-tokens", "3"])


# ----- the smoke test's verdict -----


def test_answer_prior_and_the_seeing_verdict():
    """The prior answers each question with its most frequent training answer (a kind's for unseen questions); the
    verdict passes only when the trained model beats the prior by the margin on the image kinds, pooled."""
    record = lambda q, a: {
        "conversations": [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}],
        "image": "x.png",
    }
    train_records = [(record("Colour?", "Red."), "color")] * 2 + [(record("Colour?", "Blue."), "color")]
    prior = builtin_eval.AnswerPrior.fit(train_records)
    assert prior.predict("user: <image> \nColour?", "color") == "Red."
    assert prior.predict("user: <image> \nUnseen?", "color") == "Red."
    rows = [
        {"index": i, "category": "color", "prompt": "user: <image> \nColour?", "references": [ref], "scores": {
            "exact_match": float(i < 3)}}
        for i, ref in enumerate(["Blue.", "Green.", "Red.", "Blue."])
    ]  # fmt: skip
    table = builtin_eval.kind_table(rows, prior)
    assert table["image kinds"].trained == 0.75 and table["image kinds"].prior == 0.25
    assert builtin_eval.sees(table, 0.4)[0] and not builtin_eval.sees(table, 0.6)[0]


# ----- several processes, stops -----


def launch(args: list[str], processes: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", f"--num_processes={processes}"]
    command += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", "-m", "scripts.generate", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, timeout=600)


@pytest.mark.slow
def test_two_processes_write_what_one_process_writes(full_run, tmp_path):
    """accelerate launch with two gloo processes deals the records by rank and writes the file a single process
    writes: the same lines, in record order."""
    one = generate_lines(full_run, tmp_path / "one.jsonl")
    args = ["--run", str(full_run), "--data", "builtin", "--num-samples", "6", "--max-new-tokens", "4"]
    done = launch([*args, "--batch-size", "2", "--out", str(tmp_path / "two.jsonl")], 2)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert predictions.read_predictions(tmp_path / "two.jsonl") == one


@pytest.mark.slow
def test_sigterm_keeps_the_lines_written_and_resume_finishes(full_run, tmp_path):
    """SIGTERM mid-run stops after the batch in flight with exit status 75 and every line so far kept; --resume then
    finishes the file equal to an uninterrupted run's."""
    expected = generate_lines(full_run, tmp_path / "whole.jsonl", "--num-samples", "24")
    out = tmp_path / "stopped.jsonl"
    args = ["--run", str(full_run), "--data", "builtin", "--num-samples", "24", "--max-new-tokens", "4"]
    args += ["--batch-size", "1", "--out", str(out)]
    process = subprocess.Popen([sys.executable, "-m", "scripts.generate", *args], cwd=ROOT, stderr=subprocess.PIPE)
    while not (out.exists() and out.read_text().count("\n") >= 2):
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 75
    kept = predictions.read_predictions(out)
    assert 2 <= len(kept) < 24 and kept == expected[: len(kept)]
    assert generate_lines(full_run, out, "--num-samples", "24", "--resume") == expected


def test_unknown_run_directory_is_one_line():
    """A directory that is not a run is a one-line error, not a traceback."""
    assert generate.cli(["--run", "/nonexistent-run"]).startswith("error: ")
    assert issubclass(EvalDataError, DataError)


FSDP2_GENERATION_WORKER = """
import dataclasses, json, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from core.config import load_config
from core.config_tree import ConfigError
from data.pipeline import build_data, load_processor
from core.families import hf_config
from inference import evaluate
from inference.generation import GenerationSettings, Generator
from modeling.build import build_model
from modeling.packed import enable_packed_forward
from trainer.step import TrainModule

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = load_config({recipe!r}, {overrides!r})
processor = load_processor(cfg.model, cfg.data)
pack = next(iter(build_data(cfg.data, cfg.packing, processor, hf_config(cfg.model), rank, 2)[0]))

def train_module():
    model = build_model(dataclasses.replace(cfg.model, dtype="float32"), seed=0)
    enable_packed_forward(model)
    return TrainModule(model)

reference, sharded = train_module(), train_module()
for unit in [m for m in sharded.modules() if type(m).__name__ in sharded._no_split_modules]:
    fully_shard(unit)
fully_shard(sharded)
sharded(pack).backward()  # a training step's forward first, as in a run
records, root, data = evaluate.open_eval_records(cfg.data, "builtin", 6, None, None)
builder = evaluate.prompt_builder_for(processor, reference.model.config, data, root)
prompts = [p for p in (builder.build(records[i], i) for i in range(len(records))) if p.row is not None]
collator = evaluate.collator_for(processor, reference.model.config)
settings = GenerationSettings(max_new_tokens=6)
answers = []
for start in range(0, len(prompts), 3):  # the last batch is shorter: the ranks still agree on every forward
    generator = Generator(sharded.model, processor.tokenizer, collator, settings, synced=True, root=sharded)
    answers += generator.generate(prompts[start : start + 3])
expected = Generator(reference.model, processor.tokenizer, collator, settings).generate(prompts)
print("RESULT " + json.dumps(dict(rank=rank, same=answers == expected, count=len(answers))), flush=True)
"""


@pytest.mark.slow
def test_fsdp2_ranks_generate_together_what_one_unsharded_model_generates(tmp_path):
    """Under FSDP2 (per-layer shards and the root over gloo, after a training forward), every rank generating the
    same prompts with synced_gpus completes (each forward all-gathers on both ranks, the root's own parameters
    gathered around generate) and answers exactly what one unsharded copy of the model answers."""
    from tests.test_distributed import WORKER_EXIT, run_processes

    overrides = [f"data.cache_dir={tmp_path / 'cache'}", "data.num_samples=16", "data.num_workers=0"]
    overrides += ["packing.max_tokens=512", "kernels.mrope=unfused"]
    worker = tmp_path / "fsdp2_generate.py"
    script = FSDP2_GENERATION_WORKER.format(root=str(ROOT), recipe=str(ROOT / TINY), overrides=overrides)
    worker.write_text(script + WORKER_EXIT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    output = run_processes(command, tmp_path / "fsdp2.log", "FSDP2 generation")
    results = [json.loads(match) for match in re.findall(r"RESULT (\{[^{}]*\})", output)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["same"] and r["count"] >= 4 for r in results), results
