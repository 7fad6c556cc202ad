"""Ingestion pipeline end to end with a tiny random Llama (real tokenizer) and the real embedder."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from blend_engine.cancel import Cancelled
from blend_engine.layout import PRECOMPUTED_MARKERS, passage_text
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, Mode
from blendserve_config.settings import Settings
from blendserve_config.stack import Stack, build_stack, ingest_sample_on_first_start
from corpus_tools.chunking import chunk_text, sentences
from corpus_tools.documents import Document, InputError, Reader
from retrieval.embedder import Embedder
from retrieval.text import format_passage
from tests.helpers import FIXED_RATIO, tiny_runner

SCOTT = ("Scott Derrickson (born July 16, 1966) is an American director, screenwriter and producer. He lives in "
         "Los Angeles, California. He is best known for directing horror films such as \"Sinister\" and "
         "\"Doctor Strange.\"")
ED = ("Edward Davis Wood Jr. (October 10, 1924 - December 10, 1978) was an American filmmaker, actor, writer, "
      "producer, and director.")
VOLCANO = ("Mount Etna is an active stratovolcano on the east coast of Sicily, Italy. "
           "It is the tallest active volcano in Europe.")
CHESS = "The Sicilian Defence is a chess opening that begins with the moves 1.e4 c5."


def hotpot_record(qid: str, question: str, paras: list[tuple[str, str]]) -> dict:
    return {"id": qid, "question": question, "answer": "x", "type": "bridge", "level": "hard",
            "supporting_facts": {"title": [], "sent_id": []},
            "context": {"title": [t for t, _ in paras], "sentences": [[s] for _, s in paras]}}


def write_fixture_corpus(folder: Path) -> list[Path]:
    """Two HotpotQA questions sharing a paragraph, one MuSiQue record, a JSONL record file and a Markdown file."""
    folder.mkdir(parents=True, exist_ok=True)
    hp = folder / "hotpot.jsonl"
    hp.write_text("\n".join(json.dumps(r) for r in [
        hotpot_record("q1", "Were Scott Derrickson and Ed Wood of the same nationality?",
                      [("Scott Derrickson", SCOTT), ("Ed Wood", ED)]),
        hotpot_record("q2", "Which is taller?", [("Ed Wood", ED), ("Mount Etna", VOLCANO)]),
    ]) + "\n")
    mq = folder / "musique.jsonl"
    mq.write_text(json.dumps({"id": "m1", "question": "?", "answer": "x", "paragraphs": [
        {"idx": 0, "title": "Sicilian Defence", "paragraph_text": CHESS, "is_supporting": True}]}) + "\n")
    md = folder / "notes.md"
    md.write_text("# Bakery notes\n\nThe Blue Fern bakery in Tallinn bakes rye bread every Tuesday morning.\n\n"
                  "Its owner, Maret Kask, opened it in 2011 after ten years as a ship's cook.\n")
    return [hp, mq, md]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return tiny_runner()


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def make_stack(tmp: Path, runner, embedder, **kw) -> Stack:
    settings = Settings(_env_file=None, data_dir=tmp / "data", chunk_tokens=kw.pop("chunk_tokens", 64),
                        ingest_batch_size=kw.pop("ingest_batch_size", 3), recompute_ratio=FIXED_RATIO,
                        memory_cache_mb=64, disk_cache_mb=256, **kw)
    return build_stack(settings, runner=runner, embedder=embedder)


@pytest.fixture
def stack(tmp_path, runner, embedder):
    s = make_stack(tmp_path, runner, embedder)
    yield s
    s.close()


# ---------------------------------------------------------------------------- chunking
def test_chunks_respect_the_exact_token_budget_and_keep_every_word(runner):
    text = "\n\n".join(" ".join(f"Sentence {p}.{i} talks about topic number {i} in detail." for i in range(9))
                       for p in range(4))

    def tokens_of(t: str) -> list[int]:
        return runner.encode(format_passage(t, "Title") + "\n\n")

    chunks = chunk_text(text, tokens_of, 48)
    assert len(chunks) > 4
    for t, ids in chunks:
        assert ids == tokens_of(t) and len(ids) <= 48
        assert t.endswith(".")  # sentence boundaries only
    assert " ".join(t for t, _ in chunks).split() == text.split()


def test_short_document_is_one_chunk_and_sentence_splitter_keeps_abbrev_numbers():
    assert sentences("It cost 3.5 dollars. Then it rained! Why? Yes.") == [
        "It cost 3.5 dollars.", "Then it rained!", "Why?", "Yes."]
    chunks = chunk_text("one short paragraph", lambda t: t.split(), 256)
    assert chunks == [("one short paragraph", ["one", "short", "paragraph"])]


# ---------------------------------------------------------------------------- readers
def test_reader_formats_and_dedup_inputs(tmp_path):
    paths = write_fixture_corpus(tmp_path / "in")
    docs = list(Reader().read([tmp_path / "in"]))
    by_source = {}
    for d in docs:
        by_source.setdefault(d.source, []).append(d)
    assert [d.doc_id for d in by_source["hotpotqa"]] == ["hotpotqa:Scott Derrickson", "hotpotqa:Ed Wood",
                                                          "hotpotqa:Ed Wood", "hotpotqa:Mount Etna"]
    assert by_source["musique"][0].title == "Sicilian Defence"
    md = by_source["file:md"][0]
    assert md.title == "Bakery notes" and md.doc_id == "notes.md"
    assert len(paths) == 3


def test_malformed_jsonl_lines_are_reported_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "A", "text": "Alpha text."}\n{not json\n\n{"title": "B"}\n[1, 2]\n'
                   '{"title": "C", "text": "Gamma text.", "doc_id": "c"}\n')
    reader = Reader()
    docs = list(reader.read([bad, tmp_path / "missing.txt"]))
    assert [d.title for d in docs] == ["A", "C"]
    assert docs[1].doc_id == "c" and docs[0].doc_id is None
    assert [e.split(": ")[0] for e in reader.errors] == [f"{bad}:2", f"{bad}:4", f"{bad}:5", f"{tmp_path}/missing.txt"]
    assert "invalid JSON" in reader.errors[0] and "no 'text' field" in reader.errors[1]
    with pytest.raises(InputError, match=r"bad.jsonl:2"):
        list(Reader(strict=True).read([bad]))


def test_byte_order_mark_and_empty_files(tmp_path):
    """A BOM (as some editors write) does not cost the first record; empty inputs are reported alike."""
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + b'{"title": "A", "text": "Alpha text."}\r\n{"title": "B", "text": "Beta."}\r\n')
    md = tmp_path / "note.md"
    md.write_bytes("\ufeff# Heading\nBody text.".encode())
    empties = [tmp_path / "empty.jsonl", tmp_path / "empty.txt", tmp_path / "empty.json"]
    empties[0].write_text("\n\n")
    empties[1].write_text("")
    empties[2].write_text("[]")
    reader = Reader()
    docs = list(reader.read([bom, md, *empties]))
    assert [d.title for d in docs] == ["A", "B", "Heading"]
    assert [e.split(": ")[0] for e in reader.errors] == [str(p) for p in empties]


# ---------------------------------------------------------------------------- pipeline
def test_ingest_retrieve_and_blend_from_stored_caches(tmp_path, stack):
    paths = write_fixture_corpus(tmp_path / "in")
    summary = stack.pipeline.ingest(Reader().read(paths))
    assert summary.errors == ()
    assert summary.documents == 6  # 4 hotpot paragraphs (one repeated), 1 musique, 1 markdown
    assert summary.passages == summary.new_passages == 5  # the repeated Ed Wood paragraph once
    assert summary.kv_computed == 5 and summary.kv_bytes == summary.tokens * stack.pipeline.kv_bytes_per_token()
    assert stack.pipeline.stats()["passages"] == 5 and len(stack.retriever.index) == 5

    hits = stack.retriever.search("Who opened the Blue Fern bakery in Tallinn?", k=3)
    assert hits[-1].doc_id == "notes.md"  # best_last: the best passage sits next to the question
    assert hits[-1].score >= max(h.score for h in hits)

    puts_before = stack.store.stats().puts
    plan = BlendPlan(passages=tuple(h.passage for h in hits), question="Who opened the bakery?", mode=Mode.BLEND)
    result = stack.engine.run(plan, GenerationConfig(max_tokens=4, temperature=0.0))
    report = result.report
    assert report.cache_misses == 0
    assert report.cache_hits == len(hits) + 1  # the passages and the system prefix
    assert report.recomputed_tokens < report.context_tokens
    assert stack.store.stats().puts == puts_before  # nothing had to be recomputed and stored


def test_kv_byte_counts_come_from_the_codec_with_the_int8_scales(tmp_path, runner, embedder):
    """int8 stores one byte a value plus an fp16 scale per token and head: the ingest summary and
    stats() (what /readyz and /v1/status show) count the bytes the store holds, scales included."""
    s = make_stack(tmp_path, runner, embedder, kv_format="int8")
    try:
        summary = s.pipeline.ingest([Document(text=VOLCANO, title="Etna", doc_id="etna"),
                                     Document(text=ED, title="Ed", doc_id="ed")])
        keys = [p["kv_key"] for d in ("etna", "ed") for p in s.pipeline.get_document(d)["passages"]]
        stored = sum(s.store.meta(key).nbytes for key in keys)  # ChunkMeta.nbytes: the codec's count
        assert summary.kv_computed == len(keys) == 2 and summary.kv_bytes == stored
        kv = s.pipeline.stats()["kv"]
        assert kv["format"] == "int8" and kv["bytes_estimate"] == stored
    finally:
        s.close()



def test_each_passage_is_tokenized_once_during_ingestion(stack, monkeypatch):
    """Chunking measures candidate texts; the final passage's ids are reused to key and precompute its KV."""
    calls: Counter[str] = Counter()
    real = stack.engine.runner.encode

    def encode(text: str) -> list[int]:
        calls[text] += 1
        return real(text)

    monkeypatch.setattr(stack.engine.runner, "encode", encode)
    stack.pipeline.ingest([Document(text="\n\n".join([SCOTT, ED, VOLCANO, CHESS]), title="Mixed", doc_id="mixed")])
    passages = stack.pipeline.get_document("mixed")["passages"]
    assert len(passages) > 1
    assert [calls[passage_text(format_passage(p["text"], p["title"]))] for p in passages] == [1] * len(passages)


