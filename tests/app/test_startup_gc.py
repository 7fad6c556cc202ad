"""Start-up's objects are frozen out of the garbage collector before the first request (`app.startup`)."""

from __future__ import annotations

import gc

from fastapi.testclient import TestClient

from app.main import create_app
from app.startup import freeze_startup_objects
from tests.helpers import make_settings, wait_ready


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector could ever free it


def test_objects_alive_at_start_up_are_frozen_and_the_collector_stays_on():
    node = Node()
    gc.unfreeze()
    try:
        frozen = freeze_startup_objects()
        assert frozen > 0 and gc.get_freeze_count() > 0 and gc.isenabled()  # (refcounting still frees frozen objects)
        assert gc.is_tracked(node) and all(node not in gc.get_objects(g) for g in range(3))  # out of every generation
        later = Node()
        assert any(later in gc.get_objects(g) for g in range(3))  # what comes after is collected as usual
    finally:
        gc.unfreeze()


def test_the_service_freezes_before_it_is_ready(tmp_path, tiny_stack_factory, caplog):
    gc.unfreeze()
    caplog.set_level("INFO", logger="app.startup")
    try:
        with TestClient(create_app(make_settings(tmp_path / "data"), tiny_stack_factory)) as c:
            wait_ready(c)
            assert gc.get_freeze_count() > 0
        lines = caplog.text.splitlines()
        frozen = next(i for i, ln in enumerate(lines) if "start-up objects frozen" in ln)
        ready = next(i for i, ln in enumerate(lines) if "ready in" in ln)
        assert frozen < ready
    finally:
        gc.unfreeze()
