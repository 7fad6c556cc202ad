"""File uploads as background ingestion jobs: POST /v1/documents/upload, GET /v1/jobs[/{id}], DELETE /v1/jobs/{id}."""

from __future__ import annotations

import shutil
from pathlib import Path, PurePosixPath
from typing import Annotated

from fastapi import APIRouter, File, UploadFile
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from app.errors import error_response
from app.schemas import JobOut, JobsOut
from app.state import State
from app.validation import field_error
from corpus_tools.documents import SUPPORTED, SUPPORTED_NAMES
from corpus_tools.jobs import JobFile
from logsafe import has_control

router = APIRouter(tags=["documents"])

UPLOAD_PATH = "/v1/documents/upload"
_CHUNK = 1 << 20


def _not_found(job_id: str) -> JSONResponse:
    return error_response(404, f"job {job_id!r} not found", "not_found")


def safe_name(raw: str | None, idx: int) -> str:
    """The file's own name without any folder part (a client may send `../../x.pdf`); `upload-N` when none."""
    name = PurePosixPath((raw or "").replace("\\", "/")).name.strip()
    return name if name and name not in (".", "..") else f"upload-{idx}"


def cheap_problem(name: str, size: int) -> str:
    """What is wrong with a file before reading it ("" when nothing): type by extension, emptiness."""
    suffix = Path(name).suffix.lower()
    if suffix not in SUPPORTED:
        return f"{name}: unsupported file type {suffix or '(none)'}; use {SUPPORTED_NAMES}"
    if size == 0:
        return f"{name}: empty file (0 bytes)"
    return ""


def _save(upload: UploadFile, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    upload.file.seek(0)
    with target.open("wb") as out:
        shutil.copyfileobj(upload.file, out, _CHUNK)


@router.post(UPLOAD_PATH, status_code=202, response_model=JobOut, responses={413: {}, 422: {}, 503: {}})
async def upload(svc: State, files: Annotated[list[UploadFile], File(description="one or many files")]) -> JSONResponse:
    """Multipart upload of .pdf, .html, .docx, .txt, .md, .jsonl or .json files, ingested by a background job:
    the job's id at once (202), its progress at GET /v1/jobs/{id}. A file over BLENDSERVE_LIMITS_MAX_UPLOAD_MB or
    more than BLENDSERVE_LIMITS_MAX_UPLOAD_FILES files is a 413 (nothing is queued); a file of an unsupported type
    or of 0 bytes is a failed entry of the job, naming it (a 422 when no file is left to ingest); a file that
    cannot be parsed (corrupt, scanned PDF, zip bomb) fails in the job with its reason."""
    settings = svc.settings
    if len(files) > settings.limits.max_upload_files:
        return error_response(413, f"{len(files)} files; at most {settings.limits.max_upload_files} per upload "
                                   "(BLENDSERVE_LIMITS_MAX_UPLOAD_FILES)", "too_many_files")
    names = [safe_name(f.filename, i) for i, f in enumerate(files)]
    for i, (f, name) in enumerate(zip(files, names)):
        if has_control(name):
            raise field_error(("files", i), "file names must not contain control characters")
        if (f.size or 0) > settings.limits.max_upload_mb << 20:
            return error_response(413, f"{name}: {f.size} bytes, over the limit of {settings.limits.max_upload_mb} MiB "
                                       "(BLENDSERVE_LIMITS_MAX_UPLOAD_MB); nothing was queued", "file_too_large")
    problems = [cheap_problem(name, f.size or 0) for f, name in zip(files, names)]
    if all(problems):
        return error_response(422, "no file to ingest: " + "; ".join(problems), "no_ingestible_file")
    runner = svc.require_jobs()
    job_id, folder = runner.new_upload_dir()
    entries = []
    for i, (f, name, problem) in enumerate(zip(files, names, problems)):
        target = folder / str(i) / name
        if not problem:
            await run_in_threadpool(_save, f, target)
        entries.append(JobFile(name, str(target), f.size or 0, "failed" if problem else "queued", error=problem))
    job = runner.submit("upload", entries, job_id)
    return JSONResponse(JobOut.model_validate(job.as_dict()).model_dump(), status_code=202,
                        headers={"Location": f"/v1/jobs/{job.id}"})


@router.get("/v1/jobs", response_model=JobsOut)
async def list_jobs(svc: State) -> JobsOut:
    """The newest jobs (at most 100), newest first."""
    runner = svc.require_jobs()
    jobs = await run_in_threadpool(lambda: [runner.get(i) for i in runner.store.ids()])
    return JobsOut(jobs=[JobOut.model_validate(j.as_dict()) for j in jobs if j is not None])


@router.get("/v1/jobs/{job_id}", response_model=JobOut, responses={404: {}})
async def get_job(job_id: str, svc: State):
    job = await run_in_threadpool(svc.require_jobs().get, job_id)
    return _not_found(job_id) if job is None else JobOut.model_validate(job.as_dict())


@router.delete("/v1/jobs/{job_id}", response_model=JobOut, responses={404: {}})
async def cancel_job(job_id: str, svc: State):
    """Cancel: files not started are not ingested, the current one stops at its next checkpoint (documents it
    already published stay). A finished job is returned unchanged."""
    job = await run_in_threadpool(svc.require_jobs().cancel, job_id)
    return _not_found(job_id) if job is None else JobOut.model_validate(job.as_dict())
