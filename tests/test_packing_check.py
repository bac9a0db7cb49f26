"""The packing check (verification/packing_check.py) catches small errors: a pack with one sample boundary moved by
one token, or with one token's positions shifted by one, fails it, in fp32 and, for a bf16 model, through the bf16
rule's fp32 copy (judged at the fp32 tolerance however large bf16's rounding is). Each test first shows the same
pack, unbroken, passing, so a failure comes from the one broken token alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from modeling.packed import enable_packed_forward
from tests.tiers import tiered
from verification.packing_check import RELATIVE_TOLERANCE, SampleSpec, compare_packed_to_per_sample, pack_samples

# Three text samples (the middle one with an image) longer than one token on each side of every boundary
PACK = (SampleSpec(8), SampleSpec(3, ((4, 4),), text_after=5), SampleSpec(8))
BOUNDARY = 1  # the boundary between samples 0 and 1
SHIFTED_TOKEN = 3  # a text token of sample 2, counted from its start
FAMILIES = tiered(("qwen2_5_vl", "qwen3_5", "qwen3_vl_moe"), fast=("qwen2_5_vl",))
DTYPES = ("float32", "bfloat16")
SHIFTS = tiered((1, -1), fast=(1,))


def with_boundary_moved(batch: dict, boundary: int, by: int) -> dict:
    """`batch` with sample boundary `boundary` (an index into cu_seqlens) moved by `by` tokens, lengths to match."""
    lengths = list(batch["sample_lengths"])
    lengths[boundary - 1] += by
    lengths[boundary] -= by
    return {
        **batch,
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "sample_lengths": lengths,
    }


def with_positions_shifted(batch: dict, token: int, by: int) -> dict:
    """`batch` with the mRoPE positions (rows 1-3) of the pack's token `token` shifted by `by`."""
    positions = batch["position_ids"].clone()
    positions[1:, 0, token] += by
    return {**batch, "position_ids": positions}


def failures(model, samples, batch) -> list[str]:
    dtype = next(model.parameters()).dtype
    return compare_packed_to_per_sample(model, samples, batch).failures(RELATIVE_TOLERANCE[dtype])


_prepared: dict[tuple[str, str], tuple] = {}  # one model per family and dtype for the whole module


@pytest.fixture
def packed_model(tiny_model, tiny_samples):
    """`packed_model(family, dtype)`: a tiny model with packed forward, the samples of PACK and their pack, which
    passes the check unbroken (checked once per family and dtype)."""

    def build(family: str, dtype: str):
        if (family, dtype) not in _prepared:
            model = tiny_model(family, dtype=dtype)
            enable_packed_forward(model)
            samples = tiny_samples(model, PACK)
            batch = pack_samples(model, samples)
            assert not failures(model, samples, batch), "the unbroken pack must pass"
            _prepared[family, dtype] = model, samples, batch
        return _prepared[family, dtype]

    return build


def assert_caught(found: list[str], dtype: str) -> None:
    assert found, "the check passed a broken pack"
    if dtype != "float32":  # the bf16 rule: the fp32 copy's packed vs per-sample runs see the error at fp32 tolerance
        assert any(line.startswith("fp32 copy, ") for line in found), found


@pytest.mark.parametrize("by", SHIFTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_boundary_moved_by_one_token_fails(packed_model, family, dtype, by):
    """A pack whose boundary between two samples sits one token late (or early) leaks one token across samples:
    the check must fail, in fp32 and in bf16 through the fp32 copy."""
    model, samples, batch = packed_model(family, dtype)
    assert_caught(failures(model, samples, with_boundary_moved(batch, BOUNDARY, by)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_positions_shifted_by_one_fail(packed_model, family, dtype):
    """A pack whose one text token carries mRoPE positions one too high rotates that token's queries and keys by one
    position too many: the check must fail, in fp32 and in bf16 through the fp32 copy."""
    model, samples, batch = packed_model(family, dtype)
    token = batch["sample_lengths"][0] + batch["sample_lengths"][1] + SHIFTED_TOKEN
    assert_caught(failures(model, samples, with_positions_shifted(batch, token, 1)), dtype)
