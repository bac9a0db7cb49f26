"""The exact within-draw permutation test behind scripts/curve_spread.py (its docstring says why and how): is a
layout's loss curve within the default path's run-to-run spread, pooled over draws of distributed_parity.py runs?

`draw_runs` reads one draw, `exact_test` gives the pooled statistic with its exact p-value and the smallest p-value
the draws could reach, `verdict` names the outcome (a key of VERDICTS).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

DEFAULT_RUNS = ("single", "single-repeat")
DEFAULT_LAYOUT = "bf16-compiled"
ALPHA = 0.05
MAX_RELABELINGS = 2_000_000  # exact enumeration up to this many relabelings (13 draws of three runs)


def curve_gap(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest |Δloss| over the steps both curves logged."""
    steps = set(a) & set(b)
    if not steps:
        raise ValueError("two runs share no logged step")
    return max(abs(a[step] - b[step]) for step in steps)


def draw_runs(path: Path, layout: str) -> list[tuple[str, dict[str, float]]]:
    """The (name, losses) of one draw's default-path runs, then its layout runs (`layout`, `layout`-repeat)."""
    try:
        results = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a distributed_parity.py --out file ({error!r})") from error
    if len(results) != 1:
        raise ValueError(f"{path}: holds {len(results)} recipes' results; pass draws of one recipe")
    layouts = results[0]["layouts"]
    names = [name for name in (*DEFAULT_RUNS, layout, f"{layout}-repeat") if name in layouts]
    if not set(DEFAULT_RUNS) <= set(names) or layout not in names:
        raise ValueError(f"{path}: needs the layouts {', '.join(DEFAULT_RUNS)} and {layout}; it has {list(layouts)}")
    return [(name, layouts[name]["losses"]) for name in names]


def separation(gaps: list[list[float]], layout_runs: frozenset[int]) -> float:
    """Mean gap across the two kinds minus mean gap within a kind, for one draw's pairwise `gaps`."""
    cross, same = [], []
    for i, j in itertools.combinations(range(len(gaps)), 2):
        (cross if (i in layout_runs) != (j in layout_runs) else same).append(gaps[i][j])
    return sum(cross) / len(cross) - sum(same) / len(same)


def relabelings(n_runs: int, n_layout: int) -> list[frozenset[int]]:
    return [frozenset(chosen) for chosen in itertools.combinations(range(n_runs), n_layout)]


def exact_test(draws: list[list[tuple[str, dict[str, float]]]], n_default: int = len(DEFAULT_RUNS)) -> dict:
    """The pooled statistic, its exact p-value and the smallest p-value these draws could give at all."""
    per_draw, observed = [], 0.0
    for runs in draws:
        losses = [curve for _, curve in runs]
        gaps = [[0.0 if i == j else curve_gap(a, b) for j, b in enumerate(losses)] for i, a in enumerate(losses)]
        actual = frozenset(range(n_default, len(runs)))
        observed += separation(gaps, actual)
        per_draw.append(sorted(separation(gaps, labels) for labels in relabelings(len(runs), len(actual))))
    total = math.prod(len(values) for values in per_draw)
    if total > MAX_RELABELINGS:
        raise ValueError(f"{total:,} relabelings exceed the exact enumeration's {MAX_RELABELINGS:,}: pool fewer draws")
    tolerance = 1e-12 * max(1.0, abs(observed))
    at_least = sum(sum(combo) >= observed - tolerance for combo in itertools.product(*per_draw))
    extreme = sum(values[-1] for values in per_draw)
    at_extreme = sum(sum(combo) >= extreme - tolerance for combo in itertools.product(*per_draw))
    return {"statistic": observed, "p_value": at_least / total, "min_p_value": at_extreme / total, "relabelings": total}


VERDICTS = {
    "within": "within the run-to-run spread",
    "outside": "outside the run-to-run spread",
    "undecided": "undecided: too few draws for the test to reach alpha",
}


def verdict(p_value: float, min_p_value: float, alpha: float) -> str:
    """A key of VERDICTS."""
    if min_p_value > alpha:
        return "undecided"
    return "outside" if p_value <= alpha else "within"
