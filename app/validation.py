"""Request checks that pydantic's static schema cannot express: lone UTF-16 surrogates anywhere
in a request, control characters in document ids, and the size limits set in ServiceSettings. Each
raises a 422 naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from app.settings import ServiceSettings

_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    """A lone UTF-16 surrogate (never valid in UTF-8); one C-speed scan, ASCII text skipped at once."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def _strings(value: Any, loc: tuple) -> Iterator[tuple[tuple, str]]:
    """Every string inside a request value with its location (field names, list indices, dict keys)."""
    if isinstance(value, str):
        yield loc, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _strings(getattr(value, name), (*loc, name))
        for name, extra in (value.model_extra or {}).items():
            yield loc + (name,), name
            yield from _strings(extra, (*loc, name))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*loc, key), str(key)
            yield from _strings(item, (*loc, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, (*loc, i))


def reject_surrogates(request: BaseModel) -> None:
    """422 for the first string holding a lone UTF-16 surrogate (it cannot be encoded as UTF-8)."""
    for loc, text in _strings(request, ()):
        if _has_surrogate(text):
            raise RequestValidationError([{
                "type": "value_error", "loc": ("body", *loc), "input": None,
                "msg": "contains a lone UTF-16 surrogate (invalid Unicode text)",
            }])


def field_error(loc: tuple, msg: str, value: Any = None) -> RequestValidationError:
    """A 422 for the body field at `loc`."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", *loc), "msg": msg, "input": value}])


def check_limits(settings: ServiceSettings, *, question: str, top_k: int, max_tokens: int, documents: list | None,
                 question_loc: tuple = ("question",)) -> None:
    """Limits that depend on ServiceSettings; 422 naming the field."""
    if len(question) > settings.limits.max_question_chars:
        raise field_error(question_loc, f"question is {len(question)} characters; the limit is "
                                        f"{settings.limits.max_question_chars}")
    if documents is None and top_k > settings.limits.max_top_k:  # top_k is unused when the caller brings documents
        raise field_error(("top_k",), f"top_k must be at most {settings.limits.max_top_k}", top_k)
    if max_tokens > settings.limits.max_new_tokens:
        raise field_error(("max_tokens",), f"max_tokens must be at most {settings.limits.max_new_tokens}", max_tokens)
    check_documents(settings, documents)


def check_documents(settings: ServiceSettings, documents: list | None) -> None:
    """Count, title and text limits of documents (each with `title` and `text`)."""
    if documents is None:
        return
    if len(documents) > settings.limits.max_documents:
        raise field_error(("documents",), f"{len(documents)} documents; the limit is {settings.limits.max_documents}")
    for i, doc in enumerate(documents):
        if doc.title is not None and len(doc.title) > settings.limits.max_title_chars:
            raise field_error(("documents", i, "title"), f"title is {len(doc.title)} characters; the limit is "
                                                         f"{settings.limits.max_title_chars}")
        if len(doc.text) > settings.limits.max_document_chars:
            raise field_error(("documents", i, "text"), f"document text is {len(doc.text)} characters; the limit "
                                                        f"is {settings.limits.max_document_chars}")
