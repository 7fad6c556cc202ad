from blend_engine.kv_store.base import ChunkKV, KVStore, StoreStats
from blend_engine.kv_store.memory import MemoryStore

__all__ = ["ChunkKV", "KVStore", "MemoryStore", "StoreStats"]
