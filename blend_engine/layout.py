"""Prompt layout: `| sys | passage_1 .. passage_k | question |`.

The system prefix and the question suffix come from the model's chat template, rendered once
with a sentinel user message and split around it. Each piece is tokenized on its own, exactly
as at precompute time (no BOS inside, no tokenization across a boundary), so a passage's token
ids, and therefore its cache key, are the same wherever it lands.
"""

from __future__ import annotations

from dataclasses import dataclass

from blend_engine.errors import InputError

DEFAULT_SYSTEM_PROMPT = (
    "You are a precise question answering assistant. Answer the question using only the "
    "passages the user gives. Reply with the short answer only: a name, date, number or "
    "short phrase, no explanation."
)
PASSAGE_SEPARATOR = "\n\n"
QUESTION_TEMPLATE = "Answer the question based on the passages above.\nQuestion: {question}"
_SENTINEL = "\u0000BLEND_SENTINEL\u0000"


def passage_text(passage: str) -> str:
    """The exact text that is tokenized and cached for a passage."""
    return passage.strip() + PASSAGE_SEPARATOR


@dataclass(frozen=True)
class Segment:
    kind: str  # "sys" | "passage" | "question"
    token_ids: tuple[int, ...]
    offset: int  # absolute position of the first token

    @property
    def end(self) -> int:
        return self.offset + len(self.token_ids)


@dataclass(frozen=True)
class PromptLayout:
    segments: tuple[Segment, ...]

    @property
    def n_tokens(self) -> int:
        return self.segments[-1].end

    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]


def split_chat_template(tokenizer, system_prompt: str) -> tuple[str, str]:
    """(prefix text, suffix text) around the user message in the model's chat template."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": _SENTINEL}]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if isinstance(rendered, str) and rendered.count(_SENTINEL) == 1:
            prefix, suffix = rendered.split(_SENTINEL)
            return prefix, suffix
    return f"{system_prompt}\n\n", "\nAnswer:"


def build_layout(encode, tokenizer, system_prompt: str, passages: tuple[str, ...], question: str) -> PromptLayout:
    """Tokenize each piece alone and place it. `encode` maps text to ids without special tokens."""
    prefix, suffix = split_chat_template(tokenizer, system_prompt)
    bos = getattr(tokenizer, "bos_token_id", None)
    prefix_ids = list(encode(prefix))
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and prefix_ids[:1] != [bos]:
        prefix_ids = [bos, *prefix_ids]
    pieces = [("sys", prefix_ids)]
    pieces += [("passage", list(encode(passage_text(p)))) for p in passages]
    pieces.append(("question", list(encode(QUESTION_TEMPLATE.format(question=question.strip()) + suffix))))
    segments, offset = [], 0
    for kind, ids in pieces:
        if not ids:
            raise InputError(f"a {kind} segment tokenized to nothing")
        segments.append(Segment(kind, tuple(ids), offset))
        offset += len(ids)
    return PromptLayout(tuple(segments))
