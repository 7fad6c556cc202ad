"""GET /: the web page (app/static), outside the OpenAPI schema."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)


@router.get("/", response_class=FileResponse)
async def index() -> FileResponse:
    """The web page (app/static): ask, watch the answer stream in, see what was recomputed."""
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})