def test_reingest_skips_everything_and_new_passages_only_are_added(tmp_path, stack):
    paths = write_fixture_corpus(tmp_path / "in")
    first = stack.pipeline.ingest(Reader().read(paths))
    again = stack.pipeline.ingest(Reader().read(paths))
    assert again.new_passages == 0 and again.kv_computed == 0 and again.skipped == first.passages
    more = stack.pipeline.ingest([Document(text="Kiwi birds cannot fly.", title="Kiwi", doc_id="kiwi")])
    assert (more.new_passages, more.kv_computed, more.doc_ids) == (1, 1, ("kiwi",))
    assert stack.pipeline.stats()["passages"] == first.passages + 1


def test_long_document_is_chunked_and_documents_can_be_read_and_deleted(stack):
    text = "\n\n".join(f"Paragraph {i} says that the lighthouse keeper number {i} logged the storm at dawn." * 2
                       for i in range(8))
    s = stack.pipeline.ingest([Document(text=text, title="Lighthouse log", doc_id="log")])
    doc = stack.pipeline.get_document("log")
    assert doc is not None and len(doc["passages"]) == s.passages > 2
    assert all(p["token_count"] <= 64 for p in doc["passages"])
    keys = [p["kv_key"] for p in doc["passages"]]
    assert all(stack.store.contains(k) for k in keys)
    assert stack.pipeline.delete_document("log") is True
    assert stack.pipeline.get_document("log") is None
    assert len(stack.retriever.index) == 0 and not any(stack.store.contains(k) for k in keys)
    assert stack.pipeline.delete_document("log") is False


