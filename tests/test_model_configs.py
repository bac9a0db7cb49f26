"""The shipped model configs (recipes/models/*.json) and how a recipe names its model: each real recipe builds at
the published size with no download, trains on the built-in data through the tiny processor's token ids, and loads
real weights when model.name_or_path is given, refusing a checkpoint that is another model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.config import load_config
from core.config_tree import ConfigError
from core.families import ARCHITECTURE_FIELDS, hf_config, recipe_model_config
from core.special_tokens import IMAGE_TOKEN_ID, TINY_CONFIG_TOKEN_IDS, TINY_TEXT_CONFIG_TOKEN_IDS
from modeling.build import build_model

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "recipes/smoke.yaml"
# Parameters of each published checkpoint (Hugging Face's safetensors count; Qwen3.5's include its
# multi-token-prediction head, `mtp.*`, which transformers does not build: `mtp_head_params` adds it back).
PUBLISHED_PARAMS = {
    "qwen2_5_vl-3b": 3.75e9,  # Qwen/Qwen2.5-VL-3B-Instruct
    "qwen2_5_vl-7b": 8.29e9,  # Qwen/Qwen2.5-VL-7B-Instruct
    "qwen3_vl-2b": 2.13e9,  # Qwen/Qwen3-VL-2B-Instruct
    "qwen3_vl-8b": 8.77e9,  # Qwen/Qwen3-VL-8B-Instruct
    "qwen3_5-2b": 2.27e9,  # Qwen/Qwen3.5-2B
    "qwen3_5-9b": 9.65e9,  # Qwen/Qwen3.5-9B
    "qwen3_5-35b_a3b": 35.95e9,  # Qwen/Qwen3.5-35B-A3B
}
REAL_RECIPES = sorted(PUBLISHED_PARAMS)


def mtp_head_params(model: torch.nn.Module) -> int:
    """A Qwen3.5 checkpoint's multi-token-prediction head, as published: one full-attention decoder layer, a
    (2H → H) projection of [embedding; hidden state] and three norms. 0 for the other families."""
    text = model.config.text_config
    if "qwen3_5" not in model.config.model_type:
        return 0
    layers = model.model.language_model.layers
    full = next(layer for layer, kind in zip(layers, text.layer_types, strict=True) if kind == "full_attention")
    return sum(p.numel() for p in full.parameters()) + 2 * text.hidden_size**2 + 3 * text.hidden_size


def test_every_real_recipe_ships_its_model_config():
    """recipes/models holds one config per real recipe, and each real recipe random-inits from it (no
    model.name_or_path, so nothing is downloaded) and says how to load the real weights."""
    assert sorted(p.stem for p in (ROOT / "recipes/models").glob("*.json")) == REAL_RECIPES
    for name in REAL_RECIPES:
        cfg = load_config(f"recipes/{name}.yaml")
        assert cfg.model.name_or_path is None and cfg.model.config == {"base": f"recipes/models/{name}.json"}
        text = (ROOT / f"recipes/{name}.yaml").read_text()
        assert "model.name_or_path=Qwen/" in text and "GPU memory" in text and "accelerate launch" in text


@pytest.mark.parametrize("name", REAL_RECIPES)
def test_shipped_config_builds_at_the_published_size(name):
    """Each shipped config builds on the meta device (no memory, no download) to within 2% of its published
    checkpoint's parameter count; a tied lm_head stays tied."""
    raw = json.loads((ROOT / f"recipes/models/{name}.json").read_text())
    with torch.device("meta"):
        model = build_model(load_config(f"recipes/{name}.yaml").model)
    built = sum(p.numel() for p in model.parameters()) + mtp_head_params(model)
    assert built == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied is raw["tie_word_embeddings"] is raw["text_config"]["tie_word_embeddings"]


def test_a_random_init_without_a_processor_takes_the_tiny_tokenizers_ids():
    """With neither a checkpoint nor a processor the data go through the built-in tiny processor, so the config
    takes its special-token ids and keeps the published vocabulary; with a processor named, the published ids stay."""
    published = json.loads((ROOT / "recipes/models/qwen2_5_vl-3b.json").read_text())
    cfg = load_config("recipes/qwen2_5_vl-3b.yaml")
    config = hf_config(cfg.model)
    assert {key: getattr(config, key) for key in TINY_CONFIG_TOKEN_IDS} == TINY_CONFIG_TOKEN_IDS
    assert {key: getattr(config.text_config, key) for key in TINY_TEXT_CONFIG_TOKEN_IDS} == TINY_TEXT_CONFIG_TOKEN_IDS
    assert config.text_config.vocab_size == published["text_config"]["vocab_size"]
    named = hf_config(load_config("recipes/qwen2_5_vl-3b.yaml", ["model.processor=/some/processor"]).model)
    assert named.image_token_id == published["image_token_id"] != IMAGE_TOKEN_ID


