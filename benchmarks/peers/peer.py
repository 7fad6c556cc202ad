"""Optional peer: the same token ids through llama.cpp on the same GGUF, with llama.cpp's prompt caching.

Per context, three time-to-first-token cases (prompt evaluation plus the first token's logits):
cold (empty KV cache), the same prompt again (the KV of the longest common token prefix is kept, only
the rest is evaluated: what llama.cpp's prompt cache does) and the passages in another order after it
(only the common prefix, the system prompt, is reused).

Backends, the first one installed wins (neither is a project dependency; without both the run is skipped):

- ``llama-cpp-cffi`` (``make bench-peer-install``): a prebuilt CPU llama.cpp driven through its raw C API.
  Only its compiled CPU module is loaded, not its ``llama`` package, which imports transformers<5,
  huggingface-hub and friends and probes for GPUs; so it is installed with ``--no-deps``.
- ``llama-cpp-python``: its ``create_completion`` with a ``LlamaRAMCache`` (a from-source build).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from benchmarks.common.data import Context, shuffled
from blend_engine.model.files import default_gguf_path
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan

logger = logging.getLogger(__name__)

CASES = ("cold", "same_prompt_cached", "shuffled_after_cache")
CFFI_PACKAGE = "llama"  # top-level package of llama-cpp-cffi
CFFI_CPU_MODULE = "_llama_cpp_cpu"
INSTALL_HINT = ("make bench-peer-install (llama-cpp-cffi, prebuilt) or pip install llama-cpp-python "
                "(a from-source build)")


@dataclass(frozen=True)
class PeerRow:
    case: str  # cold | same_prompt_cached | shuffled_after_cache
    target_tokens: int
    context_tokens: int
    ttft_ms: float
    reused_tokens: int = 0  # prompt tokens whose KV was kept from the previous request
    first_token: int = -1  # greedy first token id (-1: the backend does not report it)


class PeerBackend(Protocol):
    name: str

    def reset(self) -> None:
        """Empty the KV cache."""

    def first_token(self, tokens: list[int]) -> tuple[int, int]:
        """Evaluate the prompt (reusing the cached common prefix) and pick the greedy first token.
        Returns (token id or -1, reused prompt tokens)."""

    def close(self) -> None:
        """Free the model and its context."""


# ----------------------------------------------------------------------------- discovery


def _cffi_cpu_extension() -> Path | None:
    """The compiled CPU module of llama-cpp-cffi, found without importing its package."""
    if importlib.util.find_spec("_cffi_backend") is None:
        return None
    spec = importlib.util.find_spec(CFFI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob(f"{CFFI_CPU_MODULE}.*.so"))
        if found:
            return found[0]
    return None


def backend_name() -> str | None:
    """'llama-cpp-cffi', 'llama-cpp-python' or None when no binding is installed."""
    if _cffi_cpu_extension() is not None:
        return "llama-cpp-cffi"
    if importlib.util.find_spec("llama_cpp") is not None:
        return "llama-cpp-python"
    return None


def available() -> tuple[bool, str]:
    if backend_name() is None:
        return False, f"no llama.cpp binding is installed ({INSTALL_HINT}); peer run skipped"
    return True, ""


# ----------------------------------------------------------------------------- llama-cpp-cffi


@functools.lru_cache(maxsize=1)
def _load_cffi_module(path: Path) -> ModuleType:
    """Load the module lazily bound: the wheel, built with GCC 14, references __cxa_call_terminate
    (called only when an exception escapes a noexcept function), which older libstdc++ (Debian 12's
    GCC 12) lacks; an eager load would refuse the whole library for it."""
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_LOCAL)
    try:
        spec = importlib.util.spec_from_file_location(CFFI_CPU_MODULE, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.setdlopenflags(flags)
    _route_native_logs(module)
    module.lib.llama_backend_init()
    return module


def _route_native_logs(module: ModuleType) -> None:
    """llama.cpp's log lines go to this module's logger at DEBUG instead of stderr."""
    ffi, lib = module.ffi, module.lib

    @ffi.def_extern(name="llama_cpp_cffi_ggml_log_callback")
    def _log(level: int, text: Any, user_data: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG) and text != ffi.NULL:
            logger.debug("llama.cpp: %s", ffi.string(text).decode("utf-8", "replace").rstrip())

    lib.llama_log_set(lib.llama_cpp_cffi_ggml_log_callback, ffi.NULL)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CffiLlama:
    """llama.cpp through llama-cpp-cffi's raw C API: one sequence, explicit prompt-prefix reuse."""

    name = "llama-cpp-cffi"

    def __init__(self, model_path: Path, n_ctx: int, n_threads: int, n_batch: int = 512) -> None:
        ext = _cffi_cpu_extension()
        if ext is None:
            raise RuntimeError(f"llama-cpp-cffi is not installed ({INSTALL_HINT})")
        module = _load_cffi_module(ext)
        self._ffi, self._lib = module.ffi, module.lib
        self._n_batch = n_batch
        self._model = self._lib.llama_model_load_from_file(str(model_path).encode(), self._lib.llama_model_default_params())
        if self._model == self._ffi.NULL:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self._ctx = self._lib.llama_init_from_model(self._model, self._context_params(n_ctx, n_threads, n_batch))
        if self._ctx == self._ffi.NULL:
            self._lib.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._vocab = self._lib.llama_model_get_vocab(self._model)
        self.n_vocab = int(self._lib.llama_vocab_n_tokens(self._vocab))
        self._cached: list[int] = []  # the tokens whose KV sequence 0 holds

    def _context_params(self, n_ctx: int, n_threads: int, n_batch: int) -> Any:
        params = self._lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        return params

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        buf = self._ffi.new("llama_token[]", cap)
        n = self._lib.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} slots, had {cap}")
        return list(buf[0:n])

    def reset(self) -> None:
        self._lib.llama_kv_self_clear(self._ctx)
        self._cached = []

    def first_token(self, tokens: list[int]) -> tuple[int, int]:
        if not tokens:
            raise ValueError("an empty prompt has no first token")
        keep = common_prefix(self._cached, tokens[:-1])  # the last token is always evaluated: it gives the logits
        self._lib.llama_kv_self_seq_rm(self._ctx, 0, keep, -1)
        self._cached = self._cached[:keep]
        for start in range(keep, len(tokens), self._n_batch):
            self._decode(tokens[start:start + self._n_batch], start, last=start + self._n_batch >= len(tokens))
        self._cached = list(tokens)
        return self._argmax_last(), keep

    def _decode(self, chunk: list[int], pos0: int, last: bool) -> None:
        batch = self._lib.llama_batch_init(len(chunk), 0, 1)
        try:
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 0
            batch.logits[len(chunk) - 1] = 1 if last else 0
            rc = self._lib.llama_decode(self._ctx, batch)
        finally:
            self._lib.llama_batch_free(batch)
        if rc != 0:
            self._cached = []
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def _logits_view(self) -> np.ndarray:
        ptr = self._lib.llama_get_logits_ith(self._ctx, -1)
        return np.frombuffer(self._ffi.buffer(ptr, self.n_vocab * 4), dtype=np.float32)

    def last_logits(self) -> np.ndarray:
        """A copy of the last evaluated token's logits, [n_vocab]."""
        return self._logits_view().copy()

    def _argmax_last(self) -> int:
        return int(np.argmax(self._logits_view()))

    def close(self) -> None:
        if self._ctx is not None:
            self._lib.llama_free(self._ctx)
            self._lib.llama_model_free(self._model)
            self._ctx = self._model = None

    def __enter__(self) -> CffiLlama:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- llama-cpp-python


