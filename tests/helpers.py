"""Helpers shared by the tests: the tiny random model, random KV chunks, the shared QA data."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.settings import ServiceSettings
from benchmarks.common.data import DATA_ENV, default_data_dir
from blend_engine.kv_store import ChunkKV
from blend_engine.model.runner import ModelRunner
from tests.local_services import wait_for

ROOT = Path(__file__).resolve().parent.parent  # the repository

# Four short passages and a question about one of them, for the engine tests.
PASSAGES = (
    "Paris is the capital of France. The Louvre is a museum in Paris.",
    "Berlin is the capital of Germany. The Spree flows through Berlin.",
    "The Rhine flows through Basel, Strasbourg and Cologne before reaching the North Sea.",
    "Mount Blanc is the highest mountain in the Alps, on the border of France and Italy.",
)
QUESTION = "Which river flows through Berlin?"

# A 4-layer random Llama the size of a unit test: fast, deterministic (seed 0), not meaningful.
TINY_CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)


def real_tokenizer():
    """The default model's tokenizer, from the unpacked GGUF cache when there (no model load)."""
    from transformers import AutoTokenizer

    from blend_engine.model.files import _gguf_cache_dir, default_gguf_path

    cached = _gguf_cache_dir(default_gguf_path())
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    return ModelRunner.load().tokenizer


def tiny_model(kind: str = "llama", **overrides):
    """A freshly seeded random Llama (or Qwen2 with kind="qwen2") of TINY_CONFIG, with `overrides`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = {**TINY_CONFIG, **overrides}
    return LlamaForCausalLM(LlamaConfig(**config)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**config))


def tiny_runner(tokenizer=None, kind: str = "llama", name: str = "tiny", **overrides) -> ModelRunner:
    """`tiny_model` behind a ModelRunner with the real tokenizer (loaded when not given)."""
    return ModelRunner(tiny_model(kind, **overrides), tokenizer or real_tokenizer(), name)


def make_kv(seed: int, L: int = 4, H: int = 2, T: int = 9, D: int = 8, dtype=torch.float16) -> ChunkKV:
    """A random chunk: K then V drawn from one generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, T, D, generator=g).to(dtype)  # [L, H, T, D]
    v = torch.randn(L, H, T, D, generator=g).to(dtype)  # [L, H, T, D]
    return ChunkKV(k, v)


def shared_data_file(name: str) -> Path:
    return default_data_dir() / name


def requires_shared_data(*names: str) -> pytest.MarkDecorator:
    """Skip, with a message naming the path and the variable, when a shared data file is absent."""
    missing = [shared_data_file(n) for n in names if not shared_data_file(n).exists()]
    return pytest.mark.skipif(bool(missing), reason=f"shared QA data not found: {', '.join(map(str, missing))} "
                                                    f"(set {DATA_ENV} to the folder holding it)")


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Random biases and norm weights (initialised to 0 and 1), so that they matter in the checks."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()


# ============================================================================ the service in-process
# The one seam that makes the service's blend ratio deterministic in tests: the bandwidth controller
# learns from timings and may rightly serve a tiny prompt by full prefill (which reads no cache), so
# the services the tests start use this fixed ratio (the controller has its own tests).
FIXED_RATIO = 0.15
FIXED_RATIO_ENV = {"BLENDSERVE_ENGINE_RECOMPUTE_RATIO": str(FIXED_RATIO)}  # the same, for services in a subprocess


def make_settings(data_dir, **overrides) -> ServiceSettings:
    """Service settings for an in-process test service; `overrides` by group (`engine={...}`) or flat name."""
    values = {"data_dir": data_dir, "ingest": {"sample_on_start": False},
              "store": {"memory_cache_mb": 256, "disk_cache_mb": 512, "redis_url": None},
              "auth": {"api_key": None}, "service": {"workers": 1, "max_queue": 16, "request_timeout_s": 60},
              "engine": {"recompute_ratio": FIXED_RATIO}}
    values.update(overrides)
    return ServiceSettings(_env_file=None, **values)