def test_real_size_recipe_collates_the_builtin_data_offline(tmp_path):
    """A real recipe as shipped reads the built-in data through the tiny processor with no download: its packs
    hold image tokens with the model config's image id, positioned by the model's own rope index."""
    from data.pipeline import build_data, load_processor

    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=12", "data.eval_fraction=0", "train.eval_every=0"]
    cfg = load_config("recipes/qwen3_vl-2b.yaml", [*overrides, "data.video_share=0", "packing.max_tokens=4096"])
    config = hf_config(cfg.model)
    train_loader, _, stats = build_data(cfg.data, cfg.packing, load_processor(cfg.model, cfg.data), config)
    batch = next(iter(train_loader))
    assert stats.kept_train == 12 and batch["num_image_tokens"] > 0
    assert int((batch["input_ids"] == config.image_token_id).sum()) == batch["num_image_tokens"]
    assert batch["label_rows"].numel() == batch["num_label_tokens"] > 0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("recipes/models/no-such.json", "no file recipes/models/no-such.json"),
        ({"base": "recipes/models/no-such.json"}, "no file"),
        ({"base": 3}, "model.config.base must be a path"),
        ({"model_type": "llama"}, "model_type must be one of"),
    ],
)
def test_a_bad_model_config_fails_at_load_naming_the_key(config, message):
    """A missing or malformed model.config is a ConfigError when the recipe loads, saying what to write."""
    with pytest.raises(ConfigError, match=message):
        load_config(SMOKE, [f"model.config={json.dumps(config)}"])


def test_a_field_override_of_a_config_given_as_a_path_says_to_use_base(tmp_path):
    """A dotted override of one field replaces a model.config written as a bare path (YAML merges mappings only):
    the error says to write {base: <file>}, which the shipped recipes do."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {config: recipes/models/qwen2_5_vl-3b.json}\n")
    assert load_config(str(recipe)).model.config == "recipes/models/qwen2_5_vl-3b.json"
    with pytest.raises(ConfigError, match=r"has no model_type and no base: <file>.*write it as \{base: <file>\}"):
        load_config(str(recipe), ["model.config.text_config.num_hidden_layers=2"])


def test_a_file_that_is_not_json_is_named(tmp_path):
    broken = tmp_path / "config.json"
    broken.write_text("{model_type: qwen2_5_vl")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_config(SMOKE, [f"model.config={broken}"])


def test_base_merges_the_recipes_fields_over_the_file():
    """{base: file, ...}: the file's config with the mapping's fields merged over it (nested mappings merge), as a
    benchmark shape reduces the published depth; dotted overrides merge the same way."""
    raw = recipe_model_config(load_config("recipes/bench-qwen2_5_vl-3b-shape.yaml").model.config)
    published = recipe_model_config("recipes/models/qwen2_5_vl-3b.json")
    assert raw["text_config"] == {**published["text_config"], "num_hidden_layers": 18}
    assert raw["vision_config"]["depth"] == 8 and raw["vision_config"]["hidden_size"] == 1280
    cfg = load_config("recipes/qwen2_5_vl-7b.yaml", ["model.config.text_config.num_hidden_layers=4"])
    assert recipe_model_config(cfg.model.config)["text_config"]["num_hidden_layers"] == 4


def test_a_checkpoint_loads_with_its_recipes_config_and_another_model_is_refused(tmp_path):
    """model.name_or_path beside model.config: the checkpoint's own config is used when it is the model the recipe
    describes (token ids may differ), and a checkpoint of another architecture is a ConfigError naming the fields."""
    tiny = load_config("recipes/tiny-qwen2_5_vl.yaml").model
    checkpoint = tmp_path / "checkpoint"
    published_ids = {**hf_config(tiny).to_dict(), "image_token_id": 151655}
    published_ids.pop("model_type")
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2_5_vl", **published_ids).save_pretrained(checkpoint)
    same = hf_config(load_config("recipes/tiny-qwen2_5_vl.yaml", [f"model.name_or_path={checkpoint}"]).model)
    assert same.image_token_id == 151655
    wider = ["model.config.text_config.hidden_size=128", "model.config.vision_config.depth=3"]
    other = load_config("recipes/tiny-qwen2_5_vl.yaml", [f"model.name_or_path={checkpoint}", *wider]).model
    with pytest.raises(ConfigError, match=r"text_config.hidden_size: 64 in the checkpoint, 128 here") as error:
        hf_config(other)
    assert "vision_config.depth" in str(error.value) and "model.config=null" in str(error.value)
    assert set(ARCHITECTURE_FIELDS) == {"", "text_config", "vision_config"}


def test_neither_a_config_nor_a_checkpoint_is_refused():
    with pytest.raises(ConfigError, match=r"set model\.config"):
        load_config(SMOKE, ["model.config=null"])
