"""`python -m corpus_tools`: exit codes and messages, and a real SIGKILL mid-ingestion then resume."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corpus_cli.cli import main
from tests.helpers import FIXED_RATIO_ENV, ROOT

SAMPLE = ROOT / "sample_corpus" / "hotpotqa_sample.jsonl"


@pytest.fixture
def env(tiny_model_dir, tmp_path, monkeypatch) -> dict:
    values = {"BLENDSERVE_MODEL_NAME": str(tiny_model_dir), "BLENDSERVE_DATA_DIR": str(tmp_path / "data"),
              "BLENDSERVE_INGEST_BATCH_SIZE": "4", "BLENDSERVE_STORE_MEMORY_CACHE_MB": "64",
              "BLENDSERVE_STORE_DISK_CACHE_MB": "512", **FIXED_RATIO_ENV, "HF_HUB_OFFLINE": "1"}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)  # no stray .env
    return values


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def stats(capsys, data_dir: Path | None = None) -> dict:
    extra = ["--data-dir", str(data_dir)] if data_dir else []
    rc, out, _ = run_cli(capsys, *extra, "stats", "--json")
    assert rc == 0
    return json.loads(out)


def test_malformed_input_is_reported_skipped_or_stops_with_strict(env, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "Alpha", "text": "Alpha is the first letter."}\n{broken\n'
                   '{"title": "no text"}\n{"title": "Beta", "text": "Beta is the second letter."}\n')
    rc, out, err = run_cli(capsys, "ingest", "--no-progress", str(bad))
    assert rc == 1
    assert f"{bad}:2: invalid JSON" in err and f"{bad}:3: malformed record" in err
    assert "passages       2 (2 new" in out
    assert stats(capsys)["passages"] == 2

    rc, out, err = run_cli(capsys, "ingest", "--no-progress", "--strict", str(bad))
    assert rc == 2 and f"{bad}:2" in err and "--strict" in err

    rc, _, err = run_cli(capsys, "ingest", "--no-progress", str(tmp_path / "nope.txt"))
    assert rc == 2 and "no such file" in err and "nothing was ingested" in err

    unreadable = tmp_path / "latin1.txt"
    unreadable.write_bytes(b"caf\xe9 \xff\xfe")
    rc, _, err = run_cli(capsys, "ingest", "--no-progress", str(unreadable), str(bad))
    assert rc == 1 and "latin1.txt: unreadable" in err

    empty = tmp_path / "empty.jsonl"  # readable but empty: a problem (1), like an empty .txt
    empty.write_text("")
    rc, _, err = run_cli(capsys, "ingest", "--no-progress", str(empty))
    assert rc == 1 and "empty file" in err
    assert stats(capsys)["passages"] == 2  # nothing stored was lost along the way


def test_folder_ingest_delete_verify_gc(env, tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.md").write_text("# Aurora\n\nThe aurora is a natural light display in polar skies.\n")
    (docs / "sub" / "b.txt").write_text("Basalt is a fine-grained volcanic rock.\n\nIt forms from lava.\n")
    (docs / "skip.bin").write_bytes(b"\x00\x01")  # not a supported type: a folder walk passes over it
    rc, out, _ = run_cli(capsys, "ingest", "--no-progress", str(docs))
    assert rc == 0 and "documents      2" in out
    assert stats(capsys)["documents"] == 2
    rc, out, _ = run_cli(capsys, "delete", "sub/b.txt", "missing-doc")
    assert rc == 1 and "deleted sub/b.txt" in out
    assert stats(capsys)["passages"] == 1
    rc, out, _ = run_cli(capsys, "gc")
    assert rc == 0 and "dropped 0 unreferenced" in out
    rc, out, _ = run_cli(capsys, "verify", "--no-progress")
    assert rc == 0 and "verify: OK" in out


def _count_rows(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute("SELECT COUNT(*) FROM passages").fetchone()[0]
    except sqlite3.OperationalError:  # schema not created yet
        return 0


def _passage_ids(data_dir: Path) -> set[str]:
    with sqlite3.connect(data_dir / "passages.sqlite3") as conn:
        return {r[0] for r in conn.execute("SELECT id || kv_key FROM passages")}


def test_sigkill_mid_ingestion_then_resume_equals_a_clean_run(env, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:48]))
    data = Path(env["BLENDSERVE_DATA_DIR"])
    cmd = [sys.executable, "-m", "corpus_tools", "ingest", "--no-progress", str(corpus)]
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    at_kill = 0
    while time.monotonic() < deadline and proc.poll() is None:
        at_kill = _count_rows(data / "passages.sqlite3")
        if at_kill >= 8:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "ingestion finished before it could be killed"
    assert 8 <= at_kill < 48

    resumed = subprocess.run(cmd, cwd=tmp_path, env=child_env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    summary = resumed.stdout
    total = int(summary.split("passages       ")[1].split(" (")[0])
    new, stored = (int(x) for x in re.search(r"\((\d+) new, (\d+) already stored\)", summary).groups())
    assert total >= 48 and new + stored == total
    assert stored >= at_kill and 0 < new  # committed batches were not redone; the rest was
    clean = tmp_path / "clean"
    rc, _, _ = run_cli(capsys, "--data-dir", str(clean), "ingest", "--no-progress", str(corpus))
    assert rc == 0
    got, want = stats(capsys), stats(capsys, clean)
    for field in ("passages", "documents", "tokens", "kv_keys"):
        assert got[field] == want[field], field
    assert got["index"]["vectors"] == want["index"]["vectors"] == total == want["passages"]
    assert _passage_ids(data) == _passage_ids(clean)
    rc, out, err = run_cli(capsys, "verify", "--no-progress")
    assert rc == 0 and "verify: OK" in out, err


def test_pdf_html_docx_are_ingested_with_page_and_heading_path(env, tmp_path, capsys):
    from retrieval.passages import PassageDB
    from tests.files import HTML_PAGE, tiny_docx, tiny_pdf

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "towns.pdf").write_bytes(tiny_pdf(["Helsinki is the capital of Finland.", "Turku is older."]))
    (folder / "scan.pdf").write_bytes(tiny_pdf(["", ""]))
    (folder / "ferry.html").write_bytes(HTML_PAGE)
    (folder / "birds.docx").write_bytes(tiny_docx([("h1", "Birds"), ("h2", "Owls"), ("p", "Owls hunt at night.")]))
    rc, out, err = run_cli(capsys, "ingest", "--no-progress", str(folder))
    assert rc == 1 and "scan.pdf: no text layer in any of its 2 pages (a scanned PDF?)" in err
    db = PassageDB(Path(env["BLENDSERVE_DATA_DIR"]) / "passages.sqlite3")
    try:
        assert [(r.location, r.text) for r in db.document("towns.pdf")] == [
            ("page 1", "Helsinki is the capital of Finland."), ("page 2", "Turku is older.")]
        assert [r.location for r in db.document("ferry.html")] == ["Ferries", "Ferries > Tickets", "Ferries > Timetable"]
        assert [(r.location, r.source) for r in db.document("birds.docx")] == [("Birds > Owls", "file:docx")]
        assert db.document("scan.pdf") == []
    finally:
        db.close()
