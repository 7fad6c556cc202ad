"""Optional bearer-token auth: with `BLENDSERVE_AUTH_API_KEY` or `BLENDSERVE_AUTH_TENANT_KEYS` set, everything
but health needs one of the keys. A tenant key also names the caller's KV cache namespace: the
middleware puts the tenant's name in the request's state (`tenant_of`), and every KV key of its
requests is salted with it (`cache_namespace`), so tenants never share (nor time) cached KV."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends
from starlette.requests import Request
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


class Keyring:
    """The accepted keys: the shared `api_key` (no namespace) and one key per tenant."""

    def __init__(self, api_key: str | None = None, tenant_keys: Mapping[str, str] | None = None) -> None:
        self.keys: list[tuple[str, str | None]] = [(api_key, None)] if api_key else []
        self.keys += [(key, tenant) for tenant, key in (tenant_keys or {}).items()]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def match(self, header: str | None) -> tuple[bool, str | None]:
        """(accepted, tenant): every key is compared (constant time per key), the first match wins."""
        found = [tenant for key, tenant in self.keys if token_matches(header, key)]
        return (True, found[0]) if found else (False, None)


def tenant_of(request: Request) -> str | None:
    """The tenant whose key authenticated this request (None: the shared key, or no auth)."""
    return getattr(request.state, "tenant", None)


Tenant = Annotated["str | None", Depends(tenant_of)]


def cache_namespace(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt entering every KV key of a request: its tenant's namespace and its own `cache_salt`.
    None when neither is set (single-tenant: the keys, and so the cache, are exactly as before)."""
    if tenant is None and cache_salt is None:
        return None
    return json.dumps({"tenant": tenant, "salt": cache_salt}, sort_keys=True)


class BearerAuthMiddleware:
    """Pure ASGI middleware (no buffering, streaming untouched). Health endpoints stay open."""

    def __init__(self, app: ASGIApp, keyring: Keyring) -> None:
        self.app = app
        self.keyring = keyring

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keyring.enabled or scope["path"] in PUBLIC_PATHS \
                or scope["path"].startswith(PUBLIC_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode("latin-1") or None
        ok, tenant = self.keyring.match(header)
        if ok:
            scope.setdefault("state", {})["tenant"] = tenant
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
