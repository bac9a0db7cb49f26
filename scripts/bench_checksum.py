"""How fast a checkpoint's files can be checksummed on this host: the figures behind `checkpoint.checksums`
(lifecycle/checkpoint_manifest.py) and docs/cluster.md.

    python -m scripts.bench_checksum --gib 1 --state-gb 100 --out docs/results/checksum-throughput-<host>-<date>.json

Per hash (xxh3-128, the one checkpoints record, against xxh64, sha256, blake2b): GiB/s of one core over a buffer in
memory, over a file in the page cache (a checkpoint just written), and over the same file after the page cache
dropped it (POSIX_FADV_DONTNEED: a resume reading from disk), each the best of `--repeats`; then the seconds one
core needs for `--state-gb` GB of checkpoint at each rate. The host's load average is recorded beside them: on a
shared host, other processes' work lowers every rate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from verification.provenance import provenance

HASHES: dict[str, Callable] = {
    "xxh3_128": xxhash.xxh3_128,
    "xxh64": xxhash.xxh64,
    "sha256": hashlib.sha256,
    "blake2b": hashlib.blake2b,
}
CHUNK = 8 << 20  # bytes per update / read, as lifecycle/checkpoint_manifest.py reads


def memory_rate(make: Callable, data: bytes) -> float:
    """GiB/s of hashing `data` from memory."""
    view, digest = memoryview(data), make()
    started = time.perf_counter()
    for offset in range(0, len(data), CHUNK):
        digest.update(view[offset : offset + CHUNK])
    return len(data) / 2**30 / (time.perf_counter() - started)


def file_rate(make: Callable, path: Path, cold: bool) -> float:
    """GiB/s of reading and hashing the file at `path`, from the page cache or (cold) from the disk."""
    fd = os.open(path, os.O_RDONLY)
    if cold:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buffer = bytearray(CHUNK)
    view, digest = memoryview(buffer), make()
    started = time.perf_counter()
    with os.fdopen(fd, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return path.stat().st_size / 2**30 / (time.perf_counter() - started)


def measure(gib: float, repeats: int, directory: Path) -> dict[str, dict[str, float]]:
    """{hash: {"memory", "page_cache", "disk": GiB/s}} on `gib` GiB of random bytes, a file of them in `directory`."""
    data = os.urandom(int(gib * 2**30))
    rates: dict[str, dict[str, float]] = {}
    with tempfile.NamedTemporaryFile(dir=directory) as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
        path = Path(handle.name)
        for name, make in HASHES.items():
            rates[name] = {
                "memory": max(memory_rate(make, data) for _ in range(repeats)),
                "page_cache": max(file_rate(make, path, cold=False) for _ in range(repeats)),
                "disk": max(file_rate(make, path, cold=True) for _ in range(repeats)),
            }
    return rates


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of data to hash")
    parser.add_argument("--repeats", type=int, default=2, help="runs per rate; the best counts")
    parser.add_argument("--state-gb", type=float, default=100.0, help="checkpoint size to project (GB)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file is written (its disk counts)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]  # other work on the host slows every rate: recorded with them
    rates = measure(args.gib, args.repeats, Path(args.dir))
    state_gib = args.state_gb * 1e9 / 2**30
    result = {
        "provenance": provenance(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "gib": args.gib,
        "directory": args.dir,
        "gib_per_s_one_core": rates,
        "state_gb": args.state_gb,
        "seconds_one_core": {
            name: {where: state_gib / rate for where, rate in by_source.items()} for name, by_source in rates.items()
        },
    }
    for name, by_source in rates.items():
        shown = ", ".join(f"{where} {rate:.2f} GiB/s" for where, rate in by_source.items())
        print(f"{name}: {shown}; {args.state_gb:g} GB from the page cache: {state_gib / by_source['page_cache']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
