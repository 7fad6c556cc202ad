"""Configuration shared by the service and the batch CLI: `BLENDSERVE_*` variables and `.env`.

Settings come in groups (`blendserve_config.groups`): `settings.engine.max_batch` is read from
`BLENDSERVE_ENGINE_MAX_BATCH`, the root's `data_dir` from `BLENDSERVE_DATA_DIR`. The flat names of
the previous release still work for one release with a deprecation warning; an unknown
`BLENDSERVE_*` name fails at start-up with the closest valid one (`blendserve_config.env`). Bad
values fail fast with pydantic's message naming the field. The groups only the HTTP service reads
(service, limits, auth) are added by `app.settings.ServiceSettings`. docs/settings.md lists every
variable (`python -m blendserve_config.docs` writes it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from blendserve_config.env import EnvSource, env_files_of, flat_to_nested
from blendserve_config.groups import (
    SAMPLE_CORPUS,
    EngineSettings,
    IngestSettings,
    ModelSettings,
    RetrievalSettings,
    StoreSettings,
    empty_is_none,
)

__all__ = ["SAMPLE_CORPUS", "Settings", "empty_is_none"]


class Settings(BaseSettings):
    """The settings the service and the CLI share, by group."""

    model_config = SettingsConfigDict(env_file=".env", extra="forbid", validate_assignment=True)
    GROUPS: ClassVar[tuple[str, ...]] = ("model", "engine", "store", "retrieval", "ingest")

    data_dir: Path = Field(Path("data"), description="the passage database, the FAISS index and the disk KV tier")
    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    ingest: IngestSettings = Field(default_factory=IngestSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments, then the environment over `.env`, both through the one name table."""
        return init_settings, EnvSource(settings_cls, env_files_of(dotenv_settings))

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, data: Any) -> Any:
        return flat_to_nested(data, cls.GROUPS) if isinstance(data, dict) else data

    @property
    def kv_dir(self) -> Path:
        return self.data_dir / "kv"
