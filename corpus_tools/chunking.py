"""Split a document into passages of at most `budget` model tokens, at paragraph and sentence
boundaries (words only when a single sentence is too long).

Token counts are exact: `tokens_of(text)` must return the ids the engine will cache for a passage
with this text (ingestion passes `engine.passage_tokens(format_passage(text, title))`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

TokensOf = Callable[[str], list[int]]

_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
PARAGRAPH_SEP = "\n\n"
SENTENCE_SEP = " "


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in _PARAGRAPH.split(text.replace("\r\n", "\n")) if p.strip()]


def sentences(paragraph: str) -> list[str]:
    out, start = [], 0
    for m in _SENTENCE.finditer(paragraph):
        end = m.start() + len(m.group(0).rstrip())
        out.append(paragraph[start:end].strip())
        start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


def _fits(text: str, tokens_of: TokensOf, budget: int) -> bool:
    return len(tokens_of(text)) <= budget


def _word_windows(sentence: str, tokens_of: TokensOf, budget: int) -> list[str]:
    """Greedy runs of words under the budget (a single over-long word stands alone)."""
    out: list[str] = []
    current: list[str] = []
    for word in sentence.split():
        if current and not _fits(" ".join([*current, word]), tokens_of, budget):
            out.append(" ".join(current))
            current = []
        current.append(word)
    if current:
        out.append(" ".join(current))
    return out


def units(text: str, tokens_of: TokensOf, budget: int) -> list[tuple[str, str]]:
    """(separator before it, piece): whole paragraphs when they fit, else sentences, else words."""
    out: list[tuple[str, str]] = []
    for para in paragraphs(text):
        if _fits(para, tokens_of, budget):
            out.append((PARAGRAPH_SEP, para))
            continue
        sep = PARAGRAPH_SEP
        for sent in sentences(para):
            pieces = [sent] if _fits(sent, tokens_of, budget) else _word_windows(sent, tokens_of, budget)
            for piece in pieces:
                out.append((sep, piece))
                sep = SENTENCE_SEP
    return out


def chunk_text(text: str, tokens_of: TokensOf, budget: int) -> list[tuple[str, list[int]]]:
    """Pack units greedily into passages. Returns [(passage text, its exact engine token ids)]."""
    if budget < 1:
        raise ValueError("budget must be positive")
    chunks: list[tuple[str, list[int]]] = []
    current, current_ids = "", []
    for sep, piece in units(text, tokens_of, budget):
        candidate = f"{current}{sep}{piece}" if current else piece
        ids = tokens_of(candidate)
        if current and len(ids) > budget:
            chunks.append((current, current_ids))
            candidate, ids = piece, tokens_of(piece)
        current, current_ids = candidate, ids
    if current:
        chunks.append((current, current_ids))
    return chunks
