"""The launcher's direct launch (`triton_rope.launch`): the first call per specialization goes through Triton's JIT,
later ones launch the CompiledKernel it returned with exactly the arguments the JIT would pass.

On CPU, `_rope_kernel` is replaced by a real `JITFunction` of the same kernel (Triton's own binding, specialization
and kernel cache) whose compiles return a recording kernel, on a fake current device and stream; so a launch's
arguments can be compared with the JIT's and every compile seen. On a GPU, the real kernel through both paths.
"""

from __future__ import annotations

import pytest
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from mrope_kernels import ops, triton_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N_TOKENS, HEADS_Q, HEADS_K = 37, 5, 3
# Text D = 72 (36-lane halves: no whole number of 16-byte vectors), vision D = 80.
HEAD_DIM = {triton_rope.LAYOUT_INTERLEAVED: 72, triton_rope.LAYOUT_CHUNKED: 72, triton_rope.LAYOUT_VISION: 80}


class RecordingKernel(CompiledKernel):
    """What the launch uses of a CompiledKernel; `run` records its arguments instead of launching."""

    def __init__(self):
        self.module = None  # CompiledKernel.__del__ (Triton 3.9) unloads a loaded module
        self.function, self.packed_metadata, self.launches = object(), (2, 1, 0), []

    def launch_metadata(self, grid, stream, *args):
        return ("launch metadata", grid, stream)

    def run(self, *args):
        self.launches.append(args)


class NotCompiled:
    """Launchable by the JIT like a CompiledKernel, but none (as Triton 3.9's FutureKernel of an async compile)."""

    def __init__(self):
        self.function, self.packed_metadata, self.launches = object(), (2, 1, 0), []

    launch_metadata, run = RecordingKernel.launch_metadata, RecordingKernel.run


class FakeDriver:
    """The current device and stream, settable; the target of an H200."""

    device, stream = 0, 7000

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.stream + device

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class FakeJit:
    """The state of the `fake_jit` fixture: the JIT, its runs, its compiles, the driver."""

    def __init__(self, kernel_cls):
        self.jit = JITFunction(triton_rope._rope_kernel.fn)
        self.driver = FakeDriver()
        self.runs = 0  # calls of the JIT (fn[grid](...))
        self.compiled = []  # kernels the JIT compiled, in order
        self.kernel_cls = kernel_cls
        run = self.jit.run

        def counted_run(*args, **kwargs):
            self.runs += 1
            return run(*args, **kwargs)

        def compile_(key, signature, device, constexprs, options, attrs, warmup):
            kernel = self.kernel_cls()
            self.compiled.append(kernel)
            self.jit.device_caches[device][0][key] = kernel  # the JIT's own kernel cache, as its compile does
            return kernel

        self.jit.run, self.jit._do_compile = counted_run, compile_


@pytest.fixture
def fake_jit(monkeypatch):
    """`_rope_kernel` as a `FakeJit` (compiles return RecordingKernels; `fake_jit.kernel_cls` changes that), outside
    the interpreter, with fresh launch plans (they hold the compiled kernels)."""
    fake = FakeJit(RecordingKernel)
    monkeypatch.setattr(triton_rope, "_rope_kernel", fake.jit)
    monkeypatch.setattr(triton_rope, "RUNS_IN_INTERPRETER", False)
    monkeypatch.setattr(driver, "_active", fake.driver)
    triton_rope.launch_plan.cache_clear()
    yield fake
    triton_rope.launch_plan.cache_clear()


