"""Input documents and the readers for files, folders and JSONL (plain records, HotpotQA, MuSiQue).

Readers yield `Document`s and report problems as "FILE:LINE: message" strings through an error
callback; with strict=True the first problem raises `InputError` instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from corpus_tools.formats import BINARY_SUFFIXES, FormatError, Section, parse

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".text", ".md", ".markdown"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
JSON_SUFFIXES = {".json"}
SUPPORTED = TEXT_SUFFIXES | JSONL_SUFFIXES | JSON_SUFFIXES | BINARY_SUFFIXES
SUPPORTED_NAMES = ".txt, .md, .jsonl, .json, .pdf, .html, .docx"


@dataclass(frozen=True)
class Document:
    text: str
    title: str = ""
    doc_id: str | None = None
    source: str = "api"
    sections: tuple[Section, ...] = ()  # parsed files: the text by page / heading path (chunked one by one)


def document_from_file(data: bytes, suffix: str, name: str, doc_id: str, source: str) -> Document:
    """A PDF, HTML or DOCX file's bytes as one document with its sections; FormatError says what is wrong."""
    parsed = parse(data, suffix, name)
    return Document(text=parsed.text, title=parsed.title, doc_id=doc_id, source=source, sections=parsed.sections)


class InputError(Exception):
    """A problem with the input that stops the run (strict mode, or nothing readable)."""


def default_doc_id(title: str, text: str) -> str:
    """Content-derived id for documents that come without one."""
    return "doc-" + hashlib.sha256(f"{title.strip()}\x1f{text.strip()}".encode()).hexdigest()[:16]


def resolve_doc_id(doc: Document) -> str:
    return doc.doc_id.strip() if doc.doc_id and doc.doc_id.strip() else default_doc_id(doc.title, doc.text)


# ---------------------------------------------------------------------------- JSON records
def _hotpot(obj: dict) -> list[Document]:
    ctx = obj["context"]
    if isinstance(ctx, dict):  # Hugging Face layout: {title: [...], sentences: [[...], ...]}
        pairs = list(zip(ctx["title"], ctx["sentences"]))
    else:  # original layout: [[title, [sentences]], ...]
        pairs = [(p[0], p[1]) for p in ctx]
    docs = []
    for title, sents in pairs:
        text = "".join(sents).strip()  # sentences carry their own leading spaces
        if text:
            docs.append(Document(text=text, title=str(title), doc_id=f"hotpotqa:{title}", source="hotpotqa"))
    return docs


def _musique(obj: dict) -> list[Document]:
    docs = []
    for p in obj["paragraphs"]:
        text = str(p["paragraph_text"]).strip()
        if text:
            title = str(p.get("title", ""))
            docs.append(Document(text=text, title=title, doc_id=f"musique:{title}", source="musique"))
    return docs


def _record(obj: dict, default_source: str) -> list[Document]:
    text = obj["text"]
    title = obj.get("title") or ""
    if not isinstance(text, str) or not isinstance(title, str):
        raise ValueError("'text' and 'title' must be strings")
    if not text.strip():
        raise ValueError("'text' is empty")
    doc_id = obj.get("doc_id", obj.get("id"))
    return [Document(text=text, title=title, doc_id=str(doc_id) if doc_id not in (None, "") else None,
                     source=str(obj.get("source") or default_source))]


def documents_from_record(obj: object, default_source: str = "jsonl") -> list[Document]:
    """One JSON value -> documents. Raises ValueError/KeyError/TypeError when it is none of the formats."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "context" in obj and "question" in obj:
        return _hotpot(obj)
    if "paragraphs" in obj:
        return _musique(obj)
    if "text" in obj:
        return _record(obj, default_source)
    raise ValueError("no 'text' field (and not a HotpotQA or MuSiQue record)")


# ---------------------------------------------------------------------------- files
ErrorSink = Callable[[str], None]


class Reader:
    """Walks paths and yields documents; problems go to `errors` (or raise when strict)."""

    def __init__(self, strict: bool = False, on_error: ErrorSink | None = None) -> None:
        self.strict = strict
        self.errors: list[str] = []
        self._on_error = on_error
        self.files = 0

    def _error(self, message: str) -> None:
        if self.strict:
            raise InputError(message)
        self.errors.append(message)
        if self._on_error:
            self._on_error(message)
        else:
            logger.warning("%s", message)

    def read(self, paths: Iterable[str | Path]) -> Iterator[Document]:
        for raw in paths:
            path = Path(raw)
            if path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED
                               and not any(part.startswith(".") for part in p.relative_to(path).parts))
                if not files:
                    self._error(f"{path}: no supported files ({SUPPORTED_NAMES}) in this folder")
                for f in files:
                    yield from self.read_file(f, f.relative_to(path).as_posix())
            elif path.exists():
                yield from self.read_file(path, path.name)
            else:
                self._error(f"{path}: no such file or directory")

    def read_file(self, path: Path, rel: str) -> Iterator[Document]:
        suffix = path.suffix.lower()
        if suffix not in SUPPORTED:
            self._error(f"{path}: unsupported file type {suffix or '(none)'}; use {SUPPORTED_NAMES}")
            return
        if suffix in BINARY_SUFFIXES:
            yield from self._parsed_file(path, rel, suffix)
            return
        try:
            content = path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is dropped
        except (OSError, UnicodeDecodeError) as exc:
            self._error(f"{path}: unreadable: {exc}")
            return
        self.files += 1
        if not content.strip():
            self._error(f"{path}: empty file")
            return
        if suffix in TEXT_SUFFIXES:
            yield from self._text_file(path, rel, content)
        elif suffix in JSONL_SUFFIXES:
            yield from self._jsonl(path, content)
        else:
            yield from self._json(path, content)

    def _parsed_file(self, path: Path, rel: str, suffix: str) -> Iterator[Document]:
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._error(f"{path}: unreadable: {exc}")
            return
        self.files += 1
        try:
            doc = document_from_file(data, suffix, path.stem, rel, f"file:{suffix.lstrip('.')}")
        except FormatError as exc:
            self._error(f"{path}: {exc}")
            return
        yield doc

    def _text_file(self, path: Path, rel: str, content: str) -> Iterator[Document]:
        title = path.stem
        first = content.lstrip().splitlines()[0].strip()
        if path.suffix.lower() in (".md", ".markdown") and first.startswith("#"):
            title = first.lstrip("#").strip() or title
        yield Document(text=content, title=title, doc_id=rel, source=f"file:{path.suffix.lower().lstrip('.')}")

    def _jsonl(self, path: Path, content: str) -> Iterator[Document]:
        for lineno, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            yield from self._parse(path, lineno, line)

    def _parse(self, path: Path, lineno: int, line: str) -> list[Document]:
        try:
            return documents_from_record(json.loads(line))
        except json.JSONDecodeError as exc:
            self._error(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})")
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self._error(f"{path}:{lineno}: malformed record: {exc!s}")
        return []

    def _json(self, path: Path, content: str) -> Iterator[Document]:
        try:
            data = json.loads(content)
        except json.JSONDecodeError as exc:
            self._error(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}")
            return
        items = data if isinstance(data, list) else [data]
        if not items:
            self._error(f"{path}: empty JSON array")
        for i, item in enumerate(items, 1):
            try:
                yield from documents_from_record(item)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                self._error(f"{path}: item {i}: malformed record: {exc!s}")
