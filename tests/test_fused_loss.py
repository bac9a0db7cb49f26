"""trainer/loss.py's fused lm_head + cross-entropy against the unfused F.linear + F.cross_entropy, alone and inside
TrainModule on the tiny models."""

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from core.families import MODEL_TYPES
from data.collate import VISION_INPUTS, label_rows
from modeling.loss_kernel import cross_entropy_grad_
from modeling.packed import enable_packed_forward
from tests.tiers import tiered
from trainer import loss, step
from trainer.loss import linear_cross_entropy
from verification.packing_check import SampleSpec, pack_samples

IGNORE_INDEX = -100
FAMILY_NAMES = MODEL_TYPES  # every family of the registry, so a new one cannot be missed
GRAD_SCALE = 0.37  # the step multiplies the summed loss by world size / label count, never exactly 1


def unfused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference: nn.Linear's matmul, then the summed cross-entropy of the fp32 logits."""
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def problem(rows: int, hidden_size: int = 24, vocab: int = 97, seed: int = 0):
    """fp32 hidden (rows, H), weight (V, H), labels (rows,) with every third and rows 8..15 ignored (a whole chunk
    when chunks are 8 rows)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.3
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::3] = IGNORE_INDEX
    labels[8:16] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels, grad_hidden=True, grad_weight=True, **kwargs):
    """fn's loss and the gradients of (GRAD_SCALE · loss) w.r.t. fresh leaf copies of hidden / weight (None where
    not asked); the inputs are checked unmodified."""
    h = hidden.clone().requires_grad_(grad_hidden)
    w = weight.clone().requires_grad_(grad_weight)
    y = labels.clone()
    value = fn(h, w, y, **kwargs)
    (value * GRAD_SCALE).backward()
    for original, passed in zip((hidden, weight, labels), (h, w, y)):
        assert torch.equal(original, passed.detach())
    return value.detach(), h.grad, w.grad


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6, name: str = ""):
    """max |actual - expected| ≤ rel · max |expected|: relative to the tensor's scale, as fp32 summation order
    moves entries near zero by more than their own magnitude."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
    error, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert error <= rel * scale, f"{name}: max error {error:.3g} > {rel:g} x max |expected| {scale:.3g}"


@pytest.mark.parametrize("rows", [1, 23, 37])
@pytest.mark.parametrize("chunk_rows", [1, 8, 64, None])
def test_fp32_equals_unfused(rows, chunk_rows):
    """In fp32, for odd row counts and chunks that do not divide them (one row, several, more than there are),
    loss and both gradients equal the unfused ones to fp32 rounding; ignored rows (whole chunks of them too) get
    an exactly zero gradient."""
    hidden, weight, labels = problem(rows)
    expected = loss_and_grads(unfused, hidden, weight, labels)
    actual = loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_rows=chunk_rows)
    for a, e in zip(actual, expected):
        assert_relative(a, e)
    assert torch.count_nonzero(actual[1][labels == IGNORE_INDEX]) == 0


def test_all_labels_ignored():
    """A pack without a single label: loss 0, zero gradients."""
    hidden, weight, labels = problem(12)
    value, grad_hidden, grad_weight = loss_and_grads(
        linear_cross_entropy, hidden, weight, torch.full_like(labels, IGNORE_INDEX), chunk_rows=5
    )
    assert value.item() == 0.0
    assert torch.count_nonzero(grad_hidden) == 0 and torch.count_nonzero(grad_weight) == 0


@pytest.mark.parametrize("chunk_rows", [1, 8, None])
@pytest.mark.parametrize("labelled", ["some", "none"])
def test_labelled_rows_only_equal_every_row_bit_for_bit(chunk_rows, labelled):
    """Given the labelled rows (planned on the host), the lm_head multiplies only those, and in fp32 on the CPU the
    loss equals the one over every row bit for bit, and so do both gradients when the rows are one chunk (over
    several, the chunks' matmuls hold other rows: fp32 rounding); with no labelled row at all: loss 0 and zero
    gradients, no NaN."""
    hidden, weight, labels = problem(37)
    if labelled == "none":
        labels = torch.full_like(labels, IGNORE_INDEX)
    rows = label_rows(labels)
    every = loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_rows=chunk_rows)
    only = loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_rows=chunk_rows, rows=rows)
    assert torch.equal(only[0], every[0])
    for a, e in zip(only[1:], every[1:]):
        if chunk_rows is None:
            assert torch.equal(a, e)
        else:
            assert_relative(a, e)
    assert torch.isfinite(only[0]) and torch.count_nonzero(only[1][labels == IGNORE_INDEX]) == 0
    if labelled == "none":
        assert only[0].item() == 0.0 and not only[1].any() and not only[2].any()


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_frozen_input_gets_no_gradient(frozen):
    """A frozen lm_head (or hidden states that need no gradient) gets none, and the other gradient is unchanged."""
    hidden, weight, labels = problem(29)
    wants = {"grad_hidden": frozen != "hidden", "grad_weight": frozen != "weight"}
    expected = loss_and_grads(unfused, hidden, weight, labels, **wants)
    actual = loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_rows=8, **wants)
    assert_relative(actual[0], expected[0])
    frozen_index = 2 if frozen == "weight" else 1
    assert actual[frozen_index] is None and expected[frozen_index] is None
    assert_relative(actual[3 - frozen_index], expected[3 - frozen_index])