def _inputs(dtype=torch.bfloat16, positions_dtype=torch.int64, offset=0, layout=triton_rope.LAYOUT_INTERLEAVED):
    """(q, k, q_out, k_out, positions, inv_freq), for vision (q, k, q_out, k_out, table), of a rope of odd shape on
    DEVICE; q, q_out `offset` elements into their storage (1: a pointer that is not a multiple of 16 bytes); outputs
    NaN."""
    torch.manual_seed(0)
    head_dim = HEAD_DIM[layout]

    def tensor(heads: int, start: int) -> torch.Tensor:
        flat = torch.randn(start + N_TOKENS * heads * head_dim, device=DEVICE).to(dtype)
        return flat[start:].view(N_TOKENS, heads, head_dim)

    q, k = tensor(HEADS_Q, offset), tensor(HEADS_K, 0)
    q_out, k_out = tensor(HEADS_Q, offset).fill_(float("nan")), tensor(HEADS_K, 0).fill_(float("nan"))
    if layout == triton_rope.LAYOUT_VISION:
        positions = torch.randint(0, 100, (N_TOKENS, 2), device=DEVICE, dtype=positions_dtype)
        return q, k, q_out, k_out, ops.vision_rope_table(positions, torch.rand(head_dim // 4, device=DEVICE))
    positions = torch.randint(0, 1000, (3, N_TOKENS), device=DEVICE, dtype=positions_dtype)
    return q, k, q_out, k_out, positions, torch.rand(head_dim // 2, device=DEVICE)


def _rope(tensors, layout=triton_rope.LAYOUT_INTERLEAVED, conjugate=False, scaling=1.0):
    if layout == triton_rope.LAYOUT_VISION:
        triton_rope.vision_rope_launch(*tensors, conjugate)
    else:
        triton_rope.rope_launch(*tensors, layout, (12, 12, 12), scaling, conjugate)


def _jit_launch(tensors, layout=triton_rope.LAYOUT_INTERLEAVED, conjugate=False):
    """What the launchers did before the direct launch: the planned arguments through `kernel[grid]`."""
    q, k, q_out, k_out, *angles = tensors
    dtypes = tuple(t.dtype for t in tensors)
    shapes = (q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride())
    if layout == triton_rope.LAYOUT_VISION:
        plan = triton_rope.vision_launch_plan(*shapes, dtypes, conjugate)
    else:
        positions, inv_freq = angles
        plan = triton_rope.launch_plan(
            *shapes, positions.stride(), dtypes, inv_freq.shape[0], layout, (12, 12, 12), 1.0, conjugate
        )
    plan.kernel[plan.grid](*tensors, *plan.scalars, **plan.constexprs, num_warps=plan.num_warps)


def _assert_same_args(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is w if isinstance(w, torch.Tensor) else (type(g), g) == (type(w), w), f"argument {i}: {g} != {w}"


def test_direct_launch_passes_what_the_jit_passes(fake_jit):
    """The first call compiles and launches through the JIT; the second (new tensors of the same signature, another
    current stream) launches the kept kernel without the JIT, with the arguments the JIT passes for those tensors:
    grid, current stream, function, metadata and every kernel argument in order. Only the launch metadata and the
    hooks differ: None where the JIT passes its empty hook chains (so the launcher calls no hook either way)."""
    _rope(_inputs())
    assert (fake_jit.runs, len(fake_jit.compiled)) == (1, 1)
    (kernel,) = fake_jit.compiled
    fake_jit.driver.stream = 9000
    second = _inputs()
    _rope(second)
    assert (fake_jit.runs, len(fake_jit.compiled), len(kernel.launches)) == (1, 1, 2)
    _jit_launch(second)
    assert (fake_jit.runs, len(fake_jit.compiled)) == (2, 1)
    direct, jit = kernel.launches[1:]
    _assert_same_args(direct[:6], jit[:6])
    assert direct[1:4] == (1, 1, 9000)
    _assert_same_args(direct[9:], jit[9:])
    assert len(direct) == 9 + len(triton_rope._rope_kernel.arg_names)
    assert direct[6:9] == (None, None, None)
    assert jit[7:9] == (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert not jit[7].calls and not jit[8].calls


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": torch.float16},
        {"offset": 1},
        {"positions_dtype": torch.int32},
        {"device_index": 1},
        {"conjugate": True},
        {"layout": triton_rope.LAYOUT_CHUNKED},
    ],
    ids=["bf16-to-fp16", "misaligned-pointer", "int32-positions", "device-1", "conjugate", "layout"],
)
def test_each_specialization_misses_the_cache(fake_jit, change):
    """A change of any property the JIT specializes on (a tensor's dtype, a pointer's 16-byte alignment, the
    positions' dtype, the current device, a constexpr) goes back through the JIT, which compiles another kernel,
    and the call after it launches that kernel directly."""
    _rope(_inputs())
    _rope(_inputs())
    assert (fake_jit.runs, len(fake_jit.compiled)) == (1, 1)
    change = dict(change)
    fake_jit.driver.device = change.pop("device_index", 0)
    rope_kwargs = {name: change.pop(name) for name in ("conjugate", "layout") if name in change}
    for calls in (2, 2):
        _rope(_inputs(**change, layout=rope_kwargs.get("layout", triton_rope.LAYOUT_INTERLEAVED)), **rope_kwargs)
        assert (fake_jit.runs, len(fake_jit.compiled)) == (calls, 2)
    assert len(fake_jit.compiled[1].launches) == 2


def test_what_the_jit_does_not_specialize_on_stays_direct(fake_jit):
    """Other aligned pointers: the kept kernel, no JIT call. Other scaling values, floats or ints (passed as floats,
    which the JIT does not specialize; an int would be): one plan per value, whose first launch goes through the JIT
    and finds the kernel already compiled, later ones direct."""
    _rope(_inputs())
    for scaling in (1.0, 0.5, 2, 1, 0.5):
        _rope(_inputs(), scaling=scaling)
    assert (fake_jit.runs, len(fake_jit.compiled), len(fake_jit.compiled[0].launches)) == (3, 1, 6)
    at = 9 + fake_jit.jit.arg_names.index("scaling")
    scalings = [launch[at] for launch in fake_jit.compiled[0].launches]
    assert scalings == [1.0, 1.0, 0.5, 2.0, 1.0, 0.5] and {type(s) for s in scalings} == {float}


@pytest.mark.parametrize("hook", ["enter", "exit", "legacy-callable", "pre-run", "debug", "instrumentation"])
def test_hooks_and_debug_modes_take_the_jit_path(fake_jit, monkeypatch, hook):
    """While a launch hook (a profiler's), a pre-run hook, Triton's debug or instrumentation mode is on, every call
    goes through the JIT, also for a kept kernel; once off, the kept kernel launches directly again."""
    _rope(_inputs())
    with monkeypatch.context() as patched:
        if hook in ("enter", "exit"):
            patched.setattr(getattr(knobs.runtime, f"launch_{hook}_hook"), "calls", [print])
        elif hook == "legacy-callable":
            patched.setattr(knobs.runtime, "launch_enter_hook", print)
        elif hook == "pre-run":
            patched.setattr(fake_jit.jit, "pre_run_hooks", [lambda *args, **kwargs: None])
        elif hook == "debug":
            patched.setattr(knobs.runtime, "debug", True)
        else:
            patched.setattr(knobs.compilation, "instrumentation_mode", "fpsan")
        _rope(_inputs())
        _rope(_inputs())
        assert fake_jit.runs == 3
    assert not knobs.runtime.launch_enter_hook.calls and not knobs.runtime.launch_exit_hook.calls
    _rope(_inputs())
    assert fake_jit.runs == 3


def test_a_result_that_is_no_compiled_kernel_stays_on_the_jit_path(fake_jit):
    """If the JIT's first launch returns something else (an async compile's future, say), that specialization is
    launched through the JIT on every call."""
    fake_jit.kernel_cls = NotCompiled
    for _ in range(3):
        _rope(_inputs())
    assert (fake_jit.runs, len(fake_jit.compiled), len(fake_jit.compiled[0].launches)) == (3, 1, 3)


@pytest.mark.skipif(not triton_rope.RUNS_IN_INTERPRETER, reason="the interpreter runs on CPU only")
def test_interpreter_takes_the_jit_path(monkeypatch):
    """Under TRITON_INTERPRET=1 every call goes through the interpreter (no current device is asked for, nothing is
    kept) and writes the rotation."""
    kernel = triton_rope._rope_kernel
    runs = []
    run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *args, **kwargs: runs.append(1) or run(*args, **kwargs))
    monkeypatch.setattr(driver, "_active", None)  # asking for the device would try to load a GPU driver and fail
    outputs = []
    for _ in range(2):
        tensors = _inputs(torch.float32)
        _rope(tensors)
        outputs.append(tensors[2:4])
    assert len(runs) == 2 and driver._active is None
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert not any(t.isnan().any() for t in outputs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("positions_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "layout", [triton_rope.LAYOUT_INTERLEAVED, triton_rope.LAYOUT_VISION], ids=["text-72", "vision-table-80"]
)
def test_gpu_direct_launch_matches_the_jit_bit_for_bit(monkeypatch, layout, dtype, positions_dtype, offset):
    """On the GPU, at odd shapes, for bf16 and fp16, int32 and int64 positions, q and q_out at an odd element offset
    or not: a call that takes the direct path (the JIT is not called) writes exactly what the JIT launch writes."""
    kernel = triton_rope._vision_table_kernel if layout == triton_rope.LAYOUT_VISION else triton_rope._rope_kernel
    runs = []
    run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *args, **kwargs: runs.append(1) or run(*args, **kwargs))
    for conjugate in (False, True):
        reference = _inputs(dtype, positions_dtype, offset, layout)
        _jit_launch(reference, layout, conjugate)
        _rope(_inputs(dtype, positions_dtype, offset, layout), layout, conjugate)  # through the JIT, or kept already
        runs.clear()
        direct = _inputs(dtype, positions_dtype, offset, layout)
        _rope(direct, layout, conjugate)
        torch.cuda.synchronize()
        assert not runs, "the second call went through the JIT"
        assert (direct[0].data_ptr() % 16 == 0) == (offset == 0)
        for got, want in zip(direct[2:4], reference[2:4]):
            assert not got.isnan().any()
            assert torch.equal(got, want)
