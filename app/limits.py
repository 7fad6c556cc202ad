"""Request body size limit (413), enforced before anything parses the body."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimitMiddleware:
    """Refuses bodies above `max_bytes`: by Content-Length up front, else while streaming in."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.default_bytes = max_bytes
        self.per_path = per_path or {}  # a route with its own limit (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope.get("path", ""), self.default_bytes)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                too_big = False
            if too_big:
                await self._reject(send, int(declared), limit)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)

    @staticmethod
    async def _reject(send: Send, size: int, limit: int) -> None:
        msg = f"request body of {size} bytes exceeds the limit of {limit} bytes"
        body = json.dumps({"detail": msg, "error": {"message": msg, "type": "invalid_request_error",
                                                    "code": "body_too_large"}}).encode()
        await send({
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")],
        })
        await send({"type": "http.response.body", "body": body})