def test_tied_weight_gets_both_gradients():
    """A weight shared with the input embedding (tie_word_embeddings) gets the sum of its embedding gradient and
    its lm_head gradient, as with nn.Linear."""
    gen = torch.Generator().manual_seed(1)
    vocab, width, rows = 53, 16, 31
    table = torch.randn(vocab, width, generator=gen) * 0.3
    mix = torch.randn(width, width, generator=gen) * 0.3
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    labels = torch.roll(ids, -1)
    labels[-1] = IGNORE_INDEX

    def grad_of(fn):
        weight = table.clone().requires_grad_()
        hidden = torch.tanh(F.embedding(ids, weight) @ mix)
        (fn(hidden, weight, labels) * GRAD_SCALE).backward()
        return weight.grad

    assert_relative(grad_of(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=6)), grad_of(unfused))


def test_no_grad_computes_the_loss_only():
    """Under no_grad (evaluation) the loss is the same and nothing is kept for a backward."""
    hidden, weight, labels = problem(37)
    weight.requires_grad_()
    with torch.no_grad():
        value = linear_cross_entropy(hidden, weight, labels, chunk_rows=8)
    assert not value.requires_grad
    assert_relative(value, unfused(hidden, weight.detach(), labels))


def test_second_backward_is_refused():
    """Backward scales the gradients stored by forward in place, so a second backward through the same graph
    fails loudly instead of returning scaled-twice gradients."""
    hidden, weight, labels = problem(9)
    weight.requires_grad_()
    value = linear_cross_entropy(hidden, weight, labels)
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        value.backward()


def test_bf16_autocast_within_the_unfused_rounding():
    """Under a bf16 autocast with fp32 master weights (the training setup) the matmuls run in bf16 like nn.Linear's
    and the gradients come back in fp32 for the fp32 tensors passed in; against an fp64 truth, loss and gradients
    are off by at most twice the unfused autocast path's own error."""
    hidden, weight, labels = problem(203, hidden_size=64, vocab=1000)

    def under_autocast(fn, **kwargs):
        def run(h, w, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w, y, **kwargs)

        return run

    truth = loss_and_grads(unfused, hidden.double(), weight.double(), labels)
    reference = loss_and_grads(under_autocast(unfused), hidden, weight, labels)
    fused = loss_and_grads(under_autocast(linear_cross_entropy, chunk_rows=40), hidden, weight, labels)
    assert fused[1].dtype == fused[2].dtype == torch.float32
    for name, f, r, t in zip(("loss", "grad hidden", "grad weight"), fused, reference, truth):
        reference_error = (r.double() - t).abs().max()
        assert reference_error > 0, f"{name}: the autocast reference did not round"
        assert (f.double() - t).abs().max() <= 2 * reference_error, name


