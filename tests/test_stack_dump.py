"""lifecycle/stack_dump.py: `kill -USR1` prints the stacks for the whole run, also after a C library has taken the
signal over. Triton's LLVM can at its first kernel compile in a process (a GPU run reaches it after train.py started);
whether it does depends on the machine (Triton 3.9 did on one CPU machine, not on another), so the takeover itself is
also made directly, through sigaction."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `make test-all`

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import os, signal, time
from lifecycle import stack_dump

def the_run_waits_here():
    time.sleep(3 * stack_dump.CHECK_EVERY_S)  # the watcher has put the dump back by now
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.5)

stack_dump.install()
ours = stack_dump.installed_handler()
{take_over}
print("taken over:", stack_dump.installed_handler() != ours, flush=True)
the_run_waits_here()
print("alive", flush=True)
"""

TRITON_COMPILE = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

@triton.jit
def double(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

# a compile for the GPU (an empty cache: no hit) runs LLVM in this process, as a run's first kernels do; no GPU needed
source = triton.compiler.ASTSource(double, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64})
triton.compile(source, target=GPUTarget("cuda", 90, 32))
"""

PYTHON_HANDLER = "signal.signal(signal.SIGUSR1, lambda *_: None)  # any other library's handler"

# what LLVM does: a C-level sigaction that Python's signal module never sees (SIG_IGN stands for LLVM's no-op handler)
C_HANDLER = """
import ctypes
action = ctypes.create_string_buffer(512)  # zeroed: an empty mask, no flags; sa_handler is the first field
ctypes.c_void_p.from_buffer(action).value = int(signal.SIG_IGN)
assert ctypes.CDLL(None).sigaction(ctypes.c_int(signal.SIGUSR1), action, None) == 0
"""


def run_probe(take_over: str, tmp_path: Path) -> str:
    script = tmp_path / "probe.py"  # a file: Triton reads a kernel's source from it
    script.write_text(PROBE.format(take_over=textwrap.dedent(take_over)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler, hence LLVM
    env |= {"PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_the_dump_survives_a_triton_compile(tmp_path):
    """The stacks print after a real Triton compile, whether or not the installed Triton's LLVM replaced the dump's
    handler on this machine; the takeover itself is forced in the next test."""
    output = run_probe(TRITON_COMPILE, tmp_path)
    assert "the_run_waits_here" in output and "alive" in output


def test_the_dump_survives_a_c_level_takeover(tmp_path):
    """A handler installed through sigaction, as LLVM installs its own, replaces the dump's (checked, so the test
    cannot pass vacuously); the stacks still print afterwards. Without the watcher the signal is ignored from then
    on."""
    output = run_probe(C_HANDLER, tmp_path)
    assert "taken over: True" in output
    assert "the_run_waits_here" in output and "alive" in output


def test_the_dump_survives_another_handler(tmp_path):
    """Any other handler installed after train.py's is replaced by the dump again."""
    output = run_probe(PYTHON_HANDLER, tmp_path)
    assert "taken over: True" in output
    assert "the_run_waits_here" in output and "alive" in output
