"""The recipe schema and the CLI: unknown keys name the nearest valid key, bad values and contradictory
combinations fail with how to fix them, and the resolved config round-trips through the run directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import train
from core.config import load_config, save_config
from core.config_tree import ConfigError

SMOKE = "recipes/smoke.yaml"


@pytest.mark.parametrize(
    ("override", "nearest"),
    [
        ("train.max_step=5", "train.max_steps"),
        ("trian.lr=0.1", "train"),
        ("logging.report=none", "logging.report_to"),
        ("checkpoint.resum=latest", "checkpoint.resume"),
        ("kernels.mrop=fused", "kernels.mrope"),
    ],
)
def test_unknown_key_names_the_nearest_valid_key(override, nearest):
    """A misspelt key is an error whose message suggests the key that was meant."""
    with pytest.raises(ConfigError, match=f"Did you mean '{nearest}'"):
        load_config(SMOKE, [override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr=-1", "train.lr must be > 0"),
        ("train.max_steps=0", "train.max_steps must be >= 1"),
        ("train.min_lr_ratio=2", r"train.min_lr_ratio must be in \[0, 1\]"),
        ("train.max_grad_norm=-1", "train.max_grad_norm must be >= 0"),
        ("train.lr=fast", "train.lr' expects float"),
        ("kernels.mrope=fastest", "must be one of"),
        ("logging.report_to=tensorboard", "must be one of"),
        ("logging.every_steps=0", "logging.every_steps must be >= 1"),
        ("logging.peak_tflops=0", "logging.peak_tflops must be > 0"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1"),
        ("model.freeze_vision=maybe", "expects true or false"),
        ("train.max_steps", "dotted.key=value"),
        ("train.lr=nan", "'train.lr' must be a finite number"),
        ("train.lr=.inf", "'train.lr' must be a finite number"),
        ("train.lr=-inf", "'train.lr' must be a finite number"),
        ("train.max_grad_norm=nan", "'train.max_grad_norm' must be a finite number"),
        ("train.adam_betas=[0.9, .nan]", r"'train.adam_betas\[1\]' must be a finite number"),
        ("train.adam_betas=[0.9, 1.5]", r"train.adam_betas must each be in \[0, 1\)"),
        ("logging.peak_tflops=inf", "'logging.peak_tflops' must be a finite number"),
        ("packing.vision_cost_weight=-1", "packing.vision_cost_weight must be >= 0"),
        ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
        ("train.seed=-1", r"train.seed must be in \[0, 2\*\*32\)"),
        ("data.seed=4294967296", r"data.seed must be in \[0, 2\*\*32\)"),
        ("data.max_pixels=0", "data.max_pixels must be >= 1"),
        ("model.config.text_config.rms_norm_eps=.nan", "'model.config.text_config.rms_norm_eps' must be a finite"),
    ],
)
def test_bad_values_fail_clearly(override, message):
    """Out-of-range, non-finite or mistyped values are ConfigErrors that name the field."""
    with pytest.raises(ConfigError, match=message):
        load_config(SMOKE, [override])


def test_cross_field_checks_say_how_to_fix():
    """Contradictory sections fail with the settings that resolve them."""
    with pytest.raises(ConfigError, match=re.escape("set data.eval_fraction > 0")):
        load_config(SMOKE, ["data.eval_fraction=0", "train.eval_every=10"])
    with pytest.raises(ConfigError, match=re.escape("train.lr_vision=null or model.freeze_vision=false")):
        load_config(SMOKE, ["model.freeze_vision=true", "train.lr_vision=1e-5"])
    with pytest.raises(ConfigError, match="nothing would train"):
        load_config(SMOKE, ["model.freeze_vision=true", "model.freeze_merger=true", "model.freeze_llm=true"])
    with pytest.raises(ConfigError, match=re.escape("set model.config (a random init")):
        load_config(SMOKE, ["model.config=null"])


def test_overrides_reach_nested_model_config():
    """Dotted overrides go into the free-form Hugging Face config (e.g. a benchmark's depth)."""
    cfg = load_config(SMOKE, ["model.config.text_config.num_hidden_layers=3", "train.lr=3e-4"])
    assert cfg.model.config["text_config"]["num_hidden_layers"] == 3
    assert cfg.model.config["text_config"]["hidden_size"] == 128  # siblings kept
    assert cfg.train.lr == 3e-4


def test_resolved_config_round_trips(tmp_path):
    """The config.yaml written into a run directory loads back to the same config."""
    cfg = load_config(SMOKE, ["train.max_steps=7", "logging.tags=[a,b]"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")) == cfg


def test_cli_parses_config_overrides_and_resume():
    """`train.py --config PATH k=v ... --resume`: overrides keep their order; --resume is a flag."""
    args = train.parse_args(["--config", SMOKE, "train.max_steps=5", "logging.report_to=none", "--resume"])
    assert (args.config, args.overrides, args.resume) == (SMOKE, ["train.max_steps=5", "logging.report_to=none"], True)
    with pytest.raises(SystemExit):
        train.parse_args(["train.max_steps=5"])  # --config is required


@pytest.mark.parametrize(
    ("text", "position", "problem"),
    [
        ("train: {max_steps: 3, lr: [1, 2}\n", "2:32", "expected ',' or ']', but got '}'"),
        ("model:\n  dtype: bfloat16\n dtype: float32\n", "4:2", "expected <block end>"),
        ("train:\n\tmax_steps: 3\n", "3:1", "found character '\\t' that cannot start any token"),
    ],
)
def test_a_recipe_that_is_not_valid_yaml_is_one_line_with_file_line_and_column(tmp_path, text, position, problem):
    """A YAML syntax error (a flow list left open, a bad indent, a tab) is a ConfigError of one line naming the file,
    the line and column as an editor counts them (from 1), and the parser's problem."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("# a recipe\n" + text)
    line, column = position.split(":")
    with pytest.raises(ConfigError) as error:
        load_config(str(recipe))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"recipe {recipe}:{int(line)}:{column} is not valid YAML: {problem}")


def test_train_py_prints_a_bad_recipe_and_a_bad_override_as_one_line(tmp_path):
    """`python train.py` on an invalid recipe exits 1 with one line on stderr and no traceback; an override that is
    not a YAML value is one line from train.cli too."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  dtype: bfloat16\ntrain: {max_steps: 3, lr: [1, 2}\n")
    command = [sys.executable, "train.py", "--config", str(recipe)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        f"config error: recipe {recipe}:3:32 is not valid YAML: expected ',' or ']', but got '}}' (while parsing a "
        "flow sequence)."
    )
    message = train.cli(["--config", SMOKE, "train.lr=[1,"])
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("config error: override 'train.lr=[1,' is not a valid YAML value: ")


# What `train.py --help` and a recipe mistake must not wait for: each of these takes seconds to import on two cores
HEAVY_LIBRARIES = ("torch", "transformers", "accelerate", "datasets")
# train.py run as a user runs it (as __main__, arguments after the code), then which of `names` it imported, on one
# stderr line "imported: ..."
LAUNCH_REPORTING_IMPORTS = (
    "import runpy, sys\n"
    "sys.argv = ['train.py', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_path('train.py', run_name='__main__')\n"
    "finally:\n"
    "    print('imported:', *sorted(name for name in {names!r} if name in sys.modules), file=sys.stderr)\n"
)


@pytest.mark.parametrize(
    ("args", "status", "answer"),
    [
        (["--help"], 0, "usage: train.py"),
        (["--config", SMOKE, "trian.max_steps=3"], 1, "config error: unknown key 'trian'. Did you mean 'train'?"),
        (["--config", "{typo}"], 1, "config error: unknown key 'train.max_step'. Did you mean 'train.max_steps'?"),
    ],
    ids=["help", "override-typo", "recipe-typo"],
)
def test_help_and_a_recipe_mistake_answer_before_the_heavy_imports(args, status, answer, tmp_path):
    """train.py run as a user runs it answers --help, a mistyped override and a mistyped recipe key (the config read
    and validated) without importing torch, transformers, accelerate or datasets: what keeps each answer at about a
    second (docs/performance.md)."""
    recipe = tmp_path / "typo.yaml"
    recipe.write_text((Path(train.__file__).parent / SMOKE).read_text().replace("  max_steps: 300", "  max_step: 300"))
    args = [arg.format(typo=recipe) for arg in args]
    child = LAUNCH_REPORTING_IMPORTS.format(names=HEAVY_LIBRARIES)
    root = Path(train.__file__).parent
    result = subprocess.run([sys.executable, "-c", child, *args], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == status, result.stderr
    assert answer in result.stdout + result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("imported:")] == ["imported:"], result.stderr
