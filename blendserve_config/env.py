"""`BLENDSERVE_*` names: the valid ones, the deprecated aliases, and the source that reads them.

A setting's variable is `BLENDSERVE_<GROUP>_<FIELD>` (`BLENDSERVE_ENGINE_MAX_BATCH`); the root's own
fields drop the group (`BLENDSERVE_DATA_DIR`). The flat names of the release before the groups
(`BLENDSERVE_MAX_BATCH`) still work for one release: each use logs a warning and emits a
`DeprecationWarning` naming the new variable. An unknown `BLENDSERVE_*` name, in the environment or
the `.env` file, fails at start-up with the closest valid name.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from blendserve_config.groups import ALL_GROUPS

logger = logging.getLogger(__name__)

PREFIX = "BLENDSERVE_"
ROOT_FIELDS = ("data_dir",)  # fields of the root, read without a group: BLENDSERVE_DATA_DIR

# Variables other tools read (not settings): the benchmarks' data folder,
# docker compose's image tag and published port, the balancer's, `make run-vllm`'s (`app.vllm_launcher`),
# and the test suite's demand for a vLLM install (`tests/decoder_vllm`).
OTHER_TOOLS = frozenset(f"{PREFIX}{n}" for n in ("SHARED_DATA", "TAG", "PUBLISH_PORT", "LB_BIND", "API_1", "API_2",
                                                  "VLLM_PORT", "VLLM_VENV", "VLLM_CORES", "VLLM_KV_GB",
                                                  "REQUIRE_VLLM", "VLLM_MODEL_DIR", "HANDOVER_SIZE"))


# Settings that are gone, with what replaced them: named at start-up rather than ignored.
RETIRED = {
    f"{PREFIX}ENGINE_PREFIX_CACHE_MB": "prefix_cache mode now takes its prefixes from the KV pool's automatic "
                                        f"prefix caching, sized by {PREFIX}ENGINE_BATCH_KV_MB; remove the setting",
}
RETIRED[f"{PREFIX}PREFIX_CACHE_MB"] = RETIRED[f"{PREFIX}ENGINE_PREFIX_CACHE_MB"]


class SettingsNameError(ValueError):
    """An unknown `BLENDSERVE_*` name (the message names the closest valid one)."""


def _gb_to_mb(value: str) -> str:
    try:
        return str(round(float(value) * 1024))
    except ValueError:
        raise SettingsNameError(f"{PREFIX}MEMORY_CACHE_GB={value!r} is not a number") from None


@dataclass(frozen=True)
class Alias:
    """A deprecated flat name: the group and field it sets, and how its value converts (None = as is)."""

    old: str  # the flat field name of the release before the groups, e.g. "max_batch"
    group: str
    field: str
    convert: Callable[[str], str] | None = None

    @property
    def env(self) -> str:
        return f"{PREFIX}{self.old.upper()}"

    @property
    def new_env(self) -> str:
        return env_name(self.group, self.field)


# Flat names that are not simply the field's name (the rest: old name = field name).
_RENAMED = {("model", "name"): "model", ("retrieval", "method"): "retrieval",
            ("ingest", "batch_size"): "ingest_batch_size", ("ingest", "sample_on_start"): "ingest_sample_on_start",
            ("model", "cache_dir"): "model_cache_dir"}
# Twins folded into one field: listed after the field's own alias, so they win as they did before.
_TWINS = (Alias("memory_cache_gb", "store", "memory_cache_mb", _gb_to_mb),)


def env_name(group: str | None, field: str) -> str:
    return f"{PREFIX}{field.upper()}" if group is None else f"{PREFIX}{group.upper()}_{field.upper()}"


def fields_by_env() -> dict[str, tuple[str | None, str]]:
    """Every valid variable -> (group or None for the root, field)."""
    names: dict[str, tuple[str | None, str]] = {env_name(None, f): (None, f) for f in ROOT_FIELDS}
    for group, model in ALL_GROUPS.items():
        names |= {env_name(group, f): (group, f) for f in model.model_fields}
    return names


def aliases() -> list[Alias]:
    """The deprecated flat names, one per field whose variable changed, then the folded twins."""
    out = []
    for group, model in ALL_GROUPS.items():
        for f in model.model_fields:
            a = Alias(_RENAMED.get((group, f), f), group, f)
            if a.env != a.new_env:
                out.append(a)
    return out + list(_TWINS)


def closest(name: str, valid: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return found[0] if found else None


def _suggest(name: str, valid: Iterable[str], by_old: Mapping[str, Alias]) -> str:
    """The closest valid name; a deprecated one is answered with its new name."""
    near = closest(name, [*valid, *by_old])
    if near is None:
        return "nothing close"
    return by_old[near].new_env if near in by_old else near


def _warn(a: Alias) -> None:
    msg = (f"{a.env} is deprecated and will be removed in the next release: use {a.new_env}"
           + (" (in MiB)" if a.convert else ""))
    logger.warning(msg)
    warnings.warn(msg, DeprecationWarning, stacklevel=4)


def _json_fields() -> set[tuple[str, str]]:
    """(group, field) whose variable holds JSON (dicts and lists)."""
    out = set()
    for group, model in ALL_GROUPS.items():
        for f, info in model.model_fields.items():
            if typing.get_origin(info.annotation) in (dict, list):
                out.add((group, f))
    return out


def read_names(values: Mapping[str, str]) -> dict[str, Any]:
    """`BLENDSERVE_*` variables -> the nested settings dict; deprecated names warn, unknown ones raise."""
    valid, by_old = fields_by_env(), {a.env: a for a in aliases()}
    ours = {k.upper(): v for k, v in values.items() if k.upper().startswith(PREFIX) and v is not None}
    retired = sorted(set(ours) & set(RETIRED))
    if retired:
        raise SettingsNameError("; ".join(f"{n} is no longer a setting: {RETIRED[n]}" for n in retired))
    unknown = sorted(set(ours) - set(valid) - set(by_old) - OTHER_TOOLS)
    if unknown:
        hints = [f"{n} (did you mean {_suggest(n, valid, by_old)}?)" for n in unknown]
        raise SettingsNameError(f"unknown setting {', '.join(hints)}; the valid names are in docs/settings.md")
    out: dict[str, Any] = {}
    json_fields = _json_fields()

    def put(group: str | None, field: str, value: str) -> None:
        _put(out, group, field, _decode(value) if (group, field) in json_fields else value)

    for a in by_old.values():  # old names first: a new name set too wins
        if a.env in ours:
            _warn(a)
            value = ours[a.env]
            if a.convert is None:
                put(a.group, a.field, value)
            elif value.strip():  # a blank twin (`BLENDSERVE_MEMORY_CACHE_GB=`) was unset, as before
                put(a.group, a.field, a.convert(value))
    for name, value in ours.items():
        if name in valid:
            put(*valid[name], value)
    return out


def _decode(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # pydantic names the field and the bad value


def _put(out: dict[str, Any], group: str | None, field: str, value: Any) -> None:
    if group is None:
        out[field] = value
    else:
        out.setdefault(group, {})[field] = value


def flat_aliases() -> dict[str, Alias]:
    """Every field's flat name of the release before the groups (`max_batch`, `model`), and the twins."""
    out = {}
    for group, model in ALL_GROUPS.items():
        for f in model.model_fields:
            a = Alias(_RENAMED.get((group, f), f), group, f)
            out[a.old] = a
    return out | {a.old: a for a in _TWINS}