class PythonBindingLlama:
    """llama-cpp-python: create_completion reuses the common prefix with the context, then its RAM cache."""

    name = "llama-cpp-python"

    def __init__(self, model_path: Path, n_ctx: int, n_threads: int, n_batch: int = 512) -> None:
        from llama_cpp import Llama

        self._llm = Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, verbose=False)
        self.reset()

    def reset(self) -> None:
        from llama_cpp import LlamaRAMCache

        self._llm.reset()
        self._llm.set_cache(LlamaRAMCache(capacity_bytes=4 << 30))

    def first_token(self, tokens: list[int]) -> tuple[int, int]:
        keep = common_prefix(self._llm.input_ids[: self._llm.n_tokens].tolist(), tokens[:-1])
        for _ in self._llm.create_completion(tokens, max_tokens=1, temperature=0.0, stream=True):
            break
        return -1, keep

    def close(self) -> None:
        self._llm.close()


# ----------------------------------------------------------------------------- the run


def open_backend(n_ctx: int, threads: int, model_path: Path | None = None) -> PeerBackend:
    path = model_path or default_gguf_path()
    name = backend_name()
    if name == "llama-cpp-cffi":
        return CffiLlama(path, n_ctx, threads)
    if name == "llama-cpp-python":
        return PythonBindingLlama(path, n_ctx, threads)
    raise RuntimeError(f"no llama.cpp binding is installed ({INSTALL_HINT})")


def timed_first_token(backend: PeerBackend, tokens: list[int]) -> tuple[float, int, int]:
    """(TTFT ms, first token id, reused prompt tokens)."""
    t0 = time.perf_counter()
    token, reused = backend.first_token(tokens)
    return (time.perf_counter() - t0) * 1e3, token, reused


def measure_cases(backend: PeerBackend, target: int, original: list[int], reordered: list[int]) -> list[PeerRow]:
    """cold, then the same prompt again, then the reordered prompt, on one KV cache."""
    backend.reset()
    rows = []
    for case, tokens in zip(CASES, (original, original, reordered)):
        ms, token, reused = timed_first_token(backend, tokens)
        rows.append(PeerRow(case, target, len(tokens), ms, reused, token))
        logger.info("llama.cpp (%s) %s @%d tokens: ttft %.0f ms, %d tokens reused, first token %d",
                    backend.name, case, len(tokens), ms, reused, token)
    return rows


def _ctx_size(prompts: list[list[int]]) -> int:
    longest = max(len(p) for p in prompts)
    return -(-(longest + 16) // 256) * 256


def run_peer(contexts: list[tuple[int, Context]], runner: ModelRunner, threads: int = 2) -> list[PeerRow]:
    """TTFT of llama.cpp per context: cold, the same prompt again (prompt cache), a shuffled order after it."""
    prompts = [(target, _layout_tokens(runner, ctx.passages, ctx.question),
                _layout_tokens(runner, shuffled(ctx.passages, f"perf{target}"), ctx.question)) for target, ctx in contexts]
    if not prompts:
        return []
    backend = open_backend(_ctx_size([p for _, a, b in prompts for p in (a, b)]), threads)
    try:
        backend.first_token(prompts[0][1][:16])  # warm-up: weights paged in, compute buffers allocated
        return [row for target, original, reordered in prompts for row in measure_cases(backend, target, original, reordered)]
    finally:
        backend.close()


def _layout_tokens(runner: ModelRunner, passages: tuple[str, ...], question: str) -> list[int]:
    """Exactly the token ids our engine prefills (same tokenizer, same layout)."""
    from blend_engine.layout import DEFAULT_SYSTEM_PROMPT, build_layout

    plan = BlendPlan(passages, question)
    return build_layout(runner.encode, runner.tokenizer, DEFAULT_SYSTEM_PROMPT, plan.passages, plan.question).token_ids()
