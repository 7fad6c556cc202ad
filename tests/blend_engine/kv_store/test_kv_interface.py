"""What callers ask of a KV store goes through `KVStore`: tiers, the tier holding a key, its keys, its
format and whether it streams blobs, on every implementation (memory, disk, device, Redis, tiered)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest

from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.base import ChunkKV, KVStore, StoreStats
from blend_engine.kv_store.device import DeviceStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.redis_store import RedisStore
from blend_engine.kv_store.tiered import TieredStore
from tests import helpers
from tests.local_services import RedisProcess

REDIS = shutil.which("redis-server")


@pytest.fixture(params=["memory", "disk", "device", "redis"])
def single(request, tmp_path) -> Iterator[KVStore]:
    """One store of each single-tier implementation, storing int8."""
    if request.param == "redis":
        if REDIS is None:
            pytest.skip("redis-server binary not installed")
        server = RedisProcess().start()
        request.addfinalizer(server.stop)
    makers: dict[str, Callable[[], KVStore]] = {
        "memory": lambda: MemoryStore(1 << 24, kv_format="int8", pinned=False),
        "disk": lambda: DiskStore(tmp_path / "kv", 1 << 24, kv_format="int8"),
        "device": lambda: DeviceStore(1 << 24, "cpu", kv_format="int8"),
        "redis": lambda: RedisStore(server.url, kv_format="int8"),
    }
    store = makers[request.param]()
    yield store
    store.close()


def test_a_single_store_is_its_own_only_tier(single):
    kv = helpers.make_kv(1)
    assert list(single.tiers) == [single]
    assert single.kv_format == "int8" and single.blob_level
    assert single.tier_holding("a") is None
    assert single.put("a", kv)
    assert single.tier_holding("a") == single.name
    keys = single.keys()
    assert keys is None if isinstance(single, RedisStore) else keys == ["a"]  # a shared Redis cannot list


def test_a_tiered_store_answers_for_its_tiers(tmp_path):
    memory = MemoryStore(1 << 24, kv_format="int8", pinned=False)
    disk = DiskStore(tmp_path / "kv", 1 << 24, kv_format="int8")
    store = TieredStore([memory, disk])
    assert list(store.tiers) == [memory, disk] and store.kv_format == "int8" and store.blob_level
    store.put("a", helpers.make_kv(1))
    memory.delete("a")
    disk.put("b", helpers.make_kv(2))
    assert store.tier_holding("a") == "disk"  # the first tier top-down that holds it
    assert store.keys() == ["a", "b"]
    assert memory.keys() == [] and sorted(disk.keys()) == ["a", "b"]


@pytest.mark.skipif(REDIS is None, reason="redis-server binary not installed")
def test_a_tiered_store_with_an_unlistable_tier_cannot_list():
    server = RedisProcess().start()
    try:
        store = TieredStore([MemoryStore(1 << 24, pinned=False), RedisStore(server.url)])
        store.put("a", helpers.make_kv(1))
        assert store.keys() is None and store.tiers[0].keys() == ["a"]
        assert store.tier_holding("a") == "memory"
    finally:
        server.stop()


class _Plain(KVStore):
    """A store outside the blob hierarchy: the interface's defaults answer for it."""

    def __init__(self) -> None:
        self.held: dict[str, ChunkKV] = {}

    def contains(self, key: str) -> bool:
        return key in self.held

    def put(self, key: str, kv: ChunkKV) -> bool:
        self.held[key] = kv
        return True

    def get_layer(self, key: str, layer: int):
        return self.held[key].layer(layer) if key in self.held else None

    def get(self, key: str) -> ChunkKV | None:
        return self.held.get(key)

    def delete(self, key: str) -> bool:
        return self.held.pop(key, None) is not None

    def stats(self) -> StoreStats:
        return StoreStats(name=self.name, entries=len(self.held))


def test_defaults_for_a_store_outside_the_blob_hierarchy():
    store = _Plain()
    store.put("a", helpers.make_kv(1))
    assert list(store.tiers) == [store] and store.tier_holding("a") == "store" and store.tier_holding("b") is None
    assert store.keys() is None and store.kv_format is None and not store.blob_level
