"""HotpotQA / MuSiQue dev examples laid out as CacheBlend does: each paragraph (or group) is one passage."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from retrieval.text import format_passage

HOTPOTQA_FILE = "hotpotqa_dev500.jsonl"
MUSIQUE_FILE = "musique_dev.jsonl"


DATA_ENV = "BLENDSERVE_SHARED_DATA"


def default_data_dir() -> Path:
    """The shared QA data: $BLENDSERVE_SHARED_DATA when set, else ../shared/data beside the repository."""
    override = os.environ.get(DATA_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    return Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass(frozen=True)
class Paragraph:
    title: str
    text: str
    supporting: bool


@dataclass(frozen=True)
class Example:
    dataset: str
    id: str
    question: str
    answers: tuple[str, ...]
    paragraphs: tuple[Paragraph, ...]


def _read_jsonl(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def parse_hotpotqa(row: dict) -> Example:
    gold_titles = set(row["supporting_facts"]["title"])
    ctx = row["context"]
    paragraphs = tuple(Paragraph(t, "".join(s).strip(), t in gold_titles) for t, s in zip(ctx["title"], ctx["sentences"]))
    return Example("hotpotqa", row["id"], row["question"], (row["answer"],), paragraphs)


def parse_musique(row: dict) -> Example:
    answers = (row["answer"], *row.get("answer_aliases", []))
    paragraphs = tuple(Paragraph(p["title"], p["paragraph_text"].strip(), bool(p["is_supporting"]))
                       for p in row["paragraphs"])
    return Example("musique", row["id"], row["question"], answers, paragraphs)


def parse_row(row: dict) -> Example:
    """One dev row in either layout: MuSiQue ("paragraphs") or HotpotQA ("context")."""
    if "paragraphs" in row:
        return parse_musique(row)
    if "context" in row:
        return parse_hotpotqa(row)
    raise ValueError(f"row {row.get('id', '?')!r} is neither MuSiQue (paragraphs) nor HotpotQA (context); "
                     f"its keys: {sorted(row)}")


def read_examples(path: Path, n: int, offset: int = 0) -> list[Example]:
    """Examples offset..offset+n-1 of a MuSiQue or HotpotQA dev file (the layout is read per row)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found")
    return _take(path, parse_row, n, offset)


def _take(path: Path, parse: Callable[[dict], Example], n: int, offset: int) -> list[Example]:
    out: list[Example] = []
    for i, row in enumerate(_read_jsonl(path)):
        if i >= offset + n:
            break
        if i >= offset:
            out.append(parse(row))
    return out


def load_examples(dataset: str, n: int, data_dir: Path | None = None, offset: int = 0) -> list[Example]:
    """The first `n` examples (after `offset`) of "hotpotqa" or "musique" dev."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    name, parse = {"hotpotqa": (HOTPOTQA_FILE, parse_hotpotqa), "musique": (MUSIQUE_FILE, parse_musique)}[dataset]
    path = data_dir / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; pass --data-dir")
    return _take(path, parse, n, offset)


def select_paragraphs(ex: Example, max_paragraphs: int | None) -> tuple[Paragraph, ...]:
    """All supporting paragraphs plus the first distractors, in the original order, at most `max_paragraphs`."""
    if max_paragraphs is None or len(ex.paragraphs) <= max_paragraphs:
        return ex.paragraphs
    budget = max(0, max_paragraphs - sum(p.supporting for p in ex.paragraphs))
    keep = []
    for p in ex.paragraphs:
        if p.supporting:
            keep.append(p)
        elif budget > 0:
            keep.append(p)
            budget -= 1
    return tuple(keep)


def group_paragraphs(paragraphs: tuple[Paragraph, ...], max_words: int = 400) -> tuple[str, ...]:
    """Paragraphs merged in order into passages of at most ~`max_words` words (a long one stays alone)."""
    groups: list[list[Paragraph]] = [[]]
    words = 0
    for p in paragraphs:
        n = len(p.text.split())
        if groups[-1] and words + n > max_words:
            groups.append([])
            words = 0
        groups[-1].append(p)
        words += n
    return tuple("\n\n".join(format_passage(p.text, p.title) for p in g) for g in groups if g)


def passages_of(ex: Example, max_paragraphs: int | None = None, group_words: int | None = None) -> tuple[str, ...]:
    """The cached passages of an example: one per paragraph, or grouped to ~`group_words` words."""
    paragraphs = select_paragraphs(ex, max_paragraphs)
    if group_words:
        return group_paragraphs(paragraphs, group_words)
    return tuple(format_passage(p.text, p.title) for p in paragraphs)


def shuffled(passages: tuple[str, ...], seed: str) -> tuple[str, ...]:
    """A deterministic permutation whose first passage differs from the original one (when possible)."""
    order = list(passages)
    random.Random(seed).shuffle(order)
    if len(order) > 1 and order[0] == passages[0]:
        order = order[1:] + order[:1]
    return tuple(order)


@dataclass(frozen=True)
class Context:
    """A long context for the performance runs: a question and passages of about `n_tokens` tokens."""

    question: str
    passages: tuple[str, ...]
    n_tokens: int


def build_context(examples: list[Example], target_tokens: int, count_tokens: Callable[[str], int],
                  start: int = 0) -> Context:
    """Take example `start`'s question and its paragraphs, then other examples' paragraphs, up to the target."""
    if not examples:
        raise ValueError("no examples to build a context from")
    first = examples[start % len(examples)]
    passages: list[str] = []
    total = 0
    for k in range(len(examples)):
        for p in examples[(start + k) % len(examples)].paragraphs:
            text = format_passage(p.text, p.title)
            n = count_tokens(text)
            if total + n > target_tokens:
                return Context(first.question, tuple(passages), total)
            passages.append(text)
            total += n
    return Context(first.question, tuple(passages), total)
