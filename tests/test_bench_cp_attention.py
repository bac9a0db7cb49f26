"""scripts/bench_cp_attention.py on CPU: its arguments, the zig-zag sharding of the reference (the repo's layout and
torch's head-tail load balancer's, which the comparison of torch's engine relies on) and its inverse, the timing
summary and the table; and a two-process gloo run on tiny shapes, where the repo's engine matches the one-process
reference and torch's engine (no CPU kernel for its ring) is recorded as failed without stopping the run."""

from __future__ import annotations

import contextlib
import json
import sys

import pytest
import torch

from tests.test_distributed import run_processes
from verification.cp_attention_bench import (
    ENGINES,
    check_lengths,
    format_table,
    local_index,
    parse_args,
    shard,
    summarize,
    unshard,
)


def test_defaults_are_the_3b_shape_at_32k_64k_128k_with_every_engine():
    args = parse_args(["--out", "x.json"])
    assert args.lengths == [32768, 65536, 131072]
    assert args.engines == list(ENGINES)
    assert (args.heads, args.kv_heads, args.head_dim, args.dtype) == (16, 2, 128, "bfloat16")


@pytest.mark.parametrize(
    "argv",
    [
        ["--engines", "ours_allgather_kv,ring"],  # unknown engine
        ["--lengths", "4k"],  # not an integer
        ["--lengths", "0"],
        ["--heads", "16", "--kv-heads", "3"],  # no GQA grouping
        ["--repeats", "0"],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", *argv])


def test_lengths_must_split_into_two_chunks_per_rank():
    check_lengths([8, 64], 2)
    check_lengths([16], 4)
    with pytest.raises(ValueError, match=r"\[6\]"):
        check_lengths([8, 6], 2)


def test_shard_is_the_zigzag_torch_head_tail_layout():
    """Rank r holds chunks r and 2·CP-1-r: for 8 tokens on 2 ranks, [0, 1, 6, 7] and [2, 3, 4, 5]; on 4 ranks,
    [0, 7], [1, 6], [2, 5], [3, 4]. That is torch's head-tail load balancer's order (its ranks' shards, rank-major),
    so the reference's shards are what torch's context_parallel gives each rank."""
    full = torch.arange(8).view(1, 1, 8, 1)
    assert [shard(full, r, 2).flatten().tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [shard(full, r, 4).flatten().tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    for length, size in ((8, 2), (64, 2), (48, 4)):
        torch_order = _HeadTailLoadBalancer(length, size, "cpu")._generate_indices()[0]
        ours = torch.cat([local_index(length, r, size) for r in range(size)])
        assert torch.equal(torch_order, ours), (length, size)


@pytest.mark.parametrize("size", [2, 4])
def test_unshard_inverts_shard(size):
    full = torch.randn(1, 3, 8 * size, 5)
    parts = [shard(full, r, size) for r in range(size)]
    assert all(p.shape == (1, 3, 8, 5) for p in parts)
    assert torch.equal(unshard(parts), full)
    assert not torch.equal(torch.cat(parts, dim=2), full)  # the layout really is permuted


def test_summarize_gives_median_and_spread():
    stats = summarize([4.0, 2.0, 3.0, 10.0])
    assert stats == {"median": 3.5, "min": 2.0, "max": 10.0, "spread_pct": pytest.approx(800 / 3.5), "repeats": 4}


def test_table_has_a_row_per_result_and_the_failures_and_notes_below():
    timing = {"median": 1.5, "min": 1.25, "max": 2.0, "spread_pct": 50.0, "repeats": 3}
    results = [
        {"length": 64, "engine": "one_gpu", "fwd_ms": timing, "fwd_bwd_ms": timing, "peak_mib": 12.0},
        {
            "length": 64,
            "engine": "ours_allgather_kv",
            "fwd_ms": timing,
            "fwd_bwd_ms": timing,
            "peak_mib": None,
            "max_abs_diff": {"out": 0.0, "dq": 1e-3, "dk": 2e-3, "dv": 0.5},
            "notes": {"kernel": "varlen"},
        },
        {"length": 64, "engine": "torch_cp_alltoall", "error": "NotImplementedError: no CPU op", "traceback": "..."},
    ]
    lines = format_table(results).splitlines()
    assert lines[0].split()[:2] == ["tokens", "engine"]
    assert lines[2].split()[:5] == ["64", "one_gpu", "1.50", "[1.25-2.00]", "1.50"]
    assert "12" in lines[2].split()
    assert lines[3].split()[-5:] == ["-", "0.0e+00", "1.0e-03", "2.0e-03", "5.0e-01"]
    assert lines[4].split() == ["64", "torch_cp_alltoall", "FAILED"]
    assert "  ours_allgather_kv kernel: varlen" in lines
    assert "  torch_cp_alltoall failed: NotImplementedError: no CPU op" in lines


# How torch's context_parallel fails on the CPU (torch 2.11): it has no sharding rule for the CPU attention kernel
TORCH_CP_WITHOUT_CPU_KERNEL = (
    "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
    "strategy registered."
)


@pytest.mark.slow
def test_two_process_gloo_run_matches_the_reference_and_records_failures(tmp_path):
    """Two gloo processes: our all-gather engine matches the one-process reference in the output and every gradient;
    torch's ring engines either match it too or fail as torch does on the CPU (no sharding rule for its attention
    kernel), recorded in their rows while the run goes on; any other failure fails the test."""
    out = tmp_path / "cp.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "scripts.bench_cp_attention",
        f"--out={out}",
        "--lengths=64,120",
        "--heads=4",
        "--kv-heads=2",
        "--head-dim=16",
        "--dtype=float32",
        "--warmup=1",
        "--repeats=2",
    ]
    output = run_processes(command, tmp_path / "cp.log", "bench_cp_attention")
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    rows = {(r["length"], r["engine"]): r for r in report["results"]}
    assert set(rows) == {(n, e) for n in (64, 120) for e in ("one_gpu", *ENGINES)}
    for length in (64, 120):
        ref, ours = rows[length, "one_gpu"], rows[length, "ours_allgather_kv"]
        assert "error" not in ref and "error" not in ours, (ref, ours)
        assert min(ref["max_abs"].values()) > 0.1  # something real to compare
        assert set(ours["max_abs_diff"]) == {"out", "dq", "dk", "dv"}
        assert max(ours["max_abs_diff"].values()) < 1e-5, ours["max_abs_diff"]
        assert ours["notes"]["layout_is_zigzag"] is True
        for stats in (ours["fwd_ms"], ours["fwd_bwd_ms"]):
            assert stats["repeats"] == 2 and 0 < stats["min"] <= stats["median"] <= stats["max"]
        for engine in ("torch_cp_allgather", "torch_cp_alltoall"):
            row = rows[length, engine]
            if "error" in row:  # torch's ring shards no CPU attention kernel: that failure alone is recorded and passes
                assert row["error"].startswith(TORCH_CP_WITHOUT_CPU_KERNEL), row["error"]
            else:
                assert max(row["max_abs_diff"].values()) < 1e-5, row
    assert "ours_allgather_kv" in output and f"wrote {out}" in output


def test_torch_engine_leaves_nothing_of_its_context_behind(tmp_path):
    """torch's context_parallel records each SDPA wrapper it installs in a module registry it never empties; the
    wrapper holds the mesh and so the process group, which then outlives destroy_process_group until interpreter
    shutdown, where gloo's worker threads abort the process (a flaky SIGABRT after the two-process run's report).
    The engine's context must leave that registry, SDPA and DTensor's handlers as it found them, body raising or
    not."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from verification.cp_attention_bench import make_problem, patched_functions_registry, torch_cp

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        args = parse_args(["--out", "x.json", "--heads=2", "--kv-heads=1", "--head-dim=8", "--dtype=float32"])
        problem = make_problem(8, args, torch.device("cpu"), seed=0)
        registry, before = patched_functions_registry(), dict(patched_functions_registry())
        sdpa, handlers = F.scaled_dot_product_attention, DTensor._op_dispatcher._custom_op_handlers
        for raising in (False, True):
            body_error = pytest.raises(RuntimeError, match="body") if raising else contextlib.nullcontext()
            with body_error, torch_cp(problem, 0, 1, mesh, "allgather"):
                assert F.scaled_dot_product_attention is not sdpa  # torch's wrapper is in place inside
                assert len(registry) == len(before) + 1
                if raising:
                    raise RuntimeError("body")
            assert registry == before
            assert F.scaled_dot_product_attention is sdpa
            assert DTensor._op_dispatcher._custom_op_handlers is handlers
    finally:
        dist.destroy_process_group()