# ----- the softmax-gradient kernel (modeling/loss_kernel.py) and the CUDA path -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [97, 5003])
@pytest.mark.parametrize("write_grad", [True, False])
def test_kernel_equals_the_torch_path(dtype, vocab, write_grad):
    """The Triton kernel (here under the interpreter) against the torch path on the same logits: each row's loss,
    and the gradient it writes over the logits, for a vocabulary inside one block and one spanning two with a ragged
    tail, large logits, a label on the last column and ignored rows (loss 0, zero gradient); without write_grad the
    logits are left untouched. bf16 gradients may differ by one rounding (exp and sums in another order)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(11, vocab, generator=gen) * 6).to(dtype)
    labels = torch.randint(0, vocab, (11,), generator=gen)
    labels[[0, 4]] = IGNORE_INDEX
    labels[5] = vocab - 1
    expected_logits, actual_logits = logits.clone(), logits.clone()
    expected = loss.cross_entropy_grad_torch_(expected_logits, labels, write_grad)
    actual = cross_entropy_grad_(actual_logits, labels, IGNORE_INDEX, write_grad)
    assert_relative(actual, expected, rel=1e-6, name="row loss")
    assert actual[0] == actual[4] == 0 and torch.all(actual[labels != IGNORE_INDEX] > 0)
    if not write_grad:
        assert torch.equal(actual_logits, logits) and torch.equal(expected_logits, logits)
        return
    rel = 1e-6 if dtype == torch.float32 else 2**-8
    assert_relative(actual_logits.float(), expected_logits.float(), rel=rel, name="gradient")
    assert torch.count_nonzero(actual_logits[[0, 4]]) == 0
    torch.testing.assert_close(actual_logits.float().sum(1), torch.zeros(11), atol=0.05, rtol=0)  # softmax - onehot


@pytest.mark.parametrize("chunk_rows", [1, 8, None])
def test_kernel_path_equals_unfused(monkeypatch, chunk_rows):
    """linear_cross_entropy with the chunk's softmax gradient in the kernel (forced on the CPU) equals the unfused
    loss and gradients in fp32, as the torch path does."""
    monkeypatch.setattr(loss, "_softmax_in_kernel", lambda device: True)
    hidden, weight, labels = problem(37)
    expected = loss_and_grads(unfused, hidden, weight, labels)
    actual = loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_rows=chunk_rows)
    for a, e in zip(actual, expected):
        assert_relative(a, e)


@pytest.mark.gpu
@pytest.mark.parametrize("master", ["bf16 module", "fp32 master under autocast"])
def test_cuda_path_within_the_unfused_rounding(master):
    """On CUDA (kernel softmax, fp32 accumulation inside the weight-gradient matmul, several chunks): against an
    fp64 truth, loss and gradients are off by at most twice the unfused bf16 path's own error, with the bf16 weights
    of a bf16 module and with fp32 master weights under autocast (whose weight gradient comes back in fp32)."""
    hidden, weight, labels = problem(517, hidden_size=128, vocab=5003)
    hidden, weight = hidden.cuda(), weight.cuda()
    labels = labels.cuda()
    if master == "bf16 module":
        hidden, weight = hidden.bfloat16(), weight.bfloat16()

    def in_training_precision(fn, **kwargs):
        def run(h, w, y):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=master != "bf16 module"):
                return fn(h, w, y, **kwargs)

        return run

    truth = loss_and_grads(unfused, hidden.double(), weight.double(), labels)
    reference = loss_and_grads(in_training_precision(unfused), hidden, weight, labels)
    fused = loss_and_grads(in_training_precision(linear_cross_entropy, chunk_rows=96), hidden, weight, labels)
    assert fused[2].dtype == weight.dtype
    for name, f, r, t in zip(("loss", "grad hidden", "grad weight"), fused, reference, truth):
        reference_error = (r.double() - t).abs().max()
        assert reference_error > 0, f"{name}: the bf16 reference did not round"
        assert (f.double() - t).abs().max() <= 2 * reference_error, name


# ----- inside TrainModule, on the tiny models -----


def unfused_module_loss(module: step.TrainModule, batch: dict) -> torch.Tensor:
    """The loss as TrainModule computed it before the fusion: the full model's logits (B, S, V), then the summed
    fp32 cross-entropy. For batches with images and videos, where no dummy goes through the vision tower."""
    logits = module.model(**module.model_inputs(batch), use_cache=False).logits
    return F.cross_entropy(
        logits.flatten(0, 1).float(), batch["shift_labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def step_grads(module: step.TrainModule, batch: dict, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss and every parameter's gradient after one accumulate_gradients step whose module call is
    `forward(module, batch)`."""
    module.zero_grad(set_to_none=True)
    original = module.forward
    module.forward = lambda b: forward(module, b)
    try:
        loss_sum, _ = step.accumulate_gradients(Accelerator(cpu=True), module, [batch])
    finally:
        module.forward = original
        AcceleratorState._reset_state(reset_partial_state=True)
    return loss_sum, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def padded_batch(samples) -> dict:
    """Right-padded (B, S) batch of `samples` with its attention_mask; padding has no label."""
    width = max(len(s) for s in samples)
    batch = {
        "input_ids": torch.zeros(len(samples), width, dtype=torch.long),
        "mm_token_type_ids": torch.zeros(len(samples), width, dtype=torch.int32),
        "attention_mask": torch.zeros(len(samples), width, dtype=torch.long),
        "shift_labels": torch.full((len(samples), width), IGNORE_INDEX),
    }
    for row, sample in enumerate(samples):
        batch["input_ids"][row, : len(sample)] = sample.input_ids
        batch["mm_token_type_ids"][row, : len(sample)] = sample.mm_token_type_ids
        batch["attention_mask"][row, : len(sample)] = 1
        batch["shift_labels"][row, : len(sample)] = sample.shift_labels
    for key in VISION_INPUTS:
        batch[key] = torch.cat([getattr(s, key) for s in samples if getattr(s, key) is not None])
    batch["label_rows"] = label_rows(batch["shift_labels"])
    return batch


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_train_module_equals_unfused_logits(tiny_model, tiny_samples, monkeypatch, family, layout):
    """In fp32, TrainModule's loss (base model's hidden states + fused lm_head/cross-entropy, several chunks) and
    the gradient of every parameter equal those of the full model's logits + cross-entropy, for a pack and for a
    padded batch; under no_grad (evaluation) the loss is the same."""
    model = tiny_model(family)
    enable_packed_forward(model)
    module = step.TrainModule(model)
    specs = (SampleSpec(5, ((2, 4),), text_after=3), SampleSpec(4, videos=((2, 2, 2),), text_after=2), SampleSpec(7))
    samples = tiny_samples(model, specs)
    batch = pack_samples(model, samples) if layout == "packed" else padded_batch(samples)
    monkeypatch.setattr(loss, "CE_CHUNK_ELEMENTS", 7 * model.config.text_config.vocab_size)  # 7-row chunks
    fused_loss, fused_grads = step_grads(module, batch, step.TrainModule.forward)
    unfused_loss, unfused_grads = step_grads(module, batch, unfused_module_loss)
    assert_relative(fused_loss, unfused_loss)
    assert fused_grads.keys() == unfused_grads.keys()
    for name, grad in unfused_grads.items():  # rel 1e-5: the decoder's backward adds its own fp32 rounding
        assert_relative(fused_grads[name], grad, rel=1e-5, name=name)
    with torch.no_grad():
        assert_relative(module(batch), unfused_loss)


