"""The HTTP routes by area; `ROUTERS` in the order `create_app` includes them (the OpenAPI order)."""

from __future__ import annotations

from app.routes import chat, completions, documents, jobs, ops, page, query

ROUTERS = (page.router, ops.health, query.router, chat.router, completions.router, jobs.router, documents.router,
           ops.router)