def test_delete_keeps_kv_shared_with_another_document(stack):
    stack.pipeline.ingest([Document(text=CHESS, title="Chess", doc_id="a"), Document(text=CHESS, title="Chess", doc_id="b")])
    key = stack.pipeline.get_document("a")["passages"][0]["kv_key"]
    assert key == stack.pipeline.get_document("b")["passages"][0]["kv_key"]
    stack.pipeline.delete_document("a")
    assert stack.store.contains(key)
    stack.pipeline.delete_document("b")
    assert not stack.store.contains(key)


def test_verify_finds_and_repairs_missing_kv_and_index_entries(stack):
    stack.pipeline.ingest([Document(text=VOLCANO, title="Etna", doc_id="etna"), Document(text=ED, title="Ed", doc_id="ed")])
    assert stack.pipeline.verify().ok
    row = stack.pipeline.get_document("etna")["passages"][0]
    stack.store.delete(row["kv_key"])
    stack.retriever.index.remove(stack.retriever.index.ids()[:1])
    report = stack.pipeline.verify()
    assert not report.ok and report.index_missing == 1
    assert any("KV cache missing" in p for p in report.problems)
    assert stack.pipeline.verify(repair=True).repaired == 2
    assert stack.pipeline.verify().problems == ()
    assert stack.store.contains(row["kv_key"]) and len(stack.retriever.index) == 2


def test_gc_drops_unreferenced_kv_only(stack):
    stack.pipeline.ingest([Document(text=ED, title="Ed", doc_id="ed")])
    orphan_key, _, _ = stack.engine.ensure_cached("An orphan passage nobody references.")
    result = stack.pipeline.gc()
    assert result["supported"] and result["dropped"] == 1
    assert not stack.store.contains(orphan_key)
    assert stack.pipeline.verify().ok and stack.store.contains(stack.pipeline.system_key()[0])


