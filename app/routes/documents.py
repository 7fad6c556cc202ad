"""/v1/documents: ingest (all or nothing), get and delete documents; /v1/passages/{id}: one passage."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from app.errors import error_response
from app.schemas import IngestRequest, IngestResponse
from app.service import run_job
from app.state import ReadyStack, State
from app.validation import check_documents, field_error, reject_surrogates
from corpus_tools.documents import Document
from corpus_tools.pipeline import DocumentRejected

router = APIRouter(tags=["documents"])


def _not_found(doc_id: str) -> JSONResponse:
    return error_response(404, f"document {doc_id!r} not found", "not_found")


@router.post("/v1/documents", response_model=IngestResponse, status_code=201,
             responses={400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def ingest_documents(req: IngestRequest, svc: State) -> IngestResponse:
    """All or nothing: the documents become visible together at the end, unless the request fails or
    times out first (then nothing is committed). Re-ingesting a doc_id replaces that document."""
    reject_surrogates(req)
    check_documents(svc.settings, req.documents)
    stack = svc.require_stack()
    docs_in = [Document(text=d.text, title=d.title, doc_id=d.doc_id, source="api") for d in req.documents]

    def ingest(job):
        return stack.pipeline.ingest(docs_in, progress=False, publish="request", before_commit=job.begin_commit,
                                     strict=True, should_stop=lambda: job.cancelled)

    try:
        summary = await run_job(svc.worker, ingest, svc.settings.service.request_timeout_s, "ingest")
    except DocumentRejected as exc:
        raise field_error(("documents", exc.index, exc.field), exc.message) from None
    body = IngestResponse(**asdict(summary))  # strict: a document that cannot be ingested was a 422 above
    svc.metrics.ingested.inc(body.new_passages)
    return body


@router.get("/v1/documents/{doc_id:path}", responses={404: {}})
async def get_document(doc_id: str, stack: ReadyStack) -> dict:
    doc = await run_in_threadpool(stack.pipeline.get_document, doc_id)
    if doc is None:
        return _not_found(doc_id)
    return jsonable_encoder(doc)


@router.delete("/v1/documents/{doc_id:path}", status_code=204, responses={404: {}})
async def delete_document(doc_id: str, stack: ReadyStack) -> Response:
    if not await run_in_threadpool(stack.pipeline.delete_document, doc_id):
        return _not_found(doc_id)
    return Response(status_code=204)


@router.get("/v1/passages/{passage_id}", responses={404: {}})
async def get_passage(passage_id: str, stack: ReadyStack) -> dict:
    """One stored passage by its id (a source's `id`): its text, document, title, location, tokens."""
    rows = await run_in_threadpool(stack.pipeline.db.get_many, [passage_id])
    row = rows.get(passage_id)
    if row is None:
        return error_response(404, f"passage {passage_id!r} not found", "not_found")
    return {"id": row.id, "doc_id": row.doc_id, "passage": row.seq, "title": row.title, "text": row.text,
            "location": row.location or None, "token_count": row.token_count, "source": row.source}
