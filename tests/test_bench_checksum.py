"""scripts/bench_checksum.py: the checksum rates behind `checkpoint.checksums` (docs/cluster.md)."""

from __future__ import annotations

import json

import pytest

from scripts import bench_checksum


def test_every_hash_is_measured_from_memory_cache_and_disk_and_projected(tmp_path, capsys):
    """The JSON holds a positive rate per hash and source, the projection is the state size over that rate, and the
    printed lines name each hash."""
    out = tmp_path / "rates.json"
    bench_checksum.main(
        ["--gib", "0.004", "--repeats", "1", "--state-gb", "10", "--dir", str(tmp_path), "--out", str(out)]
    )
    result = json.loads(out.read_text())
    assert result["provenance"]["commit"] or result["provenance"]["source_sha256"]
    assert set(result["gib_per_s_one_core"]) == {"xxh3_128", "xxh64", "sha256", "blake2b"}
    state_gib = 10e9 / 2**30
    for name, rates in result["gib_per_s_one_core"].items():
        assert set(rates) == {"memory", "page_cache", "disk"} and all(rate > 0 for rate in rates.values())
        for where, rate in rates.items():
            assert result["seconds_one_core"][name][where] == pytest.approx(state_gib / rate)
    printed = capsys.readouterr().out
    assert all(f"{name}:" in printed for name in result["gib_per_s_one_core"])