def test_concurrent_ingests_do_not_duplicate(stack):
    docs = [Document(text=f"Fact number {i}: the river {i} flows north.", title=f"River {i}", doc_id=f"r{i}")
            for i in range(12)]
    errors: list[BaseException] = []

    def work(part):
        try:
            stack.pipeline.ingest(part)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(docs[i:] + docs[:i],)) for i in (0, 4, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert stack.pipeline.stats()["passages"] == 12 and len(stack.retriever.index) == 12
    assert stack.retriever.search("Which way does river 7 flow?", k=1)[0].doc_id == "r7"


def _recording_publish(stack) -> list:
    """Every batch the passage store publishes, appended as it returns (the store's own publish runs)."""
    published: list = []
    real = stack.pipeline.db.publish

    def publish(*args, **kwargs):
        published.append(real(*args, **kwargs))
        return published[-1]

    stack.pipeline.db.publish = publish
    return published


def test_sample_ingestion_stops_at_shutdown_and_keeps_what_it_published(tmp_path, runner, embedder):
    """Shutdown interrupts the first-start ingestion at its next checkpoint (between layers and
    batches): the batches published before stay, nothing is left half-written, and the next start
    does not ingest the sample again (the store is not empty)."""
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(json.dumps({"title": f"River {i}", "text": f"River {i} flows north. " * 3,
                                            "doc_id": f"r{i}", "source": "sample"}) for i in range(9)) + "\n")
    s = make_stack(tmp_path, runner, embedder, sample_corpus=sample, ingest_batch_size=3)
    published = _recording_publish(s)
    try:
        assert ingest_sample_on_first_start(s, should_stop=lambda: len(published) >= 1) is None
        assert len(published) == 1  # stopped at the checkpoint after the first publish: no later batch
        assert 0 < s.pipeline.db.counts()["passages"] == len(published[0][1]) < 9  # what it published stayed
        assert s.pipeline.db.incomplete() == {}  # nothing left staged
        report = s.pipeline.verify()
        assert report.ok and report.incomplete == () and report.index_missing == report.index_extra == 0
        assert ingest_sample_on_first_start(s) is None  # not empty: no second sample ingestion
    finally:
        s.close()


def test_ingest_stops_at_its_next_batch_once_should_stop_turns_true(tmp_path, runner, embedder):
    """An explicit `should_stop` (no thread-local scope): once true, the ingestion raises at its next
    batch; the batches it published stay visible and whole, nothing of the stopped one is staged.
    `pace` is called before each passage's precompute, and not once after the stop."""
    s = make_stack(tmp_path, runner, embedder, ingest_batch_size=3)
    docs = [Document(text=f"River {i} flows north past the mill. " * 3, title=f"River {i}", doc_id=f"r{i}")
            for i in range(9)]
    published, paced = _recording_publish(s), []
    try:
        with pytest.raises(Cancelled, match="between ingestion batches"):
            s.pipeline.ingest(docs, publish="batch", should_stop=lambda: len(published) >= 2,
                              pace=lambda: paced.append(len(published)))
        assert len(published) == 2 and paced == [0, 0, 0, 1, 1, 1]  # two batches of 3, none after the stop
        visible = [r.doc_id for _, rows in published for r in rows]  # one passage per document
        kept = [d.doc_id for d in docs if s.pipeline.get_document(d.doc_id) is not None]
        assert 0 < len(kept) < 6 and kept == visible  # what it published stayed, nothing else
        assert s.pipeline.db.counts()["passages"] == len(kept) == len(s.retriever.index)
        assert s.pipeline.db.incomplete() == {}  # the staged rows of a document not yet published were dropped
        report = s.pipeline.verify()
        assert report.ok and report.index_missing == report.index_extra == 0
    finally:
        s.close()


def test_stack_reopens_persisted_corpus_and_ingests_sample_once(tmp_path, runner, embedder):
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(json.dumps({"title": t, "text": x, "doc_id": t, "source": "sample"})
                                for t, x in [("Etna", VOLCANO), ("Chess", CHESS)]) + "\n")
    s1 = make_stack(tmp_path, runner, embedder, sample_corpus=sample)
    assert ingest_sample_on_first_start(s1).new_passages == 2
    assert ingest_sample_on_first_start(s1) is None  # not empty any more
    s1.close()
    s2 = make_stack(tmp_path, runner, embedder, sample_corpus=sample)
    try:
        assert len(s2.retriever.index) == 2
        hit = s2.retriever.search("Which volcano is the tallest in Europe?", k=1)[0]
        assert hit.doc_id == "Etna" and s2.store.contains(s2.pipeline.get_document("Etna")["passages"][0]["kv_key"])
    finally:
        s2.close()


