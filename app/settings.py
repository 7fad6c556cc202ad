"""The service's settings: the shared `Settings` plus what only the HTTP service reads.

`ServiceSettings` reads the same `BLENDSERVE_*` variables and `.env` file as the shared
`blendserve_config.settings.Settings` (the CLI's), and adds the listener, the API key, the worker
queue, the timeout and the request limits. Cheap to import (no torch). Pass a `ServiceSettings` to
`app.main.create_app`: a plain `Settings` lacks these fields, and pydantic-settings would drop them
silently (extra="ignore"), so `create_app` refuses one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from blendserve_config.settings import Settings, empty_is_none


class ServiceSettings(Settings):
    """Everything in `Settings`, plus the fields only the service reads (same variable names)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: str | None = None
    tenant_keys: dict[str, str] = Field({}, description="JSON {tenant: key}: each tenant's bearer key; its requests "
                                                        "get a KV cache namespace of their own")
    max_queue: int = Field(16, ge=1, description="requests waiting for the engine before 503")
    workers: int | None = Field(None, ge=1, le=256, description="request threads (retrieval, tokenizing, waiting "
                                                                "on the engine loop); unset = max_batch")
    request_timeout_s: float = Field(120.0, gt=0)
    max_body_bytes: int = Field(4 << 20, ge=1024, description="request bodies above this get 413")
    max_question_chars: int = Field(4000, ge=1)
    max_documents: int = Field(32, ge=1, description="documents per request (inline or ingested)")
    max_document_chars: int = Field(100_000, ge=1)
    max_title_chars: int = Field(300, ge=1, description="document titles above this get 422 (a title is repeated "
                                                        "in every passage of its document)")
    max_upload_mb: int = Field(50, ge=1, le=4096, description="largest file POST /v1/documents/upload takes (413)")
    max_upload_files: int = Field(20, ge=1, le=1000, description="files per upload request")
    max_new_tokens: int = Field(1024, ge=1, description="upper bound for a request's max_tokens")
    # issue #38: how much of each cited passage an answer's `sources` carry
    source_text_chars: int | None = Field(None, ge=1, description="an answer's sources carry each passage's text "
                                                                  "cut to this many characters; unset = whole")
    max_top_k: int = Field(50, ge=1)
    explain_max_tokens: int = Field(4096, ge=1, description="tokens explained per request (explain=true); "
                                                            "the rest are counted but not listed")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @property
    def max_upload_body_bytes(self) -> int:
        """The upload route's body limit: every file at its limit, plus room for the multipart framing."""
        return self.max_upload_files * (self.max_upload_mb << 20) + (1 << 20)

    @property
    def request_threads(self) -> int:
        """Requests in flight at once: enough to keep the engine loop's batch full by default."""
        return self.workers if self.workers is not None else self.max_batch

    _empty_key_is_none = field_validator("api_key", "workers", mode="before")(empty_is_none)

    @field_validator("api_key")
    @classmethod
    def _ascii_key(cls, v: str | None) -> str | None:
        """HTTP headers arrive as latin-1 bytes: a key outside printable ASCII could never match."""
        if v is not None and not _printable_ascii(v):
            raise ValueError("must be printable ASCII without spaces (an HTTP Authorization header cannot carry "
                             "other characters reliably, so such a key could never match)")
        return v

    @field_validator("tenant_keys")
    @classmethod
    def _tenant_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for tenant, key in v.items():
            if not tenant.strip() or not _printable_ascii(key):
                raise ValueError(f"tenant {tenant!r}: names must not be blank and keys must be printable ASCII "
                                 f"without spaces")
        if len(set(v.values())) != len(v):
            raise ValueError("two tenants share a key: each tenant needs its own")
        return v

    @model_validator(mode="after")
    def _api_key_is_no_tenant_key(self) -> ServiceSettings:
        if self.api_key is not None and self.api_key in self.tenant_keys.values():
            raise ValueError("BLENDSERVE_API_KEY is also a tenant's key: the shared key must differ from every "
                             "BLENDSERVE_TENANT_KEYS key")
        return self


def _printable_ascii(key: str) -> bool:
    return bool(key) and all(0x21 <= ord(ch) <= 0x7E for ch in key)
