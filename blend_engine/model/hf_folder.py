"""A GGUF model (by default the bundled SmolLM2) written out once as a Hugging Face model folder
(config, tokenizer, safetensors) for vLLM, which loads folders, cached under ~/.cache/blendserve/models/
(or the caller's root: the service passes `BLENDSERVE_MODEL_CACHE_DIR`).

transformers refuses `save_pretrained` on a model loaded from a GGUF file; a model built from the
GGUF's config, with the de-quantized weights loaded into it, saves fine. The folder is written under
a temporary name and renamed into place, so a crash leaves no half-written model behind.

    python -m benchmarks.common.vllm_model    # prints the default model's folder (writes it on first use)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from blend_engine.model.files import DEFAULT_CACHE_ROOT, default_gguf_path, resolve_source

logger = logging.getLogger(__name__)

MARKER = "model.safetensors"  # written last by save_pretrained: its presence means a whole folder


def cache_root(root: Path | None = None) -> Path:
    return root if root is not None else DEFAULT_CACHE_ROOT


def content_tag(path: Path, probe: int = 1 << 20) -> str:
    """A tag of the file's size and its first and last MiB: the same GGUF installed twice (another
    venv, another mtime) maps to one folder."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        h.update(fh.read(probe))
        fh.seek(max(0, size - probe))
        h.update(fh.read(probe))
    return h.hexdigest()[:16]


def folder_for(gguf: Path, root: Path | None = None) -> Path:
    """The HF folder of one GGUF file: its name plus a tag of its content."""
    return cache_root(root) / f"{gguf.stem}-hf-{content_tag(gguf)}"


def is_complete(folder: Path) -> bool:
    return all((folder / f).exists() for f in ("config.json", "tokenizer.json", MARKER))


def _write(gguf: Path, tmp: Path) -> None:
    """Build the model from the GGUF's config, load the de-quantized weights into it, save it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, name = gguf.parent, gguf.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the GGUF's weights do not fit its config: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)


def ensure_model_folder(gguf: Path | None = None, root: Path | None = None) -> Path:
    """The HF folder of `gguf` (default: the bundled SmolLM2), written once."""
    gguf = gguf or default_gguf_path()
    folder = folder_for(gguf, root)
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    logger.info("writing %s as a model folder in %s (once)", gguf.name, folder)
    try:
        _write(gguf, tmp)
        if folder.exists():  # an incomplete folder from an older crash
            shutil.rmtree(folder)
        tmp.replace(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def vllm_folder(spec: str, root: Path | None = None) -> Path:
    """The folder vLLM loads for a Blendserve model spec (`BLENDSERVE_MODEL_NAME`): a checkpoint folder
    as it is, a GGUF file (or the default model) written out once as a folder."""
    folder, gguf = resolve_source(spec)
    return folder if gguf is None else ensure_model_folder(folder / gguf, root)
