"""When a request reached the HTTP server: the start of every time the service reports.

`ArrivalMiddleware`, the outermost middleware, stamps each HTTP request's scope with `clock()` before
anything else runs (body-size limit, auth, body parsing, validation); a query's `timings` count from
there (`service.QueryRun`), so `ttft_ms` and `total_ms` are what a client on the same host would see
less the network:

    arrival | retrieval_ms | plan_ms | queue_ms | prefill_ms | decode_ms |
            |<------------------- ttft_ms ------------------>|
            |<------------------------------ total_ms ------------------->|

`retrieval_ms` runs from arrival (request parsing and admission included) until the passages are
known; `kv_load_ms` and `recompute_ms` are the prefill's own parts (a pipelined load overlaps the
recompute, so they may sum past `prefill_ms`).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from starlette.types import ASGIApp, Receive, Scope, Send

clock = time.perf_counter  # the one clock of the service's timings (the engine loop's too)


class ArrivalMiddleware:
    """Pure ASGI: stamps `scope["state"]["arrival"]`; streaming untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = clock()
        await self.app(scope, receive, send)


def arrival_of(request: Request) -> float:
    """The request's arrival (now, for an app built without the middleware)."""
    return getattr(request.state, "arrival", None) or clock()


Arrival = Annotated[float, Depends(arrival_of)]