def flat_to_nested(data: dict[str, Any], groups: Iterable[str]) -> dict[str, Any]:
    """Keyword arguments by their flat names (`Settings(max_batch=2)`) placed in their groups; a group's
    name with a dict or a group model is the group itself (`model={...}`), with a string the old flat
    setting (`model="smollm2-135m-instruct"` = `model.name`)."""
    groups, flat = set(groups), flat_aliases()
    out: dict[str, Any] = {}
    moved: list[tuple[Alias, Any]] = []
    for key, value in data.items():
        a = flat.get(key)
        is_group = key in groups and (isinstance(value, dict) or hasattr(value, "model_dump"))
        if a is None or is_group or a.group not in groups:
            out[key] = value
        else:
            moved.append((a, value))
    for a, value in sorted(moved, key=lambda m: m[0] in _TWINS):  # a twin wins, as before
        sub = out.get(a.group, {})
        sub = sub.model_dump(exclude_unset=True) if hasattr(sub, "model_dump") else dict(sub)
        sub[a.field] = a.convert(str(value)) if a.convert and value is not None else value
        out[a.group] = sub
    return out


class EnvSource(PydanticBaseSettingsSource):
    """The process environment over the `.env` file(s), through `read_names`."""

    def __init__(self, settings_cls: type[BaseSettings], env_files: Iterable[Path | str]) -> None:
        super().__init__(settings_cls)
        self.env_files = [Path(p) for p in env_files]

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything is read at once in __call__

    def __call__(self) -> dict[str, Any]:
        values: dict[str, str] = {}
        for path in self.env_files:
            if path.expanduser().is_file():
                values |= {k: v for k, v in dotenv_values(path.expanduser()).items() if v is not None}
        values |= dict(os.environ)
        mine = getattr(self.settings_cls, "GROUPS", ())
        return {k: v for k, v in read_names(values).items() if k not in ALL_GROUPS or k in mine}  # the CLI: no auth


def env_files_of(dotenv: PydanticBaseSettingsSource) -> list[Path | str]:
    """The `.env` files a `DotEnvSettingsSource` was given (`_env_file=None` = none)."""
    files = getattr(dotenv, "env_file", None)
    if files is None:
        return []
    return [files] if isinstance(files, str | Path) else list(files)
