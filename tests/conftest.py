"""Shared fixtures: the real default model (loaded once) and a tiny random Llama with its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The start-up fidelity gate measures the model at every service start; tests of other features run
# with it off (their tiny random models are not meant to blend well). tests/blend_engine/test_selfcheck.py turns it on.
os.environ.setdefault("BLENDSERVE_ENGINE_FIDELITY_GATE", "off")
# Services started beside vLLM (`app.vllm_launcher.beside_vllm`) write their whole KV pool at start-up (30% of
# the memory available, up to 6 GB for the default model: ~1 s here, tens of seconds in a VM that backs its
# memory lazily); tests keep it off, and tests/app/test_startup_prefault.py tests it.
os.environ.setdefault("BLENDSERVE_ENGINE_KV_POOL_PREFAULT", "false")
# Without CUDA, Triton kernels (the pooled decode kernel) run under Triton's interpreter; it is read
# when a kernel is defined, so before anything imports blend_engine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread: tests start servers and subprocesses beside the test process, and on a
    2-core machine OpenMP spin-waits between them make small ops orders of magnitude slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def close_engines_made_here(monkeypatch):
    """Close every engine a test (or its function-scoped fixtures) made and left open: each engine's
    loop thread would otherwise go on storing passages on the shared cores through later tests."""
    import weakref

    from blend_engine.engine import BlendEngine

    made: list[weakref.ref] = []
    init = BlendEngine.__init__

    def tracking(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(BlendEngine, "__init__", tracking)
    yield
    for ref in made:
        engine = ref()
        if engine is not None:
            engine.close()


@pytest.fixture(scope="session")
def real_runner():
    """SmolLM2-135M-Instruct (the default model), loaded once per test session."""
    from blend_engine.model.runner import ModelRunner

    return ModelRunner.load()


@pytest.fixture(scope="session")
def tiny_runner(real_runner):
    """A 4-layer random Llama sharing the real tokenizer: fast, deterministic, not meaningful."""
    from tests.helpers import tiny_runner

    return tiny_runner(real_runner.tokenizer)


@pytest.fixture(scope="session")
def free_port():
    """A function returning a currently free TCP port on 127.0.0.1."""
    from benchmarks.common.service import free_port

    return free_port


@pytest.fixture(scope="session")
def embedder():
    """The bundled sentence embedder (all-MiniLM-L6-v2), loaded once per session."""
    from retrieval.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def tiny_stack_factory(tiny_runner, embedder):
    """`build_stack` with the tiny model and the shared embedder (a `stack_factory` for create_app)."""
    from blendserve_config.stack import build_stack

    def factory(settings):
        return build_stack(settings, runner=tiny_runner, embedder=embedder)

    return factory


@pytest.fixture(scope="session")
def pg_cluster():
    """A throwaway PostgreSQL cluster for the session (skips with a message when the binaries are missing)."""
    from tests.local_services import start_cluster

    cluster = start_cluster()
    yield cluster
    cluster.destroy()


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request, tmp_path):
    """A function opening a handle on one fresh passage store (each call: another replica's handle),
    on SQLite and on PostgreSQL (a new database per test). Handles are closed after the test."""
    import uuid

    from retrieval.passages import PassageDB

    handles = []
    if request.param == "sqlite":
        def opener():
            return PassageDB(tmp_path / "passages.sqlite3")
    else:
        from retrieval.passages_pg import PgPassageStore

        url = request.getfixturevalue("pg_cluster").create_database(f"t{uuid.uuid4().hex[:12]}")

        def opener():
            return PgPassageStore(url)

    def open_one():
        handles.append(opener())
        return handles[-1]

    open_one.backend = request.param
    open_one.url = None if request.param == "sqlite" else url
    yield open_one
    for h in handles:
        h.close()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer, saved so that subprocesses load the same weights."""
    from tests.helpers import real_tokenizer, tiny_model

    model, tok = tiny_model(), real_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
