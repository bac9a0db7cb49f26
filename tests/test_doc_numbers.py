"""Every measured number in a table row of the README or docs/*.md that links result files is held by one of those
files: a number whose JSON was never committed, was left out of docs/results, or says something else fails here."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT_LINK = re.compile(r"\]\(((?:docs/)?results/[^)\s]+\.json)\)")  # from the README or from docs/
# A measured number as the tables write it: decimals (1.085, 48.0, 0.88) or thousands (22,881); a count, a model
# size (3.75B) or a name (Qwen3.5, 16k, H200) is not one.
MEASURED = re.compile(r"(?<![\w./-])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w.])")
# What a table may print for a value v of a JSON: v, a fraction as a percentage, seconds as ms or ms as seconds
SCALES = (1.0, 100.0, 1e3, 1e-3)
DERIVED_GROUP_MAX = 64  # derived numbers (below) come from a result's few runs, not from long per-step curves


def numeric_values(tree, key: str = "") -> dict[str, list[float]]:
    """Every number in a JSON tree, grouped by the key that holds it (list items by their list's key)."""
    grouped: dict[str, list[float]] = defaultdict(list)

    def walk(node, key):
        if isinstance(node, bool):
            return
        if isinstance(node, int | float):
            grouped[key].append(float(node))
        elif isinstance(node, str):  # a number quoted in a recorded message or log line
            grouped[key] += [float(n.replace(",", "")) for n in MEASURED.findall(node)]
        elif isinstance(node, dict):
            for name, value in node.items():
                walk(value, name)
        elif isinstance(node, list):
            for value in node:
                walk(value, key)

    walk(tree, key)
    return grouped


def holds(text: str, grouped: dict[str, list[float]]) -> bool:
    """Whether the JSON values hold the number `text` at its printed precision: as a value (at one of SCALES), or
    as the mean (the median of two runs) or the ratio of two values of the same key (pooled runs, a speed-up)."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    target, tolerance = float(text.replace(",", "")), 0.5 * 10**-decimals + 1e-12

    def near(value: float) -> bool:
        return any(abs(value * scale - target) <= tolerance for scale in SCALES)

    if any(near(v) for values in grouped.values() for v in values):
        return True
    for values in grouped.values():
        if len(values) > DERIVED_GROUP_MAX:
            continue
        for a, b in combinations(values, 2):
            if near((a + b) / 2) or (b and near(a / b)) or (a and near(b / a)):
                return True
    return False


def unheld_numbers(markdown: str, base: Path = ROOT) -> list[str]:
    """'number: row' for each measured number of a table row that links result files (relative to `base`, the
    markdown's folder) and is held by none of them. Not checked: the row's first cell (its label) and the columns
    whose header names an estimate (computed, e.g. by scripts/estimate_memory.py, not measured)."""
    missing, header = [], []
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = RESULT_LINK.sub("]", line).split("|")[1:-1]
        if not header:
            header = [cell.lower() for cell in cells]
            continue
        links = RESULT_LINK.findall(line)
        if not links:
            continue
        grouped: dict[str, list[float]] = defaultdict(list)
        for link in links:
            for key, values in numeric_values(json.loads((base / link).read_text())).items():
                grouped[key] += values
        measured = [cell for i, cell in enumerate(cells[1:], 1) if i >= len(header) or "estimate" not in header[i]]
        for number in MEASURED.findall("|".join(measured)):
            if not holds(number, grouped):
                missing.append(f"{number}: {line[:100]}")
    return missing


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_table_numbers_are_held_by_their_result_files(doc):
    """Each measured number of a table row with result links is in one of the row's JSONs."""
    assert not unheld_numbers(doc.read_text(), doc.parent)


def test_a_number_no_result_file_holds_is_reported(tmp_path):
    """The check fails a row whose number its JSON does not hold, and passes the same row with the number the JSON
    holds (as a percentage, as the median of two runs, and as a ratio of two runs)."""
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "r.json").write_text(json.dumps({"runs": [{"mfu": 0.47, "tps": 100.0}, {"mfu": 0.48, "tps": 110.0}]}))
    link = (results / "r.json").relative_to(tmp_path).as_posix()
    row = "| what | result |\n|---|---|\n| what | {} ([JSON](" + link + ")) |"
    for held in ("47.0%", "47.5%", "1.10×", "1.100×"):
        assert not unheld_numbers(row.format(held), tmp_path), held
    for unheld in ("46.0%", "47.6%", "1.20×"):
        assert unheld_numbers(row.format(unheld), tmp_path), unheld


@pytest.mark.parametrize("link", sorted({m for m in RESULT_LINK.findall((ROOT / "README.md").read_text())}))
def test_readme_result_links_exist(link):
    """Every result file the README links is under docs/results."""
    assert (ROOT / link).is_file()
