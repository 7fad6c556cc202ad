"""Settings in groups: the variable names, the deprecated flat names, unknown names, docs/settings.md."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from app.settings import ServiceSettings
from blendserve_config import docs
from blendserve_config.env import OTHER_TOOLS, SettingsNameError, aliases, fields_by_env
from blendserve_config.groups import ALL_GROUPS
from blendserve_config.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_blendserve_env(monkeypatch):
    """Each test starts from an environment without BLENDSERVE_* names (the suite's conftest sets one)."""
    import os

    for name in [n for n in os.environ if n.startswith("BLENDSERVE_")]:
        monkeypatch.delenv(name)


def test_every_field_has_one_variable_and_no_alias_shadows_one():
    valid = fields_by_env()
    assert len(valid) == 1 + sum(len(m.model_fields) for m in ALL_GROUPS.values())
    old = [a.env for a in aliases()]
    assert len(old) == len(set(old)) and not set(old) & set(valid) and not OTHER_TOOLS & set(valid)
    assert all((a.group, a.field) in {v for v in valid.values()} for a in aliases())
    assert valid["BLENDSERVE_ENGINE_MAX_BATCH"] == ("engine", "max_batch")


def test_new_names_are_read_into_their_groups(monkeypatch):
    monkeypatch.setenv("BLENDSERVE_ENGINE_MAX_BATCH", "3")
    monkeypatch.setenv("BLENDSERVE_AUTH_TENANT_KEYS", '{"acme": "k-acme"}')
    monkeypatch.setenv("BLENDSERVE_MODEL_NAME", "tiny")
    s = ServiceSettings(_env_file=None)
    assert (s.engine.max_batch, s.auth.tenant_keys, s.model.name) == (3, {"acme": "k-acme"}, "tiny")


def test_old_names_still_work_with_a_warning_naming_the_new_one(monkeypatch, caplog):
    monkeypatch.setenv("BLENDSERVE_MAX_BATCH", "3")
    monkeypatch.setenv("BLENDSERVE_TENANT_KEYS", '{"acme": "k-acme"}')
    monkeypatch.setenv("BLENDSERVE_RETRIEVAL", "dense")
    with caplog.at_level(logging.WARNING, logger="blendserve_config.env"), \
            pytest.warns(DeprecationWarning, match="use BLENDSERVE_ENGINE_MAX_BATCH"):
        s = ServiceSettings(_env_file=None)
    assert (s.engine.max_batch, s.auth.tenant_keys, s.retrieval.method) == (3, {"acme": "k-acme"}, "dense")
    logged = caplog.text
    assert "BLENDSERVE_TENANT_KEYS is deprecated" in logged and "use BLENDSERVE_AUTH_TENANT_KEYS" in logged
    assert "use BLENDSERVE_RETRIEVAL_METHOD" in logged


def test_a_blank_gb_twin_is_unset_as_before(monkeypatch):
    monkeypatch.setenv("BLENDSERVE_MEMORY_CACHE_MB", "64")
    monkeypatch.setenv("BLENDSERVE_MEMORY_CACHE_GB", " ")
    with pytest.warns(DeprecationWarning):
        assert Settings(_env_file=None).store.memory_cache_mb == 64


def test_a_new_name_wins_over_its_old_one(monkeypatch):
    monkeypatch.setenv("BLENDSERVE_MAX_BATCH", "3")
    monkeypatch.setenv("BLENDSERVE_ENGINE_MAX_BATCH", "5")
    with pytest.warns(DeprecationWarning):
        assert Settings(_env_file=None).engine.max_batch == 5


def test_keyword_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("BLENDSERVE_ENGINE_MAX_BATCH", "5")
    monkeypatch.setenv("BLENDSERVE_ENGINE_BATCH_KV_MB", "64")
    s = Settings(_env_file=None, engine={"max_batch": 2})
    assert (s.engine.max_batch, s.engine.batch_kv_mb) == (2, 64)  # merged with the group's variables
    assert Settings(_env_file=None, max_batch=4, model="tiny").engine.max_batch == 4  # flat names too


@pytest.mark.parametrize(("name", "closest"), [("BLENDSERVE_MAX_BATCHES", "BLENDSERVE_ENGINE_MAX_BATCH"),
                                               ("BLENDSERVE_ENGIN_MAX_BATCH", "BLENDSERVE_ENGINE_MAX_BATCH"),
                                               ("BLENDSERVE_STORE_REDIS_URI", "BLENDSERVE_STORE_REDIS_URL")])
def test_an_unknown_name_fails_fast_with_the_closest_valid_name(monkeypatch, name, closest):
    monkeypatch.setenv(name, "1")
    with pytest.raises(SettingsNameError, match=f"{name} \\(did you mean {closest}\\?\\)"):
        Settings(_env_file=None)


@pytest.mark.parametrize("name", ["BLENDSERVE_ENGINE_PREFIX_CACHE_MB", "BLENDSERVE_PREFIX_CACHE_MB"])
def test_a_retired_setting_fails_fast_naming_what_replaced_it(monkeypatch, name):
    """prefix_cache mode's own budget is gone (the KV pool serves that mode): a deployment that still sets
    it is told so at start-up, never silently ignored."""
    monkeypatch.setenv(name, "512")
    with pytest.raises(SettingsNameError, match=f"{name} is no longer a setting: .*BLENDSERVE_ENGINE_BATCH_KV_MB"):
        Settings(_env_file=None)


def test_an_unknown_name_in_the_env_file_fails_too(tmp_path):
    env = tmp_path / ".env"
    env.write_text("BLENDSERVE_SERVICE_PORTS=8000\nOTHER_TOOL=1\n")
    with pytest.raises(SettingsNameError, match="did you mean BLENDSERVE_SERVICE_PORT"):
        ServiceSettings(_env_file=env)


def test_the_cli_accepts_the_service_names_and_other_tools_variables(monkeypatch):
    monkeypatch.setenv("BLENDSERVE_SERVICE_PORT", "9000")
    monkeypatch.setenv("BLENDSERVE_SHARED_DATA", "/data")
    monkeypatch.setenv("BLENDSERVE_TAG", "v1")
    assert not hasattr(Settings(_env_file=None), "service")


def test_the_service_exits_naming_an_unknown_variable(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "BLENDSERVE_ENGINE_MAX_BACH": "2"}
    r = subprocess.run([sys.executable, "-m", "app"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "did you mean BLENDSERVE_ENGINE_MAX_BATCH?" in r.stderr


def test_settings_doc_is_generated_from_the_models():
    """docs/settings.md is stale: run `python -m blendserve_config.docs`."""
    assert docs.DOC.read_text() == docs.render()
    assert docs.main(["--check"]) == 0


def _environ_reads(path: Path) -> list[int]:
    """Lines of `path` that read the process environment (os.environ.get / [..] / in, os.getenv)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr == "getenv":
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and \
                ast.unparse(node.func.value) == "os.environ":
            lines.append(node.lineno)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" and \
                isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        if isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
            lines.append(node.lineno)
    return lines


def test_only_the_config_package_reads_the_environment():
    packages = ("app", "blend_engine", "retrieval", "corpus_tools", "corpus_cli", "logsafe")
    found = {str(p.relative_to(ROOT)): _environ_reads(p) for pkg in packages for p in (ROOT / pkg).rglob("*.py")}
    assert {p: lines for p, lines in found.items() if lines} == {}
