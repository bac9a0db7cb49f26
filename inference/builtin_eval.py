"""Does the model look? Held-out exact match per question kind of the built-in data, beside a blind baseline.

A language model can learn the built-in answers' templates and their most common fillers without looking at the
image. The baseline that shows how far that goes is the answer prior: for each held-out question, the most frequent
answer to the same question text (the whole conversation before the answer) in the run's training records, or, for
a question never seen in training, the most frequent answer of its kind. It is the best a model that ignores the
pixels can do on these templates. `kind_table` sets the trained model's and the untrained model's exact match per kind
beside the prior's; `sees` is the smoke test's verdict: on the kinds whose answer is in the image or video
(IMAGE_KINDS), pooled, the trained model must beat the prior by `margin` (exact-match points, 0-1).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from core.data_config import KINDS, TEXT_KINDS, DataConfig
from data.formats import SampleError, normalize_record
from data.pipeline import cache_root
from data.processing import parse_record
from data.row_meta import is_eval_row
from data.sources import open_records
from inference.loading import read_run_config
from inference.predictions import read_predictions
from inference.prompts import conversation_text
from inference.scoring import exact_match

IMAGE_KINDS = tuple(kind for kind in KINDS if kind not in TEXT_KINDS)  # their answer is in the image or video


def _question_and_answer(raw: Mapping, data_format: str) -> tuple[str, str] | None:
    """(question text, answer) of a record as prompts.py builds them; None for a record training would skip."""
    try:
        messages, _, _ = normalize_record(parse_record(raw), data_format)
    except SampleError:
        return None
    last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
    answer = "".join(item["text"] for item in messages[last]["content"] if item["type"] == "text").strip()
    return conversation_text(messages[:last]), answer


class AnswerPrior:
    """The most frequent training answer per question text, else per kind (module docstring)."""

    def __init__(self, by_question: dict[str, Counter], by_kind: dict[str, Counter]):
        self.by_question, self.by_kind = by_question, by_kind

    @classmethod
    def fit(cls, records: Iterable[tuple[Mapping, str | None]], data_format: str = "auto") -> AnswerPrior:
        """From (raw record, its kind) pairs of the training split."""
        by_question, by_kind = defaultdict(Counter), defaultdict(Counter)
        for raw, kind in records:
            pair = _question_and_answer(raw, data_format)
            if pair is not None:
                by_question[pair[0]][pair[1]] += 1
                by_kind[kind][pair[1]] += 1
        return cls(dict(by_question), dict(by_kind))

    def predict(self, question: str, kind: str | None) -> str:
        counts = self.by_question.get(question) or self.by_kind.get(kind) or Counter()
        return counts.most_common(1)[0][0] if counts else ""


def training_records(data: DataConfig) -> Iterable[tuple[Mapping, str | None]]:
    """(raw record, category) of the run's training split: every record train.py does not hold out."""
    records, _ = open_records(data, cache_root(data))
    for index, raw in enumerate(records):
        if not is_eval_row(index, data.eval_fraction):
            parsed = parse_record(raw) if raw else raw
            yield raw, (parsed.get("category") if isinstance(parsed, Mapping) else None)


@dataclass
class KindScores:
    """Exact match of one question kind (or a pool of kinds) on the held-out records."""

    records: int
    trained: float
    untrained: float | None
    prior: float

    @property
    def margin(self) -> float:
        return self.trained - self.prior


def _em(rows: list[Mapping]) -> float:
    return sum(row["scores"]["exact_match"] for row in rows) / len(rows) if rows else 0.0


def kind_table(
    trained: list[Mapping], prior: AnswerPrior, untrained: list[Mapping] | None = None
) -> dict[str, KindScores]:
    """Exact match per kind (and "image kinds", the pool of IMAGE_KINDS) of the trained model's prediction lines,
    the untrained model's (same records) and the prior's answers to the same questions."""
    scored = [row for row in trained if not row.get("skipped")]
    untrained_by_index = {row["index"]: row for row in untrained or [] if not row.get("skipped")}
    groups: dict[str, list[Mapping]] = defaultdict(list)
    for row in scored:
        groups[row.get("category") or "(none)"].append(row)
        if row.get("category") in IMAGE_KINDS:
            groups["image kinds"].append(row)
    table = {}
    for name, rows in sorted(groups.items(), key=lambda item: (item[0] == "image kinds", item[0])):
        prior_em = sum(
            max(exact_match(prior.predict(row["prompt"], row.get("category")), ref) for ref in row["references"])
            for row in rows
        ) / len(rows)
        before = [untrained_by_index[row["index"]] for row in rows if row["index"] in untrained_by_index]
        table[name] = KindScores(len(rows), _em(rows), _em(before) if untrained is not None else None, prior_em)
    return table


def format_kind_table(table: Mapping[str, KindScores]) -> str:
    header = ("kind", "n", "untrained", "trained", "prior", "trained - prior")
    lines = [header]
    for name, scores in table.items():
        before = "-" if scores.untrained is None else f"{scores.untrained:.0%}"
        lines.append(
            (name, str(scores.records), before, f"{scores.trained:.0%}", f"{scores.prior:.0%}", f"{scores.margin:+.0%}")
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines)


def held_out_report(run_dir: Path, predictions_file: Path, margin: float) -> dict:
    """The smoke test's check of a run from its held-out predictions (`predictions_file` and, beside it, the
    untrained model's `<stem>.init.jsonl`): {"kinds": {kind: KindScores as a dict}, "margin_required", "sees",
    "verdict"}; the table as text under "table"."""
    cfg = read_run_config(run_dir)
    prior = AnswerPrior.fit(training_records(cfg.data), cfg.data.format)
    init_file = predictions_file.with_name(predictions_file.stem + ".init.jsonl")
    untrained = read_predictions(init_file) if init_file.exists() else None
    table = kind_table(read_predictions(predictions_file), prior, untrained)
    passes, verdict = sees(table, margin)
    return {
        "kinds": {name: {**dataclasses.asdict(scores), "margin": scores.margin} for name, scores in table.items()},
        "margin_required": margin,
        "sees": passes,
        "verdict": verdict,
        "table": format_kind_table(table),
    }


def sees(table: Mapping[str, KindScores], margin: float) -> tuple[bool, str]:
    """Whether the trained model beats the prior by `margin` on the image kinds, pooled; and the verdict in words."""
    pooled = table.get("image kinds")
    if pooled is None:
        return False, "no held-out record of a kind that needs the image: nothing shows the model looks"
    verdict = (
        f"image kinds: trained {pooled.trained:.1%} vs prior {pooled.prior:.1%} ({pooled.margin:+.1%} over "
        f"{pooled.records} records; required > {margin:+.1%})"
    )
    return pooled.margin > margin, verdict
