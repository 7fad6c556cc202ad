"""Prompt layout: `| sys | [1] passage_1 .. [k] passage_k | turn_1 .. turn_m | question |`.

The system prefix, the text between conversation turns and the question suffix come from the
model's chat template, rendered once with a sentinel per message and split around them. Each piece
is tokenized on its own, exactly as at precompute time (no BOS inside, no tokenization across a
boundary), so a passage's token ids, and therefore its cache key, are the same wherever it lands.

Segment kinds: "sys" (the template's head with the system prompt, cached alone at position 0),
"marker" (`[n]` before passage n when the plan is `numbered`: a tiny chunk of its own, so the
passage's own tokens and key do not change with its rank), "passage", "turn" (an earlier message
of the conversation: its text and the template's text up to the next message's text; content-
addressed like a passage, so the next turn of the conversation finds it cached), "question" (the
latest user message in `QUESTION_TEMPLATE`, then the template's generation prompt; never cached).

With earlier turns the passages sit in the conversation's first message, before its text: the
template renders `system, user_1, assistant_1, .., user_latest`, and the passages are placed at
the start of user_1's content.
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
_FALLBACK_ROLES = {"user": "Question: ", "assistant": "Answer: "}


def _sentinel(i: int) -> str:
    return f"\u0000BLEND_{i}\u0000"


def passage_text(passage: str) -> str:
    """The exact text that is tokenized and cached for a passage."""
    return passage.strip() + PASSAGE_SEPARATOR


PRECOMPUTED_MARKERS = 10  # markers stored at ingestion like the system prefix (top_k 5 by default); others on first use


def marker_text(n: int) -> str:
    """The marker placed before the n-th passage (1-based) of a numbered prompt."""
    return f"[{n}]\n"


@dataclass(frozen=True)
class Segment:
    kind: str  # "sys" | "marker" | "passage" | "turn" | "question"
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
    prefix, _, suffix = split_conversation(tokenizer, system_prompt, ())
    return prefix, suffix


def split_conversation(tokenizer, system_prompt: str, turns) -> tuple[str, list[str], str]:
    """(prefix, one text per earlier turn, suffix) of `system, *turns, user` in the chat template.

    Turn i's text is its stripped text followed by the template's text up to the next message's
    text, so it is the same in every later prompt of the conversation. Without a chat template
    (or one that reorders or rewrites the messages) a plain `Question: / Answer:` format is used.
    """
    texts = [t.text.strip() for t in turns]
    messages = [{"role": "system", "content": system_prompt}]
    messages += [{"role": t.role, "content": _sentinel(i)} for i, t in enumerate(turns)]
    messages.append({"role": "user", "content": _SENTINEL})
    marks = [_sentinel(i) for i in range(len(turns))] + [_SENTINEL]
    if getattr(tokenizer, "chat_template", None):
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template refusing this role order: the plain format
            rendered = None
        if isinstance(rendered, str) and all(rendered.count(m) == 1 for m in marks):
            at = [rendered.index(m) for m in marks]
            if at == sorted(at):
                ends = [a + len(m) for a, m in zip(at, marks)]
                glue = [rendered[ends[i]:at[i + 1]] for i in range(len(turns))]
                return rendered[:at[0]], [t + g for t, g in zip(texts, glue)], rendered[ends[-1]:]
    plain = [f"{_FALLBACK_ROLES[t.role]}{x}\n\n" for t, x in zip(turns, texts)]
    return f"{system_prompt}\n\n", plain, "\nAnswer:"


def build_layout(encode, tokenizer, system_prompt: str, passages: tuple[str, ...], question: str,
                 turns=(), numbered: bool = False) -> PromptLayout:
    """Tokenize each piece alone and place it. `encode` maps text to ids without special tokens.

    `turns`: the conversation's earlier messages (`types.Turn`), oldest first; `numbered`: a
    `[n]` marker segment before passage n."""
    prefix, turn_texts, suffix = split_conversation(tokenizer, system_prompt, turns)
    bos = getattr(tokenizer, "bos_token_id", None)
    prefix_ids = list(encode(prefix))
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and prefix_ids[:1] != [bos]:
        prefix_ids = [bos, *prefix_ids]
    pieces = [("sys", prefix_ids)]
    for n, p in enumerate(passages, 1):
        if numbered:
            pieces.append(("marker", list(encode(marker_text(n)))))
        pieces.append(("passage", list(encode(passage_text(p)))))
    pieces += [("turn", list(encode(t))) for t in turn_texts]
    pieces.append(("question", list(encode(QUESTION_TEMPLATE.format(question=question.strip()) + suffix))))
    segments, offset = [], 0
    for kind, ids in pieces:
        if not ids:
            raise InputError(f"a {kind} segment tokenized to nothing")
        segments.append(Segment(kind, tuple(ids), offset))
        offset += len(ids)
    return PromptLayout(tuple(segments))
