"""trainer/defaults.py: a recipe's `auto` settings become the fast path on a CUDA machine (compile, bf16 compute
weights on one GPU, loader workers sized from the cores) and stay light on the CPU; explicit settings are kept."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from core.config import load_config
from data.pipeline import default_loader_workers
from trainer import defaults

TINY = "recipes/tiny-qwen2_5_vl.yaml"


def launch(device: str, processes: int = 1, kind: DistributedType = DistributedType.NO) -> SimpleNamespace:
    """What `resolve` reads of an Accelerator: the device, the process count and the distributed type."""
    return SimpleNamespace(device=SimpleNamespace(type=device), num_processes=processes, distributed_type=kind)


def resolved(accelerator, *overrides: str):
    return defaults.resolve(load_config(TINY, ["model.dtype=bfloat16", *overrides]), accelerator)


def test_unset_settings_default_to_auto():
    """The schema's defaults are the resolved ones: train.compile and train.master_weights auto, data.num_workers
    null (sized from the machine)."""
    cfg = load_config(TINY)
    assert (cfg.train.compile, cfg.train.master_weights, cfg.data.num_workers) == ("auto", "auto", None)


def test_one_cuda_process_gets_the_fast_path(monkeypatch, caplog):
    """One CUDA process in bf16: compiled blocks, bf16 compute weights with fp32 masters in the optimizer, and loader
    workers from the cores; each choice is logged with its reason."""
    monkeypatch.setattr(defaults, "cpu_cores", lambda: 16)
    with caplog.at_level(logging.INFO, logger=defaults.__name__):
        cfg = resolved(launch("cuda"))
    assert (cfg.train.compile, cfg.train.master_weights, cfg.data.num_workers) == (True, "optimizer", 8)
    assert "train.compile=auto -> true (CUDA)" in caplog.text
    assert "train.master_weights=auto -> optimizer (one CUDA process, bfloat16)" in caplog.text
    assert "data.num_workers=null -> 8" in caplog.text


@pytest.mark.parametrize(
    ("accelerator", "overrides", "why"),
    [
        (launch("cuda", 2, DistributedType.FSDP), (), "FSDP2 computes in bf16 on fp32 masters itself"),
        (launch("cuda", 2, DistributedType.MULTI_GPU), (), "DDP"),
        (launch("cuda"), ("model.dtype=float32",), "model.dtype=float32"),
        (launch("cpu"), (), "no CUDA"),
    ],
    ids=["fsdp2", "ddp", "float32", "cpu"],
)
def test_master_weights_stay_in_the_module_where_optimizer_mode_does_not_apply(accelerator, overrides, why, caplog):
    """FSDP2 (its own mixed precision), DDP (which would reduce bf16 gradients in bf16), float32 and the CPU keep
    fp32 module weights; compile still follows the device."""
    with caplog.at_level(logging.INFO, logger=defaults.__name__):
        cfg = resolved(accelerator, *overrides)
    assert cfg.train.master_weights == "module" and why in caplog.text
    assert cfg.train.compile is (accelerator.device.type == "cuda")


def test_the_cpu_runs_eager_and_collates_inline():
    """Without CUDA: no compile (inductor would outlast a CPU run), module weights, batches collated inline."""
    cfg = resolved(launch("cpu"))
    assert (cfg.train.compile, cfg.train.master_weights, cfg.data.num_workers) == (False, "module", 0)


def test_explicit_settings_are_kept_and_nothing_is_logged(caplog):
    """A recipe or override that sets the keys gets exactly those values, with no resolution logged."""
    overrides = (
        "train.compile=false",
        "train.master_weights=module",
        "data.num_workers=3",
        "kernels.attention=fa2",
        "train.fp8=false",
    )
    cfg = load_config(TINY, list(overrides))
    with caplog.at_level(logging.INFO, logger=defaults.__name__):
        assert defaults.resolve(cfg, launch("cuda")) is cfg
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("on_cuda", "cores", "processes", "workers"),
    [(True, 16, 1, 8), (True, 16, 2, 7), (True, 64, 8, 7), (True, 4, 2, 1), (True, 2, 8, 1), (False, 64, 1, 0)],
)
def test_loader_workers_leave_a_core_per_training_process(on_cuda, cores, processes, workers):
    """With CUDA: min(8, cores per local process - 1), at least one; without: 0 (inline)."""
    assert default_loader_workers(on_cuda, cores, processes) == workers
