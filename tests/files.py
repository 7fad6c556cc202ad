"""Small PDF, DOCX and HTML files made by the tests themselves (no fixtures on disk)."""

from __future__ import annotations

import io
import zipfile


def _pdf_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def tiny_pdf(pages: list[str], title: str | None = None) -> bytes:
    """A valid PDF, one page per string (each line a text line in Helvetica); an empty string is a page with
    no text layer, as a scan is. A minimal writer: objects, a cross-reference table, a trailer."""
    objects: list[bytes] = []
    n_pages = len(pages)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n_pages))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n_pages} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, text in enumerate(pages):
        lines = "".join(f"({_pdf_text(line)}) Tj 0 -16 Td " for line in text.splitlines())
        stream = f"BT /F1 12 Tf 72 720 Td {lines}ET".encode() if text else b"q Q"
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                       f"/Contents {5 + 2 * i} 0 R >>".encode())
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    info = None
    if title is not None:
        objects.append(f"<< /Title ({_pdf_text(title)}) >>".encode())
        info = len(objects)
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    trailer = f"<< /Size {len(objects) + 1} /Root 1 0 R" + (f" /Info {info} 0 R" if info else "") + " >>"
    out += f"trailer\n{trailer}\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def tiny_docx(blocks: list[tuple[str, str]], title: str | None = None) -> bytes:
    """A DOCX from (kind, text) blocks: kind "h1".."h3" a heading, "p" a paragraph, "title" the Title paragraph."""
    import docx

    document = docx.Document()
    if title is not None:
        document.core_properties.title = title
    for kind, text in blocks:
        if kind == "title":
            document.add_heading(text, 0)
        elif kind.startswith("h"):
            document.add_heading(text, int(kind[1:]))
        else:
            document.add_paragraph(text)
    buf = io.BytesIO()
    document.save(buf)
    return buf.getvalue()


def zip_bomb(expanded_mib: int = 4) -> bytes:
    """A zip named like a DOCX whose one part expands from a few KiB to `expanded_mib` MiB of zeros."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", b"\0" * (expanded_mib << 20))
    return buf.getvalue()


HTML_PAGE = b"""<!doctype html><html><head><title>Ferry guide</title><style>p{color:red}</style>
<script>var secret = "never indexed";</script></head><body>
<nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<h1>Ferries</h1><p>The Kvarken ferry crosses the Gulf of Bothnia.</p>
<h2>Tickets</h2><ul><li>Adults pay 42 euros.</li><li>Children travel free.</li></ul>
<h2>Timetable</h2><p>Two departures a day from <b>Vaasa</b>.</p>
<footer>Copyright nobody</footer></body></html>"""
