"""Request checks that pydantic's static schema cannot express: lone UTF-16 surrogates anywhere
in a request, and control characters in document ids. Each raises a 422 naming the field."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


def has_control(text: str) -> bool:
    """C0/C1 control characters (newline, carriage return, ESC, NUL, ...) and line/paragraph separators."""
    return any(unicodedata.category(ch) == "Cc" or ch in "\u2028\u2029" for ch in text)


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
