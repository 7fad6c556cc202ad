"""How a stored passage (title, text) becomes the string the engine is given.

Ingestion and retrieval must agree on it exactly: the engine tokenizes this string, and its token
ids are the passage's KV cache key.
"""

from __future__ import annotations


def format_passage(text: str, title: str | None = None) -> str:
    """The title on its own line above the stripped text; the text alone when there is no title."""
    body = text.strip()
    return f"{title.strip()}\n{body}" if title and title.strip() else body
