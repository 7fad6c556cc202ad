"""The KV store's narrow interface and its value type.

A chunk is one cached piece of prompt (a passage or the system prefix), prefilled alone at
positions 0..T-1. Its value is every layer's K (after RoPE) and V. Stores address it by a
content key (see `blend_engine.keys`); they never see positions, requests or models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ChunkKV:
    """All layers of one chunk. k, v: [L, H, T, D]."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"ChunkKV wants k, v of equal shape [L, H, T, D]; got {tuple(self.k.shape)}, "
                             f"{tuple(self.v.shape)}")

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]  # [H, T, D] each

    def nbytes(self) -> int:
        return self.k.element_size() * self.k.numel() * 2


@dataclass
class StoreStats:
    """Counters every tier keeps. Plain numbers only."""

    name: str
    kind: str = "storage"  # "device" (delivers in place), "memory" (copied into staging), "storage" (read into it)
    hits: int = 0
    misses: int = 0
    puts: int = 0
    skipped_puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    entries: int = 0
    bytes_used: int = 0
    bytes_budget: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def snapshot(self) -> StoreStats:
        """A copy the caller may keep (taken under the tier's lock)."""
        return StoreStats(**{**self.__dict__, "extra": dict(self.extra)})

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class KVStore(ABC):
    """contains / put / get_layer / prefetch / delete / stats. Implementations are thread-safe.

    What callers may ask of any store, instead of probing its type: `tiers` (the stores it is made
    of, top-down), `tier_holding(key)`, `keys()` (None when it cannot list them), `kv_format` (None
    when it keeps chunks as given) and `blob_level` (whether it is a `BlobStore`, whose layer streams
    read blobs into a staging ring).
    """

    name: str = "store"
    kv_format: str | None = None  # the stored precision ("fp16", "int8", ...); None = chunks kept as given
    blob_level: bool = False  # True for a `BlobStore` (meta / get_blob / put_blobs / open_files)

    @property
    def tiers(self) -> Sequence[KVStore]:
        """The stores this one is made of, top-down (fastest first); a single store is its own only tier."""
        return (self,)

    def tier_holding(self, key: str) -> str | None:
        """The name of the first tier (top-down) that holds `key`; None when none does."""
        for tier in self.tiers:
            if tier.contains(key):
                return tier.name
        return None

    def keys(self) -> list[str] | None:
        """Every key held, or None when this store cannot list them (a shared Redis tier)."""
        return None

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def put(self, key: str, kv: ChunkKV) -> bool:
        """Store a chunk (converting to the store's precision). False when skipped (budget, disk full)."""

    @abstractmethod
    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer's (k, v), each [H, T, D]; None on a miss or a corrupt entry (which is dropped)."""

    def get_layer_stored(self, key: str, layer: int):
        """One layer as stored, for a consumer that decodes it where it computes: (k, v) [H, T, D],
        or an int8 store's `codec.QuantLayer`. Default: `get_layer`."""
        return self.get_layer(key, layer)

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None:
        """Every layer of a chunk (in the store's precision); None on a miss or corruption."""

    def prefetch(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Hint that these chunks will be read soon. Default: nothing."""

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def stats(self) -> StoreStats: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
