"""FAISS vector index keyed by int64 vector ids, persisted atomically next to its id map.

Kinds:
- flat: exact inner product (IndexIDMap2 over IndexFlatIP): add and remove in place.
- hnsw: approximate (IndexIDMap2 over IndexHNSWFlat); removal rebuilds from the stored vectors.
- ivf:  approximate (IndexIVFFlat); exact flat until `ivf_min_train` vectors, then trained once.
Vectors are L2-normalized by the embedder, so inner product = cosine similarity.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
IDMAP_FILE = "index.idmap.json"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class IndexParams:
    kind: str = "flat"  # flat | hnsw | ivf
    hnsw_m: int = 32
    hnsw_ef_construction: int = 80
    hnsw_ef_search: int = 64
    ivf_nlist: int = 0  # 0 = about 4 * sqrt(n) at training time
    ivf_nprobe: int = 16
    ivf_min_train: int = 20_000

    def __post_init__(self) -> None:
        if self.kind not in ("flat", "hnsw", "ivf"):
            raise ValueError(f"index kind must be flat, hnsw or ivf, not {self.kind!r}")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class VectorIndex:
    """Thread-safe. ids are int64; `search` returns (scores [Q, k], ids [Q, k]) with -1 padding."""

    def __init__(self, dim: int, params: IndexParams | None = None, label: str = "") -> None:
        self.dim = dim
        self.params = params or IndexParams()
        self.label = label  # e.g. the embedder name; a mismatch on load forces a rebuild
        self._lock = threading.RLock()
        self._index = self._new_staging() if self.params.kind != "hnsw" else self._new_hnsw()
        self._ids: dict[int, None] = {}  # insertion-ordered set of ids present
        # the passage-store change applied last: every change up to it is in the index (None = unknown)
        self.generation: int | None = None

    # ------------------------------------------------------------------ construction
    def _new_flat(self) -> faiss.Index:
        return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))

    _new_staging = _new_flat

    def _new_hnsw(self) -> faiss.Index:
        inner = faiss.IndexHNSWFlat(self.dim, self.params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = self.params.hnsw_ef_construction
        inner.hnsw.efSearch = self.params.hnsw_ef_search
        return faiss.IndexIDMap2(inner)

    @property
    def kind(self) -> str:
        """The structure in use now: 'ivf' stays 'flat' until trained."""
        if isinstance(self._index, faiss.IndexIVF):
            return "ivf"
        return self.params.kind if self.params.kind == "hnsw" else "flat"

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def ids(self) -> np.ndarray:
        with self._lock:
            return np.fromiter(self._ids, dtype=np.int64, count=len(self._ids))

    def __contains__(self, vec_id: int) -> bool:
        with self._lock:
            return int(vec_id) in self._ids

    # ------------------------------------------------------------------ mutation
    def add(self, ids: np.ndarray, vecs: np.ndarray) -> int:
        """Add vectors [N, dim] under ids [N]; ids already present are replaced. Returns N added."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim or len(ids) != len(vecs):
            raise ValueError(f"add wants ids [N] and vectors [N, {self.dim}]; got {ids.shape}, {vecs.shape}")
        if len(set(ids.tolist())) != len(ids):
            raise ValueError("duplicate ids in one add")
        with self._lock:
            present = [i for i in ids.tolist() if i in self._ids]
            if present:
                self.remove(np.asarray(present, dtype=np.int64))
            self._index.add_with_ids(vecs, ids)
            for i in ids.tolist():
                self._ids[i] = None
            self._maybe_train_ivf()
            return len(ids)

    def remove(self, ids: np.ndarray) -> int:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        with self._lock:
            gone = [i for i in ids.tolist() if i in self._ids]
            if not gone:
                return 0
            if self.kind == "hnsw":
                self._rebuild_without(set(gone))
            else:
                self._index.remove_ids(faiss.IDSelectorBatch(np.asarray(gone, dtype=np.int64)))
            for i in gone:
                self._ids.pop(i, None)
            return len(gone)

    def _all_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids [N], vectors [N, dim]) in the index's internal order (IDMap2 kinds only)."""
        idx = self._index
        n = idx.ntotal
        ids = faiss.vector_to_array(idx.id_map).astype(np.int64)  # [N]
        vecs = idx.index.reconstruct_n(0, n) if n else np.zeros((0, self.dim), np.float32)  # [N, dim]
        return ids, vecs

    def _rebuild_without(self, drop: set[int]) -> None:
        ids, vecs = self._all_vectors()
        keep = np.asarray([i not in drop for i in ids.tolist()], dtype=bool)
        self._index = self._new_hnsw()
        if keep.any():
            self._index.add_with_ids(np.ascontiguousarray(vecs[keep]), ids[keep])
        logger.info("hnsw index rebuilt after removing %d vectors (%d remain)", len(drop), int(keep.sum()))

    def _maybe_train_ivf(self) -> None:
        if self.params.kind != "ivf" or self.kind == "ivf" or self._index.ntotal < self.params.ivf_min_train:
            return
        ids, vecs = self._all_vectors()
        n = len(ids)
        nlist = self.params.ivf_nlist or int(4 * math.sqrt(n))
        nlist = max(1, min(nlist, n // 39))
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(vecs)
        ivf.add_with_ids(vecs, ids)
        ivf.nprobe = min(self.params.ivf_nprobe, nlist)
        self._quantizer = quantizer  # keep the python object alive with the index
        self._index = ivf
        logger.info("ivf index trained: %d vectors, nlist=%d, nprobe=%d", n, nlist, ivf.nprobe)

    # ------------------------------------------------------------------ search
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)  # [Q, dim]
        with self._lock:
            if not self._ids or k <= 0:
                return np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), np.int64)
            scores, ids = self._index.search(q, min(k, len(self._ids)))  # [Q, k] each
        return scores, ids

    # ------------------------------------------------------------------ persistence
    def save(self, folder: Path) -> None:
        """Write the index then its id map, each atomically (temp file + rename)."""
        folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            data = faiss.serialize_index(self._index).tobytes()
            meta = {
                "version": _FORMAT_VERSION, "kind": self.kind, "params": self.params.__dict__,
                "dim": self.dim, "label": self.label, "ntotal": int(self._index.ntotal), "ids": list(self._ids),
                "generation": self.generation,
            }
        _atomic_write(folder / INDEX_FILE, data)
        _atomic_write(folder / IDMAP_FILE, json.dumps(meta).encode())

    @classmethod
    def load(cls, folder: Path, dim: int, params: IndexParams, label: str) -> VectorIndex | None:
        """The persisted index, or None when absent, unreadable or built for something else."""
        ipath, mpath = folder / INDEX_FILE, folder / IDMAP_FILE
        if not ipath.exists() or not mpath.exists():
            return None
        try:
            meta = json.loads(mpath.read_text())
            index = faiss.deserialize_index(np.frombuffer(ipath.read_bytes(), dtype=np.uint8))
        except (OSError, ValueError, RuntimeError) as exc:
            logger.warning("index in %s unreadable (%s); it will be rebuilt", folder, exc)
            return None
        want = {"version": _FORMAT_VERSION, "dim": dim, "label": label}
        if any(meta.get(k) != v for k, v in want.items()) or meta.get("params", {}).get("kind") != params.kind:
            logger.warning("index in %s was built for %s, not %s; it will be rebuilt",
                           folder, {k: meta.get(k) for k in want}, want)
            return None
        if index.ntotal != meta.get("ntotal") or len(meta.get("ids", [])) != index.ntotal:
            logger.warning("index and id map in %s disagree; the index will be rebuilt", folder)
            return None
        self = cls(dim, params, label)
        self._index = index
        self._ids = dict.fromkeys(int(i) for i in meta["ids"])
        generation = meta.get("generation")
        self.generation = int(generation) if isinstance(generation, int) else None
        self._tune()
        return self

    def _tune(self) -> None:
        if isinstance(self._index, faiss.IndexIVF):
            self._index.nprobe = min(self.params.ivf_nprobe, self._index.nlist)
        elif self.params.kind == "hnsw":
            faiss.downcast_index(self._index.index).hnsw.efSearch = self.params.hnsw_ef_search