@pytest.mark.parametrize("layout", ["packed", "padded", "packed without labels"])
@pytest.mark.parametrize("family", tiered(FAMILY_NAMES, fast=("qwen2_5_vl", "qwen3_5")))
def test_train_module_loss_over_labelled_rows_equals_every_row(tiny_model, tiny_samples, monkeypatch, family, layout):
    """In fp32 on the CPU, TrainModule's loss over the batch's labelled rows (`label_rows`) and the gradient of every
    parameter equal, bit for bit, those of the same loss over every row of the pack (images, videos, prompts and
    padding included), for a pack, a padded batch and a pack without a single label (loss 0, zero gradients); the
    rows are one lm_head chunk, as the tiny vocabulary's default chunk holds any pack."""
    model = tiny_model(family)
    enable_packed_forward(model)
    module = step.TrainModule(model)
    specs = (SampleSpec(5, ((2, 4),), text_after=3), SampleSpec(4, videos=((2, 2, 2),), text_after=2), SampleSpec(7))
    samples = tiny_samples(model, specs)
    if layout == "packed without labels":
        for sample in samples:
            sample.shift_labels = torch.full_like(sample.shift_labels, IGNORE_INDEX)
    batch = padded_batch(samples) if layout == "padded" else pack_samples(model, samples)
    assert batch["label_rows"].numel() == int((batch["shift_labels"] != IGNORE_INDEX).sum())
    labelled_loss, labelled_grads = step_grads(module, batch, step.TrainModule.forward)
    with monkeypatch.context() as every_row:
        every_row.setattr(step, "labelled_rows", lambda batch: None)  # linear_cross_entropy over all rows
        every_loss, every_grads = step_grads(module, batch, step.TrainModule.forward)
    assert torch.equal(labelled_loss, every_loss)
    assert labelled_grads.keys() == every_grads.keys()
    for name, grad in every_grads.items():
        assert torch.equal(labelled_grads[name], grad), name
    if layout == "packed without labels":
        assert labelled_loss.item() == 0.0 and not any(grad.any() for grad in labelled_grads.values())


def test_train_module_refuses_a_batch_without_label_rows(tiny_model, tiny_samples):
    """A batch made without `label_rows` is refused with the fix, not counted on the device (a host sync)."""
    model = tiny_model("qwen2_5_vl")
    enable_packed_forward(model)
    batch = pack_samples(model, tiny_samples(model, (SampleSpec(6),)))
    del batch["label_rows"]
    with pytest.raises(ValueError, match="label_rows"):
        step.TrainModule(model)(batch)


def test_train_module_pack_reaches_attention_without_a_mask(tiny_model, tiny_samples):
    """TrainModule calls the base model directly, where the packed-position pre-hook sits: a pack reaches the
    decoder's attention with no mask (transformers saw no packing to build an O(T²) one from)."""
    model = tiny_model("qwen2_5_vl")
    enable_packed_forward(model)
    module = step.TrainModule(model)
    masks = []
    model.model.language_model.layers[0].self_attn.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs.get("attention_mask", "not passed")), with_kwargs=True
    )
    module(pack_samples(model, tiny_samples(model, (SampleSpec(6), SampleSpec(9)))))
    assert masks == [None]