LIGHTHOUSE = "\n\n".join(f"Paragraph {i} says that the lighthouse keeper number {i} logged the storm at dawn." * 2
                         for i in range(8))


def test_batched_precompute_stores_the_kv_of_one_at_a_time(tmp_path, runner, embedder, monkeypatch):
    """BLENDSERVE_INGEST_PRECOMPUTE_BATCH forced above 1 on the CPU: the same passages, the same stored KV
    (fp16; right-padded batches of the model's own forward), the same summary counts."""
    docs = [Document(text=LIGHTHOUSE, title="Lighthouse log", doc_id="log"),
            Document(text=VOLCANO, title="Etna", doc_id="etna"), Document(text=ED, title="Ed", doc_id="ed")]
    out = {}
    for n in (1, 4):
        forwards = []
        s = make_stack(tmp_path / str(n), runner, embedder, precompute_batch=n, ingest_batch_size=8)
        real = s.engine.chunks.precompute_many
        monkeypatch.setattr(s.engine.chunks, "precompute_many", lambda lists, batch_size, real=real, forwards=forwards:
                            forwards.append(len(lists)) or real(lists, batch_size))
        try:
            assert s.pipeline.ingestion.precompute_batch == n
            summary = s.pipeline.ingest(docs)
            keys = [p["kv_key"] for d in ("log", "etna", "ed") for p in s.pipeline.get_document(d)["passages"]]
            out[n] = (summary, keys, {k: s.store.get(k) for k in keys})
        finally:
            s.close()
    (one, keys, kv1), (many, keys4, kv4) = out[1], out[4]
    assert keys == keys4 and len(keys) > 4  # more passages than one forward takes
    markers, *forwards = forwards  # the first forward stores the passage markers [1]..[10] (`fixed_chunks`)
    assert markers == PRECOMPUTED_MARKERS
    assert max(forwards) == 4 and sum(forwards) == many.kv_computed  # batched: every passage, 4 per forward
    assert (many.kv_computed, many.kv_bytes, many.passages) == (one.kv_computed, one.kv_bytes, one.passages)
    for k in keys:
        a, b = kv1[k], kv4[k]
        assert a.k.dtype == torch.float16 and a.k.shape == b.k.shape
        # one at a time runs the layer loop (passages of <= 128 tokens project through cpu_kernels.rows_linear),
        # batched runs transformers' forward (MKL): the sums' order differs, so ~0.2% of values land one fp16
        # ulp apart (identical before the kernel; rtol 2 ** -10 is one ulp)
        for x, y in ((a.k, b.k), (a.v, b.v)):
            assert (x == y).float().mean() > 0.99
            torch.testing.assert_close(y, x, atol=1e-6, rtol=2 ** -10)


def test_cancelled_between_precompute_batches_commits_nothing(tmp_path, runner, embedder):
    s = make_stack(tmp_path, runner, embedder, precompute_batch=2, ingest_batch_size=8)
    s.pipeline.ensure_system_prefix()  # the fixed chunks own forward, before the counted ones
    chunks, calls = s.engine.chunks, []
    real = chunks.precompute_many

    def counted(lists, batch_size=16):
        calls.append(len(lists))
        return real(lists, batch_size)

    chunks.precompute_many = counted
    try:
        with pytest.raises(Cancelled, match="between precompute batches"):  # cancelled after the second forward
            s.pipeline.ingest([Document(text=LIGHTHOUSE, title="Lighthouse log", doc_id="log")], publish="request",
                              should_stop=lambda: len(calls) >= 2)
        assert calls == [2, 2]  # stopped before the third forward of the first ingest batch
        assert s.pipeline.db.counts()["passages"] == 0 and len(s.retriever.index) == 0
        assert s.pipeline.get_document("log") is None and not s.pipeline.db.incomplete()
    finally:
        del chunks.precompute_many
        s.close()


def test_precompute_batch_defaults_to_one_on_the_cpu_and_is_validated(monkeypatch):
    from corpus_tools.ingest import default_precompute_batch

    assert default_precompute_batch("cpu") == 1 and default_precompute_batch("cuda") > 1
    monkeypatch.setenv("BLENDSERVE_INGEST_PRECOMPUTE_BATCH", "0")
    with pytest.raises(ValueError, match="precompute_batch"):
        Settings(_env_file=None)
    monkeypatch.setenv("BLENDSERVE_INGEST_PRECOMPUTE_BATCH", "")
    assert Settings(_env_file=None).ingest.precompute_batch is None
