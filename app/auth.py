"""Optional bearer-token auth: with `BLENDSERVE_API_KEY` set, everything but health needs it."""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/"})
PUBLIC_PREFIXES = ("/static/",)  # the web page's files: no data, it asks for the key itself


def token_matches(header: str | None, api_key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(token.strip().encode(), api_key.encode())


class BearerAuthMiddleware:
    """Pure ASGI middleware (no buffering, streaming untouched). Health endpoints stay open."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_key or scope["path"] in PUBLIC_PATHS \
                or scope["path"].startswith(PUBLIC_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode("latin-1") or None
        if token_matches(header, self.api_key):
            await self.app(scope, receive, send)
            return
        body = json.dumps({
            "detail": "missing or invalid bearer token",
            "error": {"message": "missing or invalid bearer token", "type": "authentication_error",
                      "code": "invalid_api_key"},
        }).encode()
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                        (b"content-length", str(len(body)).encode())],
        })
        await send({"type": "http.response.body", "body": body})
