"""Scores of generated answers against their references, per record and over a set, with a per-category table.

Per record (each the best over the record's references, as the benchmarks that define them score):

- `exact_match`: 1.0 when the answers are equal after SQuAD's normalisation (lower case, punctuation and the
  articles a/an/the removed, whitespace collapsed), else 0.0.
- `relaxed_accuracy`: ChartQA's relaxed correctness: when both parse as numbers (a trailing % divides by 100), right
  if within RELAXED_TOLERANCE (5%) of the reference, relatively; otherwise a case-insensitive exact match.
- `anls`: DocVQA's Average Normalized Levenshtein Similarity: 1 - edit distance / the longer length, on lower-cased
  stripped strings, and 0 when that distance reaches ANLS_THRESHOLD (0.5).
- `rouge_l`: ROUGE-L F-measure from Google's `rouge-score` (the reference implementation, which HF `evaluate`'s rouge
  wraps; its tokenizer lower-cases and keeps alphanumeric tokens).
- `bleu`: sentence BLEU from `sacrebleu` (the standard BLEU implementation, with its default exponential smoothing),
  on a 0-1 scale. The summary also gives corpus BLEU over all records, which is what BLEU means for a set.

Both libraries run offline and are pinned in requirements.txt; `evaluate` would fetch its metric scripts from the Hub.
"""

from __future__ import annotations

import re
import string
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import sacrebleu
from rouge_score import rouge_scorer, tokenizers

METRICS = ("exact_match", "relaxed_accuracy", "anls", "rouge_l", "bleu")
RELAXED_TOLERANCE = 0.05
ANLS_THRESHOLD = 0.5
UNCATEGORIZED = "(none)"
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
# rouge-score's own default tokenizer, passed explicitly: built without one, the scorer logs that it uses the default
# through absl, and that first log call gives the root logger a handler, which silences train.py's logging.basicConfig
_ROUGE = rouge_scorer.RougeScorer(["rougeL"], tokenizer=tokenizers.DefaultTokenizer(use_stemmer=False))


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def _to_float(text: str) -> float | None:
    """ChartQA's number parse: a float, or a percentage as its fraction; None for anything else."""
    try:
        return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_accuracy(prediction: str, reference: str, tolerance: float = RELAXED_TOLERANCE) -> float:
    """ChartQA's relaxed correctness: numbers within `tolerance` of the reference (relative), else exact text."""
    prediction, reference = prediction.strip(), reference.strip()
    predicted, target = _to_float(prediction), _to_float(reference)
    if predicted is not None and target:
        return float(abs(predicted - target) / abs(target) <= tolerance)
    return float(prediction.lower() == reference.lower())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def anls(prediction: str, reference: str, threshold: float = ANLS_THRESHOLD) -> float:
    """DocVQA's normalised Levenshtein similarity of one answer (0 at or beyond `threshold` distance)."""
    prediction, reference = prediction.strip().lower(), reference.strip().lower()
    longest = max(len(prediction), len(reference))
    if longest == 0:
        return 1.0
    distance = levenshtein(prediction, reference) / longest
    return 1.0 - distance if distance < threshold else 0.0


def rouge_l(prediction: str, reference: str) -> float:
    return _ROUGE.score(reference, prediction)["rougeL"].fmeasure


def sentence_bleu(prediction: str, references: Sequence[str]) -> float:
    return sacrebleu.sentence_bleu(prediction, list(references)).score / 100.0


def score(prediction: str, references: Sequence[str]) -> dict[str, float]:
    """Every metric of METRICS for one answer: each the best over `references` (BLEU takes them all at once)."""
    if not references:
        raise ValueError("an answer needs at least one reference to be scored")
    return {
        "exact_match": max(exact_match(prediction, r) for r in references),
        "relaxed_accuracy": max(relaxed_accuracy(prediction, r) for r in references),
        "anls": max(anls(prediction, r) for r in references),
        "rouge_l": max(rouge_l(prediction, r) for r in references),
        "bleu": sentence_bleu(prediction, references),
    }


def _means(rows: list[Mapping]) -> dict[str, float]:
    return {metric: sum(row["scores"][metric] for row in rows) / len(rows) for metric in METRICS} if rows else {}


def corpus_bleu(rows: Sequence[Mapping]) -> float | None:
    """sacrebleu's corpus BLEU (0-1) of scored rows; each row's references padded with its first to equal counts,
    as sacrebleu takes reference streams."""
    if not rows:
        return None
    width = max(len(row["references"]) for row in rows)
    streams = [[row["references"][min(k, len(row["references"]) - 1)] for row in rows] for k in range(width)]
    return sacrebleu.corpus_bleu([row["prediction"] for row in rows], streams).score / 100.0


def summarize(rows: Iterable[Mapping]) -> dict:
    """The summary of prediction rows (inference/predictions.py's lines): counts, skips by reason, the mean of each
    metric, corpus BLEU, and the same means per category (records without one under UNCATEGORIZED)."""
    scored, skipped = [], defaultdict(int)
    for row in rows:
        if row.get("skipped"):
            skipped[row["skipped"]] += 1
        else:
            scored.append(row)
    by_category = defaultdict(list)
    for row in scored:
        by_category[row.get("category") or UNCATEGORIZED].append(row)
    return {
        "records": len(scored) + sum(skipped.values()),
        "scored": len(scored),
        "skipped": dict(sorted(skipped.items())),
        "scores": _means(scored),
        "corpus_bleu": corpus_bleu(scored),
        "by_category": {name: {"records": len(group), **_means(group)} for name, group in sorted(by_category.items())},
    }


def format_table(summary: Mapping, others: Mapping[str, Mapping] | None = None) -> str:
    """A text table of a summary's per-category and overall means; `others` ({label: summary}) adds their exact
    match beside (e.g. the untrained model's)."""
    others = dict(others or {})
    header = ["category", "n", *METRICS, *(f"{label} EM" for label in others)]
    lines = []
    names = [*summary["by_category"], "all"]
    for name in names:
        group = summary["scores"] if name == "all" else summary["by_category"][name]
        count = summary["scored"] if name == "all" else group["records"]
        cells = [name, str(count), *(f"{group.get(m, 0.0):.3f}" for m in METRICS)]
        for other in others.values():
            other_group = other["scores"] if name == "all" else other["by_category"].get(name, {})
            cells.append(f"{other_group['exact_match']:.3f}" if "exact_match" in other_group else "-")
        lines.append(cells)
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    rows = [header, *lines]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
