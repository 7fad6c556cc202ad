"""A chat request's `messages` as a conversation: system prompt, earlier turns, latest question.

- System and developer messages, wherever they are, make the system prompt (joined by a blank line).
- User and assistant messages are the turns, in order; consecutive messages of one role are joined.
- The last of them must be a user message: it is the question. The earlier ones (`Turn`s) go
  through the model's chat template after the passages (`blend_engine.layout`).

Retrieval searches with the latest user message made standalone by one deterministic rule
(`retrieval_query`): a follow-up (fewer than `FOLLOW_UP_MAX_WORDS` words, a pronoun or
demonstrative that points back, or a continuation opener such as "and", "what about") is searched
together with the previous user message and the start of the answer to it; any other question is
searched alone. No model call is made.

A conversation that does not fit the model context is trimmed oldest-first (`fit_turns`): whole
exchanges (a user message and the answer to it) are dropped until the prompt and the requested
new tokens fit; the response says so in a note.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from blend_engine.types import Turn

FOLLOW_UP_MAX_WORDS = 4
ANSWER_CONTEXT_CHARS = 200  # of the previous answer, added to a follow-up's search
POINTING_WORDS = frozenset(
    "it its it's itself he him his himself she her hers herself they them their theirs themselves this that "
    "these those there then former latter same one ones".split()
)
CONTINUATIONS = ("and ", "and?", "what about", "how about", "also", "why?", "how so", "which one", "who else")
_WORD = re.compile(r"[\w']+")


class ConversationError(ValueError):
    """A message list that cannot be answered; `loc` names the field (like `("messages", 3, "role")`)."""

    def __init__(self, loc: tuple, message: str) -> None:
        super().__init__(message)
        self.loc = loc


@dataclass(frozen=True)
class Conversation:
    system: str | None  # None: the server's default system prompt
    turns: tuple[Turn, ...]  # earlier user and assistant messages, oldest first
    question: str  # the latest user message
    question_index: int  # its index in `messages`

    @property
    def search(self) -> str:
        return retrieval_query(self.turns, self.question)


def from_messages(messages: Sequence[tuple[str, str]]) -> Conversation:
    """(role, text) pairs (OpenAI roles; tool roles are refused before this) -> a conversation."""
    system = [text.strip() for role, text in messages if role in ("system", "developer") and text.strip()]
    said = [(i, role, text.strip()) for i, (role, text) in enumerate(messages)
            if role in ("user", "assistant") and text.strip()]
    if not said or said[-1][1] != "user":
        last = len(messages) - 1
        raise ConversationError(("messages", last, "role"), "the last message with text must be a user message: "
                                                            "it is the question to answer")
    merged: list[tuple[str, str]] = []
    for _, role, text in said[:-1]:
        if merged and merged[-1][0] == role:
            merged[-1] = (role, f"{merged[-1][1]}\n\n{text}")
        else:
            merged.append((role, text))
    index, _, question = said[-1]
    if merged and merged[-1][0] == "user":  # two user messages in a row end the conversation: one question
        question = f"{merged.pop()[1]}\n\n{question}"
    return Conversation(system="\n\n".join(system) or None, turns=tuple(Turn(r, t) for r, t in merged),
                        question=question, question_index=index)


def is_follow_up(question: str) -> bool:
    """Whether a question probably leans on the conversation before it (see the module's rule)."""
    text = question.strip().lower()
    words = _WORD.findall(text)
    return (len(words) < FOLLOW_UP_MAX_WORDS or any(w in POINTING_WORDS for w in words)
            or text.startswith(CONTINUATIONS))


def retrieval_query(turns: Sequence[Turn], question: str) -> str:
    """What retrieval searches for: the question, or a follow-up with the exchange before it."""
    users = [i for i, t in enumerate(turns) if t.role == "user"]
    if not users or not is_follow_up(question):
        return question
    last = users[-1]
    answer = next((t.text for t in turns[last + 1:] if t.role == "assistant"), "")
    return " ".join(x for x in (turns[last].text, answer[:ANSWER_CONTEXT_CHARS], question) if x)


def exchanges_to_drop(turn_tokens: Sequence[int], roles: Sequence[str], excess: int) -> int:
    """How many of the oldest turns to drop so that at least `excess` tokens go: whole exchanges
    (a user turn with the answers after it), so the kept turns still start with a user message."""
    if excess <= 0:
        return 0
    dropped, freed = 0, 0
    while dropped < len(turn_tokens) and freed < excess:
        freed += turn_tokens[dropped]
        dropped += 1
        while dropped < len(turn_tokens) and roles[dropped] != "user":
            freed += turn_tokens[dropped]
            dropped += 1
    return dropped
