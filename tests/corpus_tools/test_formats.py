"""PDF, HTML and DOCX parsing (files the tests make): text by page or heading path, titles, and a clear
error for every bad file (scanned PDF, corrupt PDF, zip bomb, wrong content for the extension, 0 bytes)."""

from __future__ import annotations

import re

import pytest

from corpus_tools.documents import Reader
from corpus_tools.formats import FormatError, Section, parse
from tests.files import HTML_PAGE, tiny_docx, tiny_pdf, zip_bomb


def test_pdf_pages_become_sections_with_their_page():
    parsed = parse(tiny_pdf(["Helsinki is the capital.\nIt has a harbour.", "", "Turku was the capital."],
                            title="Finnish towns"), ".pdf", "towns")
    assert parsed.title == "Finnish towns"
    assert [s.location for s in parsed.sections] == ["page 1", "page 3"]  # page 2 has no text
    assert "Helsinki is the capital." in parsed.sections[0].text and "harbour" in parsed.sections[0].text
    assert parse(tiny_pdf(["x y z"]), ".PDF", "stem").title == "stem"


def test_html_keeps_heading_paths_and_drops_page_chrome():
    parsed = parse(HTML_PAGE, ".html", "ferry")
    assert parsed.title == "Ferry guide"
    assert parsed.sections == (
        Section("The Kvarken ferry crosses the Gulf of Bothnia.", "Ferries"),
        Section("Adults pay 42 euros.\n\nChildren travel free.", "Ferries > Tickets"),
        Section("Two departures a day from Vaasa.", "Ferries > Timetable"),
    )
    text = parsed.text
    assert "secret" not in text and "Home" not in text and "Copyright" not in text and "color" not in text


def test_docx_headings_and_title():
    data = tiny_docx([("title", "Field guide"), ("p", "Intro text."), ("h1", "Birds"), ("p", "Owls hoot."),
                      ("h2", "Night"), ("p", "Most owls hunt at night."), ("h1", "Trees"), ("p", "Pines.")])
    parsed = parse(data, ".docx", "guide")
    assert parsed.title == "Field guide"
    assert [(s.location, s.text) for s in parsed.sections] == [
        ("", "Intro text."), ("Birds", "Owls hoot."), ("Birds > Night", "Most owls hunt at night."),
        ("Trees", "Pines.")]


@pytest.mark.parametrize(("data", "suffix", "message"), [
    (tiny_pdf(["", ""]), ".pdf", "no text layer in any of its 2 pages"),
    (b"%PDF-1.4\n1 0 obj << /Type /Catalog >> garbage", ".pdf", "not a readable PDF"),
    (b"", ".pdf", "empty file (0 bytes)"),
    (b"hello, I am text", ".pdf", "not a PDF"),
    (b"PK\x03\x04 broken zip", ".docx", "not a DOCX"),
    (b"plain text", ".docx", "not a DOCX"),
    (zip_bomb(), ".docx", "zip bomb"),
    (b"\x00\x01\x02binary", ".html", "not an HTML file"),
    (b"<html><body><script>x()</script></body></html>", ".html", "no text found"),
])
def test_bad_files_get_a_clear_error(data, suffix, message):
    with pytest.raises(FormatError, match=re.escape(message)):
        parse(data, suffix, "f")


def test_the_reader_names_the_bad_file_and_reads_the_others(tmp_path):
    (tmp_path / "a.pdf").write_bytes(tiny_pdf(["Page one text."]))
    (tmp_path / "scan.pdf").write_bytes(tiny_pdf([""]))
    (tmp_path / "b.html").write_bytes(HTML_PAGE)
    (tmp_path / "c.docx").write_bytes(tiny_docx([("h1", "Only"), ("p", "Body.")]))
    reader = Reader()
    docs = {d.doc_id: d for d in reader.read([tmp_path])}
    assert sorted(docs) == ["a.pdf", "b.html", "c.docx"]
    assert docs["a.pdf"].source == "file:pdf" and docs["a.pdf"].sections[0].location == "page 1"
    assert len(reader.errors) == 1 and "scan.pdf" in reader.errors[0] and "no text layer" in reader.errors[0]