def wait_ready(client: TestClient, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get("/readyz")
        if r.status_code == 200:
            return r.json()
        time.sleep(0.05)
    raise AssertionError(f"not ready after {timeout}s: {r.json()}")


def svc(client):
    """The service state behind a TestClient or a `local_services.ThreadedServer` (both have `.app`)."""
    return client.app.state.svc


def stored_after_answers(client) -> None:
    """Wait until the engine stored every missed passage it queued after its answers (background
    work: an exact repeat before then is a prefix hit of the pool, not a hit of the store)."""
    loop = svc(client).stack.engine.loop
    poll(lambda: loop.stats()["store_queued"] == 0)


@contextmanager
def serving(settings: ServiceSettings, stack_factory=None, documents: list[dict] | None = None
            ) -> Iterator[TestClient]:
    """The app in this process (TestClient), ready, with `documents` ingested (201 asserted)."""
    from app.main import create_app

    with TestClient(create_app(settings, stack_factory)) as client:
        wait_ready(client)
        if documents:
            r = client.post("/v1/documents", json={"documents": documents})
            assert r.status_code == 201, r.text
        yield client


def poll(fn, timeout: float = 60.0, step: float = 0.05):
    """fn()'s first truthy value, polled until the deadline (AssertionError after it)."""
    value = wait_for(fn, timeout, step)
    if not value:
        raise AssertionError(f"condition not met within {timeout} s")
    return value


@contextmanager
def held_loop(loop) -> Iterator[None]:
    """An engine loop (its thread running) kept busy in a task until the block ends: what is
    submitted meanwhile stays queued at admission."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    holder = threading.Thread(target=loop.run_task, args=(hold,), daemon=True)
    holder.start()
    assert entered.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)


def run_threads(fn, n: int, timeout_s: float = 300) -> None:
    """fn(0) .. fn(n - 1), each on a thread of its own, all started, then all joined."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)


def held_ingest_factory(factory, release: threading.Event, stacks: list | None = None):
    """A stack factory whose pipeline's `ingest` waits for `release` (30 s at most) before it runs;
    the stacks it makes are appended to `stacks` when given."""
    def make(settings):
        stack = factory(settings)
        if stacks is not None:
            stacks.append(stack)
        ingest = stack.pipeline.ingest

        def held(*args, **kwargs):
            assert release.wait(30)
            return ingest(*args, **kwargs)

        stack.pipeline.ingest = held
        return stack

    return make


def ragged_pool(runner):
    """Three runs of one pool with ragged random K/V (two beyond the window of 24), the rest zero."""
    from blend_engine.executor.kv_pool import KVPool
    from blend_engine.scheduler.kv_blocks import Run

    pool = KVPool(runner, n_blocks=16, block_tokens=16)
    runs, lengths = [Run(0, 3), Run(3, 1), Run(6, 5)], [37, 5, 70]
    g = torch.Generator().manual_seed(1)
    for k, v in zip(*pool.kv):
        k.zero_()
        v.zero_()
    caches = [pool.view(run, n) for run, n in zip(runs, lengths)]
    for layer in range(runner.shape.n_layers):
        for c, n in zip(caches, lengths):
            c.k[layer][:, :n] = torch.randn(c.k[layer][:, :n].shape, generator=g)  # [H, n, D]
            c.v[layer][:, :n] = torch.randn(c.v[layer][:, :n].shape, generator=g)  # [H, n, D]
    return pool, runs, lengths


def pool_kv(pool, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of every layer's K and V over the pool's first `slots` slots."""
    return [(k[:, :slots].clone(), v[:, :slots].clone()) for k, v in zip(*pool.kv)]  # L x ([H, slots, D] x 2)


def dense_decode_reference(q, k, v, start, n, pos, window, scale):
    """Pooled decode attention row by row (the kernels' oracle): dense SDPA of q [B, H, G, D] over each
    row's pool slots start[b] .. start[b] + n[b] - 1 of k, v [H, slots, D], causal / windowed by position."""
    outs = []
    for b in range(q.shape[0]):
        s, m = int(start[b]), int(n[b])
        j = torch.arange(m)
        allowed = (j <= int(pos[b])) if window is None else (j <= int(pos[b])) & (j > int(pos[b]) - window)  # [m]
        kb, vb = k[:, s:s + m], v[:, s:s + m]  # [H, m, D]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[b], kb, vb, attn_mask=allowed[None, None, :].expand(q.shape[1], q.shape[2], m), scale=scale))  # [H, G, D]
    return torch.stack(outs)  # [B, H, G, D]
