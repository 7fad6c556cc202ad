"""Local disk tier: round trip, LRU budget, restart, corruption, fingerprints, full disk, racing writers."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import sqlite3
from pathlib import Path

import pytest
import torch

from blend_engine.kv_store import ChunkKV
from blend_engine.kv_store.chunkfile import encode_header
from blend_engine.kv_store.codec import decode_chunk, encode_chunk
from blend_engine.kv_store.disk import DiskStore
from tests.helpers import make_kv


def file_size(kv: ChunkKV, key: str = "k") -> int:
    meta, _ = encode_chunk("fp16", kv)
    return len(encode_header(key, meta)) + meta.nbytes


@pytest.mark.parametrize("fmt", ["fp16", "fp32", "int8"])
def test_round_trip_bit_exact_per_layer(tmp_path, fmt):
    store = DiskStore(tmp_path, 1 << 24, kv_format=fmt, fingerprint="fp")
    kv = make_kv(1)
    assert store.put("abc", kv)
    expected = decode_chunk(*encode_chunk(fmt, kv))
    for layer in reversed(range(kv.n_layers)):  # any layer alone
        k, v = store.get_layer("abc", layer)  # [H, T, D]
        assert torch.equal(k, expected.k[layer]) and torch.equal(v, expected.v[layer])
    st = store.stats()
    assert st.hits == 1 and st.entries == 1 and st.bytes_read == expected.k.numel() * 2 * {"fp16": 2, "fp32": 4}.get(
        fmt, 1) + (0 if fmt != "int8" else 4 * 2 * (9 + 8) * 2)  # int8: fp16 scales, K [H, D], V [H, T]
    assert not list(tmp_path.glob("chunks/*/*.tmp*"))  # the temporary file was renamed away


def test_layer_read_touches_only_that_layer(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 24)
    kv = make_kv(2)
    store.put("abc", kv)
    meta, _ = encode_chunk("fp16", kv)
    reads: list[tuple[int, int]] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append((off, len(bufs[0]))) or real(fd, bufs, off))
    store.get_layer("abc", 2)
    assert len(reads) == 1 and reads[0][1] == meta.layer_nbytes


def test_lru_eviction_order_under_byte_budget(tmp_path):
    size = file_size(make_kv(0))
    store = DiskStore(tmp_path, 3 * size)
    for key in ("k1", "k2", "k3"):
        assert store.put(key, make_kv(int(key[1])))
    assert store.get_layer("k1", 0) is not None  # k1 most recent now
    assert store.put("k4", make_kv(4))
    assert store.keys() == ["k3", "k1", "k4"] and not store.contains("k2")
    assert not store.path("k2").exists()
    st = store.stats()
    assert st.evictions == 1 and st.bytes_used == 3 * size <= st.bytes_budget
    assert not store.put("big", make_kv(5, T=200))  # larger than the budget: skipped, nothing evicted
    assert store.stats().skipped_puts == 1 and store.keys() == ["k3", "k1", "k4"]


def test_index_survives_restart_with_lru_order(tmp_path):
    size = file_size(make_kv(0))
    store = DiskStore(tmp_path, 10 * size, fingerprint="fp")
    for key in ("k1", "k2", "k3"):
        store.put(key, make_kv(int(key[1])))
    store.get_layer("k1", 0)
    store.close()
    again = DiskStore(tmp_path, 10 * size, fingerprint="fp")
    assert again.keys() == ["k2", "k3", "k1"]
    assert again.stats().bytes_used == 3 * size
    assert torch.equal(again.get("k2").k, make_kv(2).k)
    again.close()
    smaller = DiskStore(tmp_path, 2 * size, fingerprint="fp")  # a smaller budget evicts the oldest on start
    assert smaller.keys() == ["k1", "k2"]  # the get above made k2 the most recent


def test_index_reconciles_with_files(tmp_path):
    store = DiskStore(tmp_path, 1 << 24)
    store.put("k1", make_kv(1))
    store.put("k2", make_kv(2))
    store.close()
    store.path("k1").unlink()  # file gone behind the index's back
    again = DiskStore(tmp_path, 1 << 24)
    assert again.keys() == ["k2"] and not again.contains("k1")


def test_one_flipped_byte_is_detected_and_dropped(tmp_path):
    store = DiskStore(tmp_path, 1 << 24)
    kv = make_kv(3)
    store.put("abc", kv)
    meta, _ = encode_chunk("fp16", kv)
    path = store.path("abc")
    data = bytearray(path.read_bytes())
    offset = len(data) - meta.nbytes + 2 * meta.layer_nbytes + 17  # a byte inside layer 2
    data[offset] ^= 0x01
    path.write_bytes(data)
    assert store.get_layer("abc", 1) is not None  # other layers still verify
    assert store.get_layer("abc", 2) is None
    assert store.stats().corrupt == 1 and not store.contains("abc") and not path.exists()


def test_truncated_file_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, 1 << 24)
    store.put("abc", make_kv(4))
    path = store.path("abc")
    path.write_bytes(path.read_bytes()[:-100])
    assert store.get_layer("abc", 3) is None and store.stats().corrupt == 1  # header cached: short read
    assert not path.exists()
    store.put("abc", make_kv(4))
    path.write_bytes(path.read_bytes()[:-100])
    fresh = DiskStore(tmp_path, 1 << 24)  # a new reader checks the header against the file size
    assert not fresh.contains("abc") and fresh.stats().corrupt == 1


def test_wrong_fingerprint_or_format_is_a_miss(tmp_path):
    DiskStore(tmp_path, 1 << 24, fingerprint="model-A:fp16:v1").put("abc", make_kv(5))
    other = DiskStore(tmp_path, 1 << 24, fingerprint="model-B:fp16:v1")
    assert not other.contains("abc") and other.get_layer("abc", 0) is None and other.get("abc") is None
    assert other.stats().extra["foreign"] >= 1
    assert not DiskStore(tmp_path, 1 << 24, kv_format="int8", fingerprint="model-A:fp16:v1").contains("abc")
    assert DiskStore(tmp_path, 1 << 24, fingerprint="model-A:fp16:v1").contains("abc")


def test_full_disk_evicts_then_skips_without_raising(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 24)
    store.put("old", make_kv(6))
    real_replace = os.replace
    calls = {"n": 0}

    def full(src, dst):
        calls["n"] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert store.put("new", make_kv(7)) is False  # evicted "old" to make room, retried, then skipped
    assert calls["n"] == 2 and not store.contains("old") and not store.contains("new")
    st = store.stats()
    assert st.errors == 2 and st.skipped_puts == 1
    assert not list(tmp_path.glob("chunks/*/*.tmp*"))
    monkeypatch.setattr(os, "replace", real_replace)
    assert store.put("new", make_kv(7)) and store.contains("new")


def _writer(root: str, seed: int, n: int) -> None:
    store = DiskStore(root, 1 << 26, fingerprint="fp")
    for _ in range(n):
        store.put("same", make_kv(seed, T=300))


def test_concurrent_writers_in_two_processes_leave_one_valid_entry(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), seed, 15)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    store = DiskStore(tmp_path, 1 << 26, fingerprint="fp")
    got = store.get("same")
    assert got is not None and store.stats().corrupt == 0
    assert any(torch.equal(got.k, make_kv(s, T=300).k) for s in (1, 2))
    assert [p.name for p in tmp_path.glob("chunks/*/*")] == [store.path("same").name]


class _LockedIndex:
    """A SQLite connection whose switch to WAL fails with "database is locked" `fails` times."""

    def __init__(self, db, fails: float) -> None:
        self.db, self.fails, self.tries = db, fails, 0

    def execute(self, query, *args):
        if query.startswith("PRAGMA journal_mode"):
            self.tries += 1
            if self.tries <= self.fails:
                raise sqlite3.OperationalError("database is locked")
        return self.db.execute(query, *args)

    def __getattr__(self, name):
        return getattr(self.db, name)


def _lock_index(monkeypatch, fails: float) -> list[_LockedIndex]:
    """Make every new index connection fail its WAL switch `fails` times; returns the connections."""
    from blend_engine.kv_store import chunk_index as index_mod

    real_connect, opened = sqlite3.connect, []

    def connect(*a, **k):
        opened.append(_LockedIndex(real_connect(*a, **k), fails))
        return opened[-1]

    monkeypatch.setattr(index_mod.sqlite3, "connect", connect)
    return opened


def test_index_set_up_retries_while_another_process_holds_the_database(tmp_path, monkeypatch):
    """Switching to WAL can fail at once with "database is locked" while another process opens the
    same index (seen in CI with two writers); opening must retry instead of failing the store."""
    opened = _lock_index(monkeypatch, fails=2)
    store = DiskStore(tmp_path, 1 << 26, fingerprint="fp")
    assert store.put("a", make_kv(1)) and store.contains("a")
    assert opened[0].tries == 3


def test_index_set_up_gives_up_when_the_database_stays_locked(tmp_path, monkeypatch):
    """A lock that never clears is reported, after the bounded retries, as the SQLite error."""
    store = DiskStore(tmp_path, 1 << 26, fingerprint="fp")
    opened = _lock_index(monkeypatch, fails=float("inf"))
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store._index.open(attempts=3)
    assert opened[0].tries == 3


def test_opening_skips_a_temporary_file_renamed_between_the_listing_and_its_stat(tmp_path, monkeypatch):
    """Another process's writer renames its temporary file into place while this one opens the store
    (seen in CI as a FileNotFoundError from the start-up scan): the scan skips it."""
    DiskStore(tmp_path, 1 << 26, fingerprint="fp").put("a", make_kv(1, T=20))
    tmp = next(tmp_path.glob("chunks/*/*")).with_name("b.kv.tmp123-abc")
    tmp.write_bytes(b"partial")
    real_stat = Path.stat

    def gone(self, *args, **kwargs):
        if ".tmp" in self.name:
            raise FileNotFoundError(self)
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", gone)
    store = DiskStore(tmp_path, 1 << 26, fingerprint="fp")
    assert store.keys() == ["a"] and store.get("a") is not None
