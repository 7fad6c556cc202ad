"""PDF, HTML and DOCX files -> a title and sections, each section with where it came from: its page
(PDF, "page 3") or its heading path (HTML, DOCX: "Install > Linux"). A passage never spans two
sections, so every passage keeps its page or breadcrumb.

Parsers, chosen for size and speed (docs/formats.md has the measurements):
- PDF: pypdf (pure Python, no system library); a PDF whose pages hold no text (a scan without a text
  layer) is refused with a message, not ingested as empty passages;
- HTML: selectolax (the Lexbor C parser; a 1.6 MB wheel, no lxml): scripts, styles, navigation,
  headers and footers dropped, text taken block by block under the h1..h6 headings;
- DOCX: python-docx, after a check of the zip's declared sizes (a zip bomb is refused before anything
  is decompressed); headings are the paragraphs styled Title / Heading N.
Every problem is a `FormatError` naming what is wrong with the file.
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass

PDF_SUFFIXES = {".pdf"}
HTML_SUFFIXES = {".html", ".htm", ".xhtml"}
DOCX_SUFFIXES = {".docx"}
BINARY_SUFFIXES = PDF_SUFFIXES | HTML_SUFFIXES | DOCX_SUFFIXES

MAX_UNZIPPED_BYTES = 256 << 20  # a DOCX whose parts would expand beyond this is refused
MAX_ZIP_RATIO = 200  # ... and one whose part expands more than this many times (over 1 MiB)
PATH_SEP = " > "

_DROP_HTML = "script, style, noscript, template, nav, header, footer, aside, form, svg, iframe"
_BLOCKS = ("p", "li", "pre", "blockquote", "td", "th", "dd", "dt", "figcaption", "caption", "address")
_BLOCK_SELECTOR = ", ".join(_BLOCKS)
_HEADINGS = {f"h{i}": i for i in range(1, 7)}
_SPACES = re.compile(r"[ \t\r\f\v]+")


class FormatError(ValueError):
    """A file that cannot be read as its type says (corrupt, scanned, a zip bomb, the wrong content)."""


@dataclass(frozen=True)
class Section:
    text: str
    location: str = ""  # "page 3", or a heading path "Guide > Install > Linux"; "" before any heading


@dataclass(frozen=True)
class Parsed:
    title: str
    sections: tuple[Section, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(s.text for s in self.sections)


def parse(data: bytes, suffix: str, name: str) -> Parsed:
    """A PDF, HTML or DOCX file's content (by its suffix); `name` (the file's stem) is the fallback title."""
    if not data:
        raise FormatError("empty file (0 bytes)")
    suffix = suffix.lower()
    if suffix in PDF_SUFFIXES:
        parsed = parse_pdf(data, name)
    elif suffix in HTML_SUFFIXES:
        parsed = parse_html(data, name)
    elif suffix in DOCX_SUFFIXES:
        parsed = parse_docx(data, name)
    else:
        raise FormatError(f"unsupported file type {suffix or '(none)'}")
    if not parsed.sections:
        raise FormatError("no text found")
    return parsed


def _clean(text: str) -> str:
    lines = (_SPACES.sub(" ", line).strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line)


# ---------------------------------------------------------------------------- PDF
def parse_pdf(data: bytes, name: str) -> Parsed:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    if not data.lstrip()[:5] == b"%PDF-":
        raise FormatError("not a PDF (the content does not start with %PDF-)")
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise FormatError("the PDF is encrypted with a password")
        pages = [_clean(page.extract_text() or "") for page in reader.pages]
        meta_title = (reader.metadata.title if reader.metadata else None) or ""
    except FormatError:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise FormatError(f"not a readable PDF ({type(exc).__name__}: {exc})") from exc
    if not pages:
        raise FormatError("the PDF has no pages")
    sections = tuple(Section(text, f"page {i}") for i, text in enumerate(pages, 1) if text)
    if not sections:
        raise FormatError(f"no text layer in any of its {len(pages)} pages (a scanned PDF?); run OCR on it first")
    return Parsed(str(meta_title).strip() or name, sections)


# ---------------------------------------------------------------------------- HTML
def parse_html(data: bytes, name: str) -> Parsed:
    from selectolax.lexbor import LexborHTMLParser

    if b"\x00" in data[:4096]:
        raise FormatError("not an HTML file (binary content)")
    tree = LexborHTMLParser(data.decode("utf-8", errors="replace"))
    title_node = tree.css_first("title")
    for node in tree.css(_DROP_HTML):
        node.decompose()
    body = tree.body or tree.root
    if body is None:
        raise FormatError("no text found")
    headings: list[tuple[int, str]] = []
    sections = _Sections()
    for node in body.traverse():
        tag = node.tag
        if tag in _HEADINGS:
            level = _HEADINGS[tag]
            headings = [h for h in headings if h[0] < level] + [(level, _clean(node.text()))]
            sections.location = PATH_SEP.join(t for _, t in headings if t)
        elif tag in _BLOCKS and len(node.css(_BLOCK_SELECTOR)) == 1:  # innermost blocks only (css() counts the node)
            sections.add(node.text())
    if not sections.out:  # text outside any block element: the body's text as one section
        sections.add(body.text(separator="\n"))
    title = _clean(title_node.text()) if title_node is not None else ""
    first_h1 = next((t for level, t in headings if level == 1), "")
    return Parsed(title or first_h1 or name, tuple(sections.out))


class _Sections:
    """Text gathered under the current location; a new location starts a new section."""

    def __init__(self) -> None:
        self.location = ""
        self.out: list[Section] = []

    def add(self, text: str) -> None:
        text = _clean(text)
        if not text:
            return
        if self.out and self.out[-1].location == self.location:
            self.out[-1] = Section(self.out[-1].text + "\n\n" + text, self.location)
        else:
            self.out.append(Section(text, self.location))


# ---------------------------------------------------------------------------- DOCX
def check_zip(data: bytes) -> None:
    """Refuse a zip that is not one, or whose parts would expand too far (a zip bomb), before inflating it."""
    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise FormatError(f"not a DOCX (not a zip archive: {exc})") from exc
    total = sum(i.file_size for i in infos)
    if total > MAX_UNZIPPED_BYTES:
        raise FormatError(f"refused: its parts would expand to {total} bytes (limit {MAX_UNZIPPED_BYTES}; a zip bomb?)")
    for i in infos:
        if i.file_size > 1 << 20 and i.file_size > MAX_ZIP_RATIO * max(i.compress_size, 1):
            raise FormatError(f"refused: part {i.filename!r} expands {i.file_size // max(i.compress_size, 1)}x "
                              f"(limit {MAX_ZIP_RATIO}x; a zip bomb?)")


def _heading_level(style_name: str) -> int | None:
    if style_name == "Title":
        return 0
    m = re.fullmatch(r"Heading (\d)", style_name)
    return int(m.group(1)) if m else None


def parse_docx(data: bytes, name: str) -> Parsed:
    import docx
    from docx.table import Table

    check_zip(data)
    try:
        document = docx.Document(io.BytesIO(data))
        blocks = list(document.iter_inner_content())
        core_title = document.core_properties.title or ""
        style_names = {st.style_id: st.name for st in document.styles}  # Paragraph.style looks each one up: slow
    except Exception as exc:  # a missing part (KeyError), lxml's XMLSyntaxError, a wrong content type, ...
        raise FormatError(f"not a readable DOCX ({type(exc).__name__}: {exc})") from exc
    headings: list[tuple[int, str]] = []
    sections = _Sections()
    title = core_title.strip()
    for block in blocks:
        if isinstance(block, Table):
            sections.add("\n".join(" | ".join(c.text.strip() for c in row.cells) for row in block.rows))
            continue
        level = _heading_level(style_names.get(block._p.style) or "")  # the paragraph's w:pStyle id
        text = _clean(block.text)
        if level is None:
            sections.add(text)
        elif level == 0:  # the document's Title paragraph: its title, not a section
            title = title or text
        elif text:
            title = title or (text if level == 1 and not headings else "")
            headings = [h for h in headings if h[0] < level] + [(level, text)]
            sections.location = PATH_SEP.join(t for _, t in headings)
    return Parsed(title or name, tuple(sections.out))
