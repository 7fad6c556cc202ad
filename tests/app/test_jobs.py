"""Upload jobs (POST /v1/documents/upload, GET/DELETE /v1/jobs/{id}) and the first-start sample corpus as a
background job, in-process on the tiny model: per-file progress and reasons, bad files named, cancellation,
jobs resumed after a restart, answers before the sample ingestion ends."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from corpus_tools.jobs import JOBS_FILE, JobFile, JobStore
from tests.files import HTML_PAGE, tiny_docx, tiny_pdf, zip_bomb
from tests.helpers import held_ingest_factory, make_settings, serving, svc, wait_ready

GOOD = {
    "towns.pdf": tiny_pdf(["Helsinki is the capital of Finland.", "Turku is the oldest town."]),
    "ferry.html": HTML_PAGE,
    "owls.docx": tiny_docx([("h1", "Birds"), ("h2", "Owls"), ("p", "Owls hunt voles at night.")]),
    "notes.md": b"# Notes\n\nThe sauna is heated with birch wood.\n",
}
BAD = {
    "scan.pdf": (tiny_pdf(["", ""]), "no text layer in any of its 2 pages"),
    "broken.pdf": (b"%PDF-1.4\n1 0 obj << /Type /Catalog >> trailer", "not a readable PDF"),
    "bomb.docx": (zip_bomb(), "zip bomb"),
    "fake.docx": (b"just text, not a zip", "not a DOCX"),
    "tool.exe": (b"MZ\x90\x00", "unsupported file type .exe"),
    "empty.txt": (b"", "empty file (0 bytes)"),
}


def wait_job(client: TestClient, job_id: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} not finished after {timeout}s: {job}")


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_stack_factory):
    settings = make_settings(tmp_path_factory.mktemp("jobs") / "data", max_upload_mb=1, max_upload_files=12)
    with serving(settings, tiny_stack_factory, [{"doc_id": "kept", "text": "A document stored before any upload."}]) as c:
        yield c


def test_upload_ingests_good_files_and_names_every_bad_one(client):
    before = svc(client).stack.pipeline.db.counts()["passages"]
    files = [("files", (n, d)) for n, d in GOOD.items()] + [("files", (n, d)) for n, (d, _) in BAD.items()]
    r = client.post("/v1/documents/upload", files=files)
    assert r.status_code == 202, r.text
    assert r.headers["location"] == f"/v1/jobs/{r.json()['id']}" and r.json()["kind"] == "upload"
    job = wait_job(client, r.json()["id"])
    by_name = {f["name"]: f for f in job["files"]}
    assert job["status"] == "done" and job["counts"]["done"] == len(GOOD) and job["counts"]["failed"] == len(BAD)
    for name in GOOD:
        f = by_name[name]
        assert f["state"] == "done" and f["passages"] >= 1 and f["processed"] == f["documents"] == 1, f
    assert by_name["towns.pdf"]["kv_computed"] == 2 and by_name["towns.pdf"]["new_passages"] == 2
    for name, (_, reason) in BAD.items():
        assert by_name[name]["state"] == "failed" and reason in by_name[name]["error"], by_name[name]
        assert name in by_name[name]["error"]
    assert client.get("/v1/documents/kept").status_code == 200  # nothing stored before was lost
    assert svc(client).stack.pipeline.db.counts()["passages"] == before + sum(by_name[n]["passages"] for n in GOOD)
    doc = client.get("/v1/documents/towns.pdf").json()
    assert [p["location"] for p in doc["passages"]] == ["page 1", "page 2"] and doc["source"] == "file:pdf"
    q = client.post("/v1/query", json={"question": "Who pays 42 euros for the Kvarken ferry?", "top_k": 1,
                                       "max_tokens": 2, "retrieval": "lexical"}).json()
    assert q["passages"][0]["doc_id"] == "ferry.html" and q["passages"][0]["location"] == "Ferries > Tickets"
    assert client.get("/v1/jobs").json()["jobs"][0]["id"] == job["id"]


def test_upload_refusals(client):
    only_bad = client.post("/v1/documents/upload", files=[("files", ("a.exe", b"x")), ("files", ("b.txt", b""))])
    assert only_bad.status_code == 422
    assert "a.exe: unsupported file type" in only_bad.json()["error"]["message"]
    assert "b.txt: empty file" in only_bad.json()["error"]["message"]
    big = client.post("/v1/documents/upload", files=[("files", ("big.txt", b"word " * 250_000))])
    assert big.status_code == 413 and "big.txt" in big.json()["error"]["message"]
    many = client.post("/v1/documents/upload", files=[("files", (f"{i}.txt", b"x")) for i in range(13)])
    assert many.status_code == 413 and "at most 12" in many.json()["error"]["message"]
    assert client.post("/v1/documents/upload").status_code == 422  # no files field
    odd = client.post("/v1/documents/upload", files=[("files", ("../../etc/notes.txt", b"Traversal is harmless."))])
    job = wait_job(client, odd.json()["id"])
    assert job["files"][0]["name"] == "notes.txt" and job["files"][0]["state"] == "done"
    assert client.get("/v1/jobs/nope").status_code == 404 and client.delete("/v1/jobs/nope").status_code == 404


def test_cancel_stops_the_job_and_keeps_what_was_published(client):
    runner = svc(client).jobs
    real, entered, release = runner.pipeline.ingest, threading.Event(), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    runner.pipeline.ingest = held
    try:
        files = [("files", ("one.txt", b"The first file is held.")), ("files", ("two.txt", b"Never ingested."))]
        job_id = client.post("/v1/documents/upload", files=files).json()["id"]
        assert entered.wait(30)
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
        release.set()
        job = wait_job(client, job_id)
    finally:
        runner.pipeline.ingest = real
        release.set()
    assert job["status"] == "cancelled" and [f["state"] for f in job["files"]] == ["cancelled", "cancelled"]
    assert client.get("/v1/documents/one.txt").status_code == 404 and client.get("/v1/documents/two.txt").status_code == 404
    assert client.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"  # finished: unchanged


def test_unfinished_jobs_resume_after_a_restart(tmp_path, tiny_stack_factory):
    data = tmp_path / "data"
    upload = data / "uploads" / "j1" / "0" / "resumed.txt"
    upload.parent.mkdir(parents=True)
    upload.write_text("This upload was queued when the service stopped.")
    store = JobStore(data / JOBS_FILE)  # what a process killed mid-job leaves behind
    store.create("upload", [JobFile("resumed.txt", str(upload), upload.stat().st_size),
                            JobFile("lost.txt", str(data / "uploads" / "j1" / "1" / "lost.txt"), 10)], job_id="j1")
    store.set_status("j1", "running")
    store.close()
    with serving(make_settings(data), tiny_stack_factory) as c:
        job = wait_job(c, "j1")
    assert job["status"] == "done"
    assert [(f["name"], f["state"]) for f in job["files"]] == [("resumed.txt", "done"), ("lost.txt", "failed")]
    assert "gone" in job["files"][1]["error"] and not (data / "uploads" / "j1").exists()


def test_first_start_answers_while_the_sample_is_ingested_in_the_background(tmp_path, tiny_stack_factory):
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(json.dumps({"title": f"T{i}", "text": f"Sample fact number {i} about saunas."})
                                for i in range(3)) + "\n")
    release = threading.Event()

    held_factory = held_ingest_factory(tiny_stack_factory, release)

    settings = make_settings(tmp_path / "data", ingest_sample_on_start=True, sample_corpus=sample)
    try:
        with TestClient(create_app(settings, held_factory)) as c:
            ready = wait_ready(c)  # ready before the sample is ingested
            assert ready["ingestion"]["status"] in ("queued", "running") and ready["index"]["documents"] == 0
            inline = c.post("/v1/query", json={"question": "Which number?", "max_tokens": 1,
                                               "documents": [{"text": "The number is 7."}]})
            assert inline.status_code == 200, inline.text
            release.set()
            job = wait_job(c, ready["ingestion"]["job_id"])
            assert job["kind"] == "sample" and job["files"][0]["processed"] == job["files"][0]["documents"] == 3
            done = wait_ready(c)
            assert done["ingestion"]["status"] == "done" and done["index"]["documents"] == 3
            q = c.post("/v1/query", json={"question": "Sample fact about saunas?", "top_k": 2, "max_tokens": 1})
            assert q.status_code == 200 and len(q.json()["passages"]) == 2
    finally:
        release.set()
    with serving(settings, tiny_stack_factory) as c:  # not the first start any more: no second sample job
        assert c.get("/v1/jobs").json()["jobs"] == [c.get(f"/v1/jobs/{job['id']}").json()]


def test_a_few_documents_with_their_own_ids_are_ingested_first():
    from corpus_tools.documents import Document
    from corpus_tools.jobs import first_slice

    docs = [Document("x", doc_id="a"), Document("y", doc_id="b"), Document("z", doc_id="a"), Document("w", doc_id="c")]
    head, rest = first_slice(docs, 2)
    assert [d.doc_id for d in head] == ["b", "c"]  # "a" is repeated: both its parts go in one ingestion
    assert [d.text for d in rest] == ["x", "z"]
    assert first_slice(docs, 0) == ([], docs)


def test_uploading_a_changed_file_replaces_its_passages_and_their_kv(client):
    engine = svc(client).stack.engine
    first = wait_job(client, client.post("/v1/documents/upload", files=[
        ("files", ("changing.txt", b"The ferry leaves at nine."))]).json()["id"])
    old = client.get("/v1/documents/changing.txt").json()["passages"]
    assert first["status"] == "done" and engine.store.contains(old[0]["kv_key"])
    second = wait_job(client, client.post("/v1/documents/upload", files=[
        ("files", ("changing.txt", b"The ferry now leaves at ten."))]).json()["id"])
    new = client.get("/v1/documents/changing.txt").json()["passages"]
    assert second["status"] == "done" and [p["text"] for p in new] == ["The ferry now leaves at ten."]
    assert not engine.store.contains(old[0]["kv_key"]) and engine.store.contains(new[0]["kv_key"])


def test_background_job_yields_to_requests_before_each_passage(tmp_path, tiny_stack_factory, monkeypatch):
    """While the engine serves requests (`busy`), a job precomputes nothing; once they end it goes on."""
    from corpus_tools import jobs as jobs_module
    from corpus_tools.jobs import JobRunner

    monkeypatch.setattr(jobs_module, "YIELD_MAX_S", 60.0)
    stack = tiny_stack_factory(make_settings(tmp_path / "data"))
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(json.dumps({"title": f"T{i}", "text": f"Sample fact number {i}."}) + "\n"
                              for i in range(3)))
    serving_requests, asked = threading.Event(), threading.Event()
    serving_requests.set()

    puts: list[int] = []

    def busy() -> bool:
        if not puts:
            puts.append(stack.store.stats().puts)  # the system prefix and markers are in; no passage yet
        asked.set()
        return serving_requests.is_set()

    runner = JobRunner(stack.pipeline, tmp_path / "data", busy=busy)
    try:
        runner.start()
        job = runner.submit("sample", [JobFile(sample.name, str(sample), sample.stat().st_size)])
        assert asked.wait(60)  # the job reached its first passage and asks whether requests are running
        assert stack.pipeline.db.counts()["passages"] == 0 and stack.store.stats().puts == puts[0]  # nothing computed
        serving_requests.clear()
        done = runner.wait_idle(job.id, 120)
        assert done.status == "done" and stack.pipeline.db.counts()["passages"] == 3
    finally:
        runner.close()
        stack.close()
