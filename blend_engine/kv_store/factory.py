"""Build the configured store stack: device (when a budget is given) over memory over local disk (when
disk_dir) over Redis (when redis_url)."""

from __future__ import annotations

import logging
from pathlib import Path

from blend_engine.kv_store.base import KVStore
from blend_engine.kv_store.blob import BlobStore
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.kv_store.memory import MemoryStore
from blend_engine.kv_store.tiered import TieredStore

logger = logging.getLogger(__name__)


def build_store(
    *,
    kv_format: str = "fp16",
    memory_bytes: int = 1 << 30,
    device_bytes: int = 0,
    device: str | None = None,
    disk_dir: Path | None = None,
    disk_bytes: int = 20 << 30,
    disk_direct_io: bool = False,
    redis_url: str | None = None,
    redis_timeout_s: float = 0.5,
    fingerprint: str = "",
) -> KVStore:
    """Memory tier on top of local disk (when disk_dir) on top of Redis (when redis_url), and a device
    tier of `device_bytes` on `device` above them all when both are given (`device.device_cache_bytes`).

    `fingerprint` (the engine's `store_fingerprint`) is written into disk and Redis entries;
    entries of another fingerprint are misses. Empty: keys alone separate models. The memory tier
    holds page-locked tensors where CUDA exists; `disk_direct_io` makes layer streams read the disk
    tier with O_DIRECT.
    """
    tiers: list[BlobStore] = [MemoryStore(memory_bytes, kv_format=kv_format, fingerprint=fingerprint)]
    if device_bytes > 0:
        if device is None:
            raise ValueError("a device tier budget needs the device it lives on")
        from blend_engine.kv_store.device import DeviceStore

        tiers.insert(0, DeviceStore(device_bytes, device, kv_format=kv_format, fingerprint=fingerprint))
    if disk_dir is not None:
        from blend_engine.kv_store.disk import DiskStore

        tiers.append(DiskStore(Path(disk_dir), disk_bytes, kv_format=kv_format, fingerprint=fingerprint,
                               direct_io=disk_direct_io))
    if redis_url:
        tiers.append(_redis_tier(redis_url, kv_format, fingerprint, redis_timeout_s))
    logger.info("KV store tiers: %s (%s)", " > ".join(t.name for t in tiers), kv_format)
    return TieredStore(tiers)


def _redis_tier(url: str, kv_format: str, fingerprint: str, timeout_s: float) -> BlobStore:
    """The Redis tier at `url`; one not answering yet is kept all the same (with a warning): it joins
    when it answers."""
    from blend_engine.kv_store.redis_store import RedisStore

    redis_tier = RedisStore(url, kv_format=kv_format, fingerprint=fingerprint, timeout_s=timeout_s)
    if not redis_tier.ping():
        logger.warning("redis %s is not answering at start-up; local tiers serve until it does", redis_tier.url)
    return redis_tier


def build_loader(store: KVStore, prefetch_depth: int = 2) -> LayerLoader:
    """A loader that reads `prefetch_depth` layers ahead on a background thread (0: synchronous)."""
    return LayerLoader(store, prefetch_depth=prefetch_depth)
