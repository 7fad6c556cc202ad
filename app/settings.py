"""The service's settings: the shared `Settings` plus the groups only the HTTP service reads.

`ServiceSettings` reads the same `BLENDSERVE_*` variables and `.env` file as the shared
`blendserve_config.settings.Settings` (the CLI's), and adds the `service` group (listener, worker
queue, timeout, log level), `limits` (what one request may ask for) and `auth` (bearer keys). The
group models live in `blendserve_config.groups`, beside the shared ones, so both classes know every
valid name. Cheap to import (no torch). Pass a `ServiceSettings` to `app.main.create_app`: a plain
`Settings` lacks these groups, so `create_app` refuses one.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from blendserve_config.groups import AuthSettings, DecoderSettings, LimitsSettings, ServiceGroup
from blendserve_config.settings import Settings


class ServiceSettings(Settings):
    """Everything in `Settings`, plus the service's groups."""

    GROUPS: ClassVar[tuple[str, ...]] = (*Settings.GROUPS, "service", "limits", "auth", "decoder")

    service: ServiceGroup = Field(default_factory=ServiceGroup)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    decoder: DecoderSettings = Field(default_factory=DecoderSettings)

    @property
    def request_threads(self) -> int:
        """Threads for blocking jobs (document ingestion, verify); queries need none of their own."""
        return self.service.workers if self.service.workers is not None else 2
