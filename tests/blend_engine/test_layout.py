"""The prompt layout of conversations and numbered passages: each piece tokenized alone, so a
passage's and an earlier turn's token ids (their cache keys) do not depend on where they land."""

from __future__ import annotations

import pytest

from blend_engine.layout import build_layout, marker_text
from blend_engine.types import BlendPlan, Turn
from tests.helpers import real_tokenizer

PASSAGES = ("France\nParis is the capital of France.", "Japan\nTokyo is the capital of Japan.")


@pytest.fixture(scope="module")
def tok():
    return real_tokenizer()


def _layout(tok, passages=PASSAGES, question="q?", turns=(), numbered=False, system="Be brief."):
    return build_layout(lambda s: tok.encode(s, add_special_tokens=False), tok, system, passages, question,
                        turns, numbered)


def _ids(layout, kind):
    return [s.token_ids for s in layout.segments if s.kind == kind]


def test_the_whole_conversation_renders_as_the_chat_template_does(tok):
    turns = (Turn("user", "Who wrote it?"), Turn("assistant", "Caryl Churchill."))
    layout = _layout(tok, question="When was she born?", turns=turns)
    assert [s.kind for s in layout.segments] == ["sys", "passage", "passage", "turn", "turn", "question"]
    # the passages open the first user message; the turns then follow exactly as the template renders them
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "".join(tok.decode(list(p)) for p in _ids(layout, "passage"))
                 + "Who wrote it?"},
                {"role": "assistant", "content": "Caryl Churchill."},
                {"role": "user", "content": "Answer the question based on the passages above.\nQuestion: When was she born?"}]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.decode(layout.token_ids()) == expected
    offsets = [s.offset for s in layout.segments]
    assert offsets == sorted(offsets) and layout.segments[0].offset == 0


def test_turns_keep_their_token_ids_from_one_turn_to_the_next(tok):
    t1 = (Turn("user", "Who wrote it?"), Turn("assistant", "Caryl Churchill."))
    t2 = t1 + (Turn("user", "When was she born?"), Turn("assistant", "In 1938."))
    second = _layout(tok, question="When was she born?", turns=t1)
    third = _layout(tok, passages=PASSAGES[::-1], question="Where?", turns=t2)
    assert _ids(third, "turn")[:2] == _ids(second, "turn")  # same ids, so the same chunk keys
    assert sorted(_ids(third, "passage")) == sorted(_ids(second, "passage"))
    # and without turns, the layout (and so every key) is exactly the single-question one
    assert _ids(_layout(tok), "sys") == _ids(second, "sys")


def test_numbered_passages_keep_their_ids_the_number_is_its_own_segment(tok):
    plain, numbered = _layout(tok), _layout(tok, numbered=True)
    assert [s.kind for s in numbered.segments] == ["sys", "marker", "passage", "marker", "passage", "question"]
    assert _ids(numbered, "passage") == _ids(plain, "passage")
    assert [tok.decode(list(m)) for m in _ids(numbered, "marker")] == [marker_text(1), marker_text(2)] == ["[1]\n", "[2]\n"]


def test_a_template_that_refuses_the_conversation_falls_back_to_a_plain_format(tok):
    class Refusing:
        chat_template = "x"
        bos_token_id = None

        def apply_chat_template(self, *a, **k):
            raise ValueError("Conversation roles must alternate")

    layout = build_layout(lambda s: tok.encode(s, add_special_tokens=False), Refusing(), "S", PASSAGES[:1], "q?",
                          (Turn("user", "u1"), Turn("assistant", "a1")))
    assert tok.decode(layout.token_ids()).endswith("Question: u1\n\nAnswer: a1\n\n"
                                                   "Answer the question based on the passages above.\nQuestion: q?\nAnswer:")


def test_turns_are_validated():
    with pytest.raises(ValueError, match="role"):
        Turn("tool", "x")
    with pytest.raises(ValueError, match="text"):
        Turn("user", "  ")
    assert BlendPlan(passages=("p",), question="q", turns=[Turn("user", "a")]).turns == (Turn("user", "a"),)
