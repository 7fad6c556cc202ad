"""Which OpenAI request fields this server honours, and a 400 naming any other one.

Honoured: see `app.schemas` (`_OpenAIRequest`, `ChatCompletionRequest`, `CompletionRequest`).
Accepted only with the value that changes nothing (`NEUTRAL`): anything else is a 400 naming the
field, never silently ignored. Accepted and ignored because they only describe the caller
(`INFORMATIONAL`). Any other field is a 400 ("unrecognized request argument", as OpenAI answers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from app.service import BadRequest

UNSUPPORTED = "unsupported_parameter"


def _none_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x for x in neutral)


NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_none_or([]), "tool calling is not supported"),
    "tool_choice": (_none_or("none"), "tool calling is not supported"),
    "functions": (_none_or([]), "function calling is not supported"),
    "function_call": (_none_or("none"), "function calling is not supported"),
    "parallel_tool_calls": (lambda v: True, ""),  # meaningless without tools, which are refused
    "response_format": (_none_or({"type": "text"}), "only response_format {\"type\": \"text\"} is supported"),
    "presence_penalty": (_none_or(0), "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (_none_or(0), "frequency_penalty is not supported (only 0)"),
    "logit_bias": (_none_or({}), "logit_bias is not supported"),
    "modalities": (_none_or(["text"]), "only the text modality is supported"),
    "audio": (_none_or(), "audio output is not supported"),
    "prediction": (_none_or(), "predicted outputs are not supported"),
    "web_search_options": (_none_or(), "web search is not supported"),
    "reasoning_effort": (_none_or(), "reasoning_effort is not supported"),
    "echo": (_none_or(False), "echo is not supported"),
    "suffix": (_none_or(), "suffix (insertion) is not supported"),
}
INFORMATIONAL = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


def refuse_unsupported(req: BaseModel) -> None:
    """400 naming the first field this server cannot honour."""
    values = {**{name: getattr(req, name) for name in type(req).model_fields}, **(req.model_extra or {})}
    for name, (neutral, why) in NEUTRAL.items():
        if name in values and not neutral(values[name]):
            raise BadRequest(f"unsupported field `{name}`: {why}", param=name, code=UNSUPPORTED)
    for name in req.model_extra or {}:
        if name not in NEUTRAL and name not in INFORMATIONAL:
            raise BadRequest(f"unrecognized request argument supplied: {name}", param=name, code=UNSUPPORTED)
    best_of, n = values.get("best_of"), values.get("n") or 1
    if best_of is not None and best_of != n:
        raise BadRequest("unsupported field `best_of`: only best_of == n is supported", param="best_of",
                         code=UNSUPPORTED)


def message_texts(messages: list) -> list[tuple[str, str]]:
    """(role, text) per chat message; 400 for tool messages and content parts other than text."""
    out = []
    for i, m in enumerate(messages):
        if m.role in ("tool", "function"):
            raise BadRequest(f"unsupported message role `{m.role}`: tool calling is not supported",
                             param=f"messages.{i}.role", code=UNSUPPORTED)
        for name in ("tool_calls", "function_call", "audio"):
            if (m.model_extra or {}).get(name):
                raise BadRequest(f"unsupported field `{name}` in a message: tool calling and audio are not "
                                 f"supported", param=f"messages.{i}.{name}", code=UNSUPPORTED)
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.get("type") != "text":
                    raise BadRequest(f"unsupported content part type {part.get('type')!r}: only text is supported",
                                     param=f"messages.{i}.content.{j}.type", code=UNSUPPORTED)
        out.append((m.role, m.text()))
    return out
