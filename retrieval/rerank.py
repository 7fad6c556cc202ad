"""The optional reranker: a sentence-transformers CrossEncoder that rescores the fused candidates
(question, passage) jointly. Used only when `BLENDSERVE_RETRIEVAL_RERANKER` names a local model folder; nothing is
downloaded."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from retrieval.retriever import RetrievedPassage

logger = logging.getLogger(__name__)


class Reranker:
    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 32) -> None:
        from sentence_transformers import CrossEncoder

        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise ValueError(f"reranker {folder} is not a local model folder")
        self.model = CrossEncoder(str(folder), device=device, local_files_only=True)
        self.name = folder.name
        self.batch_size = batch_size
        logger.info("reranker: CrossEncoder from %s", folder)

    def rerank(self, question: str, passages: list[RetrievedPassage]) -> list[RetrievedPassage]:
        """The passages with the cross-encoder's scores, best first (ties keep the fused order)."""
        if not passages:
            return []
        scores = self.model.predict([(question, p.passage) for p in passages], batch_size=self.batch_size,
                                    show_progress_bar=False)  # [N]
        rescored = [replace(p, score=float(s)) for p, s in zip(passages, scores)]
        return sorted(rescored, key=lambda p: -p.score)
