"""blendserve_vllm.connector against a minimal stand-in for the vLLM 0.32 modules it imports.

The stand-in keeps the real signatures (vllm/distributed/kv_transfer/kv_connector/v1/base.py,
vllm/model_executor/models/utils.py, vllm/distributed/parallel_state.py); scheduler outputs carry
the fields of vllm/v1/core/sched/output.py that the connector reads. Caches are read back the way
FlashAttention reads them: `kv_cache.transpose(1, 2).split(D, dim=-1)`."""

from __future__ import annotations

import enum
import importlib
import os
import sys
import types
from abc import ABC, abstractmethod
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

import blendserve_vllm
from blendserve_vllm import layouts
from blendserve_vllm.segments import SegmentError, SegmentMeta, token_hash, write_segment
from tests.blendserve_vllm.conftest import needs_redis
from tests.local_services import free_port

CONNECTOR = "blendserve_vllm.connector"
L, H, D, N = 2, 2, 4, 16  # layers, kv heads, head dim, block size
B = 8  # cache blocks
LAYER = "model.layers.{}.self_attn.attn"
PROMPT = list(range(100, 141))  # 41 token ids
HANDLE = "blendserve-seg-1"


# ------------------------------------------------------------------ the fake vLLM
def _base_module(name: str) -> types.ModuleType:
    """vllm.distributed.kv_transfer.kv_connector.v1.base: what the connector uses, as in vLLM 0.32."""
    mod = types.ModuleType(name)

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # noqa: B024
        pass

    class KVConnectorBase_V1(ABC):
        def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
            self._connector_metadata: KVConnectorMetadata | None = None
            self._vllm_config = vllm_config
            if vllm_config.kv_transfer_config is not None:
                self._kv_transfer_config = vllm_config.kv_transfer_config
            else:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> KVConnectorRole:
            return self._role

        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
            return

        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs) -> None: ...

        @abstractmethod
        def wait_for_layer_load(self, layer_name: str) -> None: ...

        @abstractmethod
        def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None: ...

        @abstractmethod
        def wait_for_save(self): ...

        def get_block_ids_with_load_errors(self) -> set[int]:
            return set()

        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]: ...

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens: int): ...

        @abstractmethod
        def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata: ...

        def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
            return False, None

    mod.KVConnectorRole, mod.KVConnectorMetadata, mod.KVConnectorBase_V1 = (
        KVConnectorRole, KVConnectorMetadata, KVConnectorBase_V1)
    return mod


def extract_layer_index(layer_name: str, num_attn_module: int = 1) -> int:
    """vLLM's, for num_attn_module == 1: the one integer of the dotted name."""
    ints = []
    for sub in layer_name.split("."):
        try:
            ints.append(int(sub))
        except ValueError:
            continue
    assert len(ints) == 1, f"layer name {layer_name} should only contain one integer"
    return ints[0]


@contextmanager
def fake_vllm(tp: dict):
    """Install the stand-in modules, import the connector against them; afterwards remove both."""
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.model_executor", "vllm.model_executor.models"]
    mods = {name: types.ModuleType(name) for name in names}
    for mod in mods.values():
        mod.__path__ = []  # a package
    base = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    mods[base] = _base_module(base)
    utils = mods["vllm.model_executor.models.utils"] = types.ModuleType("vllm.model_executor.models.utils")
    utils.extract_layer_index = extract_layer_index
    ps = mods["vllm.distributed.parallel_state"] = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tensor_model_parallel_rank = lambda: tp["rank"]
    ps.get_tensor_model_parallel_world_size = lambda: tp["world"]
    for name, mod in mods.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)

    saved = {name: sys.modules.get(name) for name in [*mods, CONNECTOR]}
    had_attr = "connector" in vars(blendserve_vllm)
    old_attr = vars(blendserve_vllm).get("connector")
    sys.modules.update(mods)
    sys.modules.pop(CONNECTOR, None)
    try:
        yield importlib.import_module(CONNECTOR)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        if had_attr:
            blendserve_vllm.connector = old_attr
        else:
            vars(blendserve_vllm).pop("connector", None)


@pytest.fixture
def tp() -> dict:
    return {"rank": 0, "world": 1}


@pytest.fixture
def cx(tp):
    """The connector module, imported against the fake vLLM."""
    with fake_vllm(tp) as module:
        yield module


def _vllm_state() -> tuple:
    return ({name: id(mod) for name, mod in sys.modules.items() if name == "vllm" or name.startswith("vllm.")},
            id(sys.modules.get(CONNECTOR)), id(vars(blendserve_vllm).get("connector")))


def test_the_fake_vllm_leaves_nothing_behind():
    before = _vllm_state()
    with fake_vllm({"rank": 0, "world": 1}) as module:
        assert module.__name__ == CONNECTOR and "vllm.distributed.parallel_state" in sys.modules
        assert sys.modules[CONNECTOR] is module and blendserve_vllm.connector is module
    assert _vllm_state() == before


# ------------------------------------------------------------------ helpers
def vllm_config(folder, layers: int = L, heads: int = H, head_dim: int = D, **extra) -> SimpleNamespace:
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: layers, get_total_num_kv_heads=lambda: heads,
                            get_head_size=lambda: head_dim)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"segment_dir": str(folder), **extra}),
        cache_config=SimpleNamespace(block_size=N), model_config=model)


def make_connector(cx, folder, role: str = "SCHEDULER", **kw):
    return cx.BlendserveConnector(vllm_config(folder, **kw), cx.KVConnectorRole[role], None)


def publish(folder, ids=PROMPT[:40], name: str = HANDLE, layers: int = L, heads: int = H, head_dim: int = D,
            dtype: torch.dtype = torch.float32, seed: int = 0):
    """Write segment `name` for `ids`; its K, V per layer [T, H, D], distinct everywhere."""
    meta = SegmentMeta(n_layers=layers, n_tokens=len(ids), kv_heads=heads, head_dim=head_dim,
                       dtype=str(dtype).removeprefix("torch."), token_hash=token_hash(ids))
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(len(ids), heads, head_dim, generator=g).to(dtype) for _ in range(layers)]  # L x [T, H, D]
    vs = [torch.randn(len(ids), heads, head_dim, generator=g).to(dtype) for _ in range(layers)]  # L x [T, H, D]

    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k.copy_(ks[layer])
        v.copy_(vs[layer])

    write_segment(folder, name, meta, fill)
    return ks, vs


def request(handle=HANDLE, ids=PROMPT, req_id: str = "req-1") -> SimpleNamespace:
    params = None if handle is None else {"blendserve_kv": handle}
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(ids), kv_transfer_params=params)


def sched_output(new=(), cached=()) -> SimpleNamespace:
    """new: (req_id, block_ids, num_computed_tokens); cached: (req_id, new_block_ids or None, num_computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None if b is None else (list(b),) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]))


def slot_of(block_ids, t: int) -> int:
    return block_ids[t // N] * N + t % N


def std_caches(heads: int = H, dtype=torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {LAYER.format(i): torch.randn(B, heads, N, 2 * D, generator=g).to(dtype) for i in range(L)}  # [B,H,N,2D]


def expected_cache(before: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids, start: int,
                   end: int) -> torch.Tensor:
    """`before` with prompt tokens start..end-1 (rows of k, v [T_seg, H, D]) at their slots, placed
    through FlashAttention's read view."""
    out = before.clone()
    key, value = out.transpose(1, 2).split(D, dim=-1)  # [B, N, H, D] views of out
    for t in range(start, end):
        s = slot_of(block_ids, t)
        key[s // N, s % N] = k[t]
        value[s // N, s % N] = v[t]
    return out


# ------------------------------------------------------------------ scheduler side
def test_a_matching_segment_is_an_external_hit_but_the_last_token(cx, tmp_path):
    publish(tmp_path)  # 40 of the prompt's 41 tokens
    conn = make_connector(cx, tmp_path)
    assert conn.role is cx.KVConnectorRole.SCHEDULER
    assert conn.get_num_new_matched_tokens(request(), 0) == (40, False)
    assert conn.get_num_new_matched_tokens(request(), 16) == (24, False)  # vLLM's own prefix hit: 16
    assert conn.get_num_new_matched_tokens(request(), 40) == (0, False)
    assert conn.get_num_new_matched_tokens(request(), 48) == (0, False)


def test_a_segment_of_the_whole_prompt_leaves_the_last_token_to_vllm(cx, tmp_path):
    publish(tmp_path, ids=PROMPT)  # all 41
    conn = make_connector(cx, tmp_path)
    assert conn.get_num_new_matched_tokens(request(), 0) == (40, False)
    assert conn.get_num_new_matched_tokens(request(), 32) == (8, False)


def test_a_segment_shorter_than_the_prompt_covers_its_prefix(cx, tmp_path):
    publish(tmp_path, ids=PROMPT[:20])
    conn = make_connector(cx, tmp_path)
    assert conn.get_num_new_matched_tokens(request(), 0) == (20, False)
    assert conn.get_num_new_matched_tokens(request(), 16) == (4, False)


@pytest.mark.parametrize("case", [
    "no-params", "empty-params", "gone", "dotdot", "absolute", "not-a-string", "other-ids", "other-layers",
    "other-heads", "other-head-dim", "longer-than-prompt", "torn", "not-a-segment",
])
def test_an_unusable_handle_is_no_hit_never_an_error(cx, tmp_path, case):
    publish(tmp_path)  # the good one, under HANDLE
    req = request()
    if case == "no-params":
        req = request(handle=None)
    elif case == "empty-params":
        req.kv_transfer_params = {}
    elif case == "gone":
        req = request(handle="blendserve-never-written")
    elif case == "dotdot":
        req = request(handle="../" + tmp_path.name + "/" + HANDLE)
    elif case == "absolute":
        req = request(handle=str(tmp_path / HANDLE))
    elif case == "not-a-string":
        req = request(handle=5)
    elif case == "other-ids":
        publish(tmp_path, ids=PROMPT[1:41], name="seg-b")
        req = request(handle="seg-b")
    elif case.startswith("other-"):
        shape = {"other-layers": {"layers": L + 1}, "other-heads": {"heads": H * 2},
                 "other-head-dim": {"head_dim": D * 2}}[case]
        publish(tmp_path, name="seg-b", **shape)
        req = request(handle="seg-b")
    elif case == "longer-than-prompt":
        publish(tmp_path, ids=[*PROMPT, 7], name="seg-b")
        req = request(handle="seg-b")
    elif case == "torn":
        publish(tmp_path, name="seg-b")
        os.truncate(tmp_path / "seg-b", os.path.getsize(tmp_path / "seg-b") - 1)
        req = request(handle="seg-b")
    elif case == "not-a-segment":
        (tmp_path / "seg-b").write_bytes(b"\0" * 8192)
        req = request(handle="seg-b")
    conn = make_connector(cx, tmp_path)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert conn.get_num_new_matched_tokens(request(), 0) == (40, False)  # the good handle still works


def test_a_handle_naming_a_directory_is_no_hit(cx, tmp_path):
    (tmp_path / "a-dir").mkdir()
    conn = make_connector(cx, tmp_path)
    assert conn.get_num_new_matched_tokens(request(handle="a-dir"), 0) == (0, False)


def test_build_connector_meta_loads_the_tokens_before_the_computed_count(cx, tmp_path):
    publish(tmp_path)
    conn = make_connector(cx, tmp_path)
    req = request()
    n, _ = conn.get_num_new_matched_tokens(req, 16)
    conn.update_state_after_alloc(req, SimpleNamespace(), n)
    meta = conn.build_connector_meta(sched_output(new=[("req-1", [4, 1, 3], 16 + n), ("other", [0], 5)]))
    assert isinstance(meta, cx.BlendserveMetadata) and isinstance(meta, cx.KVConnectorMetadata)
    assert meta.loads == [cx.Load("req-1", HANDLE, (4, 1, 3), 16, 40)]
    again = conn.build_connector_meta(sched_output(new=[("req-1", [4, 1, 3], 40)]))
    assert again.loads == []  # pending cleared: loaded once


def test_no_external_tokens_means_no_load(cx, tmp_path):
    publish(tmp_path)
    conn = make_connector(cx, tmp_path)
    conn.update_state_after_alloc(request(), SimpleNamespace(), 0)
    assert conn.build_connector_meta(sched_output(new=[("req-1", [4, 1, 3], 40)])).loads == []


def test_a_resumed_request_loads_into_its_new_blocks(cx, tmp_path):
    publish(tmp_path)
    conn = make_connector(cx, tmp_path)
    conn.update_state_after_alloc(request(req_id="a"), SimpleNamespace(), 40)
    conn.update_state_after_alloc(request(req_id="b"), SimpleNamespace(), 8)
    meta = conn.build_connector_meta(sched_output(cached=[("running", [9], 3), ("a", [7, 6, 5], 40),
                                                          ("b", [2, 0, 1], 40)]))
    assert meta.loads == [cx.Load("a", HANDLE, (7, 6, 5), 0, 40), cx.Load("b", HANDLE, (2, 0, 1), 32, 40)]
    assert conn.build_connector_meta(sched_output(cached=[("a", [7, 6, 5], 40)])).loads == []


def test_request_finished_clears_pending(cx, tmp_path):
    publish(tmp_path)
    conn = make_connector(cx, tmp_path)
    req = request()
    conn.update_state_after_alloc(req, SimpleNamespace(), 40)
    assert conn.request_finished(req, [4, 1, 3]) == (False, None)
    assert conn.build_connector_meta(sched_output(new=[("req-1", [4, 1, 3], 40)])).loads == []
    assert (tmp_path / HANDLE).exists()  # the scheduler side never frees a segment


# ------------------------------------------------------------------ worker side
def run_step(conn, meta, layers=None) -> None:
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(SimpleNamespace(no_compile_layers=layers or {}))
    for i in range(L):
        conn.wait_for_layer_load(LAYER.format(i))
    conn.wait_for_save()
    conn.clear_connector_metadata()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_layer_gets_its_rows_at_their_slots(cx, tmp_path, dtype):
    ks, vs = publish(tmp_path)
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches(dtype=dtype)
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    blocks = (4, 1, 3)
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, blocks, 16, 40)]))
    for i in range(L):
        want = expected_cache(before[LAYER.format(i)], ks[i].to(dtype), vs[i].to(dtype), blocks, 16, 40)
        assert torch.equal(caches[LAYER.format(i)], want), f"layer {i}"
    assert conn.get_block_ids_with_load_errors() == set()
    assert not (tmp_path / HANDLE).exists()  # freed once loaded


def test_the_loaded_rows_are_the_ones_flash_attention_reads(cx, tmp_path):
    ks, vs = publish(tmp_path)
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches()
    conn.register_kv_caches(caches)
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, (4, 1, 3), 16, 40)]))
    key, value = caches[LAYER.format(1)].transpose(1, 2).split(D, dim=-1)  # [B, N, H, D]
    assert torch.equal(key[1, 0], ks[1][16]) and torch.equal(value[1, 0], vs[1][16])  # token 16: block 1, slot 0
    assert torch.equal(key[3, 7], ks[1][39]) and torch.equal(value[3, 7], vs[1][39])  # token 39: block 3, slot 7
    assert not torch.equal(key[4, 0], ks[1][0])  # token 0 was vLLM's prefix hit: not written


def test_free_after_load_false_keeps_the_segment(cx, tmp_path):
    publish(tmp_path)
    conn = make_connector(cx, tmp_path, role="WORKER", free_after_load=False)
    conn.register_kv_caches(std_caches())
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, (4, 1, 3), 0, 40)]))
    assert (tmp_path / HANDLE).exists()


def test_no_metadata_or_no_loads_changes_nothing(cx, tmp_path):
    publish(tmp_path)
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches()
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    run_step(conn, cx.BlendserveMetadata([]))
    conn.start_load_kv(SimpleNamespace(no_compile_layers={}))  # no metadata bound
    conn.wait_for_layer_load(LAYER.format(0))
    conn.wait_for_save()
    assert all(torch.equal(caches[name], before[name]) for name in caches)
    assert (tmp_path / HANDLE).exists()


@pytest.mark.parametrize("why", ["gone", "too-short", "other-shape"])
def test_a_segment_that_cannot_be_loaded_reports_exactly_its_blocks(cx, tmp_path, why):
    if why == "too-short":
        publish(tmp_path, ids=PROMPT[:30])
    elif why == "other-shape":
        publish(tmp_path, heads=H * 2)
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches()
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    # tokens 20..39 of blocks (4, 1, 3, 6): blocks 1 and 3 only
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, (4, 1, 3, 6), 20, 40)]))
    assert conn.get_block_ids_with_load_errors() == {1, 3}
    assert conn.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(caches[name], before[name]) for name in caches)


@pytest.mark.parametrize("start, end, blocks", [(20, 40, {1, 3}), (16, 32, {1}), (0, 17, {4, 1}), (47, 48, {3}),
                                               (0, 64, {4, 1, 3, 6})])
def test_the_failed_blocks_are_those_covering_start_to_end(cx, tmp_path, start, end, blocks):
    conn = make_connector(cx, tmp_path, role="WORKER")
    conn.register_kv_caches(std_caches())
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", "blendserve-gone", (4, 1, 3, 6), start, end)]))
    assert conn.get_block_ids_with_load_errors() == blocks


def test_one_failed_load_does_not_stop_the_others(cx, tmp_path):
    ks, vs = publish(tmp_path)
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches()
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    loads = [cx.Load("gone", "blendserve-gone", (0, 2), 0, 17), cx.Load("req-1", HANDLE, (4, 1, 3), 32, 40)]
    run_step(conn, cx.BlendserveMetadata(loads))
    assert conn.get_block_ids_with_load_errors() == {0, 2}
    for i in range(L):
        want = expected_cache(before[LAYER.format(i)], ks[i], vs[i], (4, 1, 3), 32, 40)
        assert torch.equal(caches[LAYER.format(i)], want)


def test_register_refuses_a_cache_it_cannot_write(cx, tmp_path):
    conn = make_connector(cx, tmp_path, role="WORKER")
    with pytest.raises(ValueError):
        conn.register_kv_caches({LAYER.format(0): torch.zeros(2, B, N, H, D)})


def test_the_cpu_backend_goes_through_vllms_own_write(cx, tmp_path, monkeypatch):
    ks, vs = publish(tmp_path)
    calls = []

    def op(key, value, key_cache, value_cache, slot, isa, *rest) -> None:
        # the real op copies at once; key/value may be views of the segment, unmapped after the step
        calls.append((key.clone(), value.clone(), key.is_contiguous() and value.is_contiguous(),
                      key_cache.data_ptr(), value_cache.data_ptr(), slot.clone(), isa, rest))

    monkeypatch.setattr(layouts, "vllm_cpu_write", lambda: op)
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches()
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    attn_layers = {LAYER.format(i): SimpleNamespace(isa="vec16") for i in range(L)}
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, (4, 1, 3), 16, 40)]), attn_layers)

    assert len(calls) == L
    for i, (key, value, contiguous, key_ptr, value_ptr, slot, isa, rest) in enumerate(calls):
        cache = caches[LAYER.format(i)]
        assert torch.equal(key, ks[i][16:40]) and torch.equal(value, vs[i][16:40]) and contiguous
        assert slot.tolist() == [slot_of((4, 1, 3), t) for t in range(16, 40)]
        assert isa == "vec16" and rest == (1.0, 1.0, "auto")
        assert key_ptr == cache.data_ptr()
        assert value_ptr == cache.data_ptr() + N * D * cache.element_size()
        assert torch.equal(cache, before[LAYER.format(i)])  # nothing written the CUDA way


def test_a_layer_without_isa_is_written_the_standard_way(cx, tmp_path, monkeypatch):
    ks, vs = publish(tmp_path)
    monkeypatch.setattr(layouts, "vllm_cpu_write", lambda: pytest.fail("the CPU op used for a standard layer"))
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches()
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    attn_layers = {LAYER.format(i): SimpleNamespace(impl="flash") for i in range(L)}
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, (4, 1, 3), 16, 40)]), attn_layers)
    for i in range(L):
        want = expected_cache(before[LAYER.format(i)], ks[i], vs[i], (4, 1, 3), 16, 40)
        assert torch.equal(caches[LAYER.format(i)], want)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_takes_its_heads(cx, tmp_path, tp, rank):
    tp.update(rank=rank, world=2)
    ks, vs = publish(tmp_path, heads=4)
    conn = make_connector(cx, tmp_path, role="WORKER", heads=4)
    caches = std_caches(heads=2)  # this rank's 2 of the model's 4
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, (4, 1, 3), 16, 40)]))
    lo = 2 * rank
    for i in range(L):
        want = expected_cache(before[LAYER.format(i)], ks[i][:, lo:lo + 2], vs[i][:, lo:lo + 2], (4, 1, 3), 16, 40)
        assert torch.equal(caches[LAYER.format(i)], want)


def test_ranks_beyond_the_heads_take_their_replicated_head(cx, tmp_path, tp):
    tp.update(rank=3, world=4)  # 2 kv heads over 4 ranks: ranks 2, 3 hold head 1
    ks, vs = publish(tmp_path)
    conn = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches(heads=1)
    before = {name: c.clone() for name, c in caches.items()}
    conn.register_kv_caches(caches)
    run_step(conn, cx.BlendserveMetadata([cx.Load("req-1", HANDLE, (4, 1, 3), 16, 40)]))
    for i in range(L):
        want = expected_cache(before[LAYER.format(i)], ks[i][:, 1:2], vs[i][:, 1:2], (4, 1, 3), 16, 40)
        assert torch.equal(caches[LAYER.format(i)], want)


def test_scheduler_to_worker_end_to_end(cx, tmp_path):
    ks, vs = publish(tmp_path)
    sched = make_connector(cx, tmp_path)
    worker = make_connector(cx, tmp_path, role="WORKER")
    caches = std_caches()
    before = {name: c.clone() for name, c in caches.items()}
    worker.register_kv_caches(caches)
    req = request()
    n, async_load = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(), n)
    meta = sched.build_connector_meta(sched_output(new=[("req-1", [5, 2, 7], n)]))
    run_step(worker, meta)
    assert (n, async_load) == (40, False)
    for i in range(L):
        assert torch.equal(caches[LAYER.format(i)], expected_cache(before[LAYER.format(i)], ks[i], vs[i],
                                                                  (5, 2, 7), 0, 40))
    assert not (tmp_path / HANDLE).exists()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # freed: a retry computes the prompt


# ------------------------------------------------------------------ segments in Redis (another host)
RHANDLE = "redis:" + HANDLE


def publish_to_redis(raw, folder, **kw):
    """The segment `publish` writes, its bytes SET under RHANDLE's key (the shm file removed)."""
    ks, vs = publish(folder, **kw)
    raw.set(f"blendserve:segment:{HANDLE}", (folder / HANDLE).read_bytes())
    os.unlink(folder / HANDLE)
    return ks, vs


def scheduler_to_worker(cx, folder, handle: str, **extra) -> tuple[int, dict[str, torch.Tensor]]:
    """One request through a scheduler and a worker connector: its hit count and the caches after."""
    sched = make_connector(cx, folder, **extra)
    worker = make_connector(cx, folder, role="WORKER", **extra)
    caches = std_caches()
    worker.register_kv_caches(caches)
    req = request(handle=handle)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(), n)
    run_step(worker, sched.build_connector_meta(sched_output(new=[("req-1", [5, 2, 7], n)])))
    assert worker.get_block_ids_with_load_errors() == set()
    return n, caches


@needs_redis
def test_a_redis_handle_loads_what_the_shm_handle_loads(cx, tmp_path, redis_server, raw):
    shm_dir, redis_dir = tmp_path / "shm", tmp_path / "empty"
    shm_dir.mkdir(), redis_dir.mkdir()
    ks, vs = publish(shm_dir)
    publish_to_redis(raw, redis_dir)  # the same bytes (same seed)
    n_shm, by_shm = scheduler_to_worker(cx, shm_dir, HANDLE)
    n_redis, by_redis = scheduler_to_worker(cx, redis_dir, RHANDLE, redis_url=redis_server.url)
    assert n_shm == n_redis == 40
    before = std_caches()
    for i in range(L):
        assert torch.equal(by_redis[LAYER.format(i)], by_shm[LAYER.format(i)])
        assert torch.equal(by_redis[LAYER.format(i)], expected_cache(before[LAYER.format(i)], ks[i], vs[i],
                                                                     (5, 2, 7), 0, 40))
    assert raw.keys("*") == []  # freed once loaded


@needs_redis
def test_free_after_load_false_keeps_the_redis_key(cx, tmp_path, redis_server, raw):
    publish_to_redis(raw, tmp_path)
    n, _ = scheduler_to_worker(cx, tmp_path, RHANDLE, redis_url=redis_server.url, free_after_load=False)
    assert n == 40 and raw.exists(f"blendserve:segment:{HANDLE}")


@needs_redis
def test_a_redis_segment_of_other_ids_is_no_hit(cx, tmp_path, redis_server, raw):
    publish_to_redis(raw, tmp_path, ids=PROMPT[1:])
    conn = make_connector(cx, tmp_path, redis_url=redis_server.url)
    assert conn.get_num_new_matched_tokens(request(handle=RHANDLE), 0) == (0, False)


@needs_redis
def test_a_gone_redis_key_is_no_hit_and_failed_blocks(cx, tmp_path, redis_server, raw):
    publish(tmp_path)  # a shm segment of the same name: never read for a Redis handle
    sched = make_connector(cx, tmp_path, redis_url=redis_server.url)
    assert sched.get_num_new_matched_tokens(request(handle=RHANDLE), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request(handle="redis:../x"), 0) == (0, False)
    worker = make_connector(cx, tmp_path, role="WORKER", redis_url=redis_server.url)
    caches = std_caches()
    worker.register_kv_caches(caches)
    run_step(worker, cx.BlendserveMetadata([cx.Load("req-1", RHANDLE, (4, 1, 3, 6), 20, 40)]))
    assert worker.get_block_ids_with_load_errors() == {1, 3}
    assert all(torch.equal(caches[name], c) for name, c in std_caches().items())
    assert (tmp_path / HANDLE).exists()


@needs_redis
def test_redis_gone_after_the_load_still_ends_the_step(cx, tmp_path, redis_server, raw):
    ks, vs = publish_to_redis(raw, tmp_path)
    worker = make_connector(cx, tmp_path, role="WORKER", redis_url=redis_server.url, redis_timeout_s=1.0)
    caches = std_caches()
    worker.register_kv_caches(caches)
    worker.bind_connector_metadata(cx.BlendserveMetadata([cx.Load("req-1", RHANDLE, (4, 1, 3), 16, 40)]))
    worker.start_load_kv(SimpleNamespace(no_compile_layers={}))
    redis_server.stop()  # the DEL after the step fails: logged, the key expires
    for i in range(L):
        worker.wait_for_layer_load(LAYER.format(i))
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    before = std_caches()
    for i in range(L):
        want = expected_cache(before[LAYER.format(i)], ks[i], vs[i], (4, 1, 3), 16, 40)
        assert torch.equal(caches[LAYER.format(i)], want)


def test_redis_down_is_no_hit_and_failed_blocks(cx, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    sched = make_connector(cx, tmp_path, redis_url=url, redis_timeout_s=1.0)
    assert sched.get_num_new_matched_tokens(request(handle=RHANDLE), 0) == (0, False)
    worker = make_connector(cx, tmp_path, role="WORKER", redis_url=url, redis_timeout_s=1.0)
    worker.register_kv_caches(std_caches())
    run_step(worker, cx.BlendserveMetadata([cx.Load("req-1", RHANDLE, (4, 1, 3), 0, 40)]))
    assert worker.get_block_ids_with_load_errors() == {4, 1, 3}


def test_a_redis_handle_without_redis_url_is_no_hit(cx, tmp_path):
    publish(tmp_path)
    conn = make_connector(cx, tmp_path)
    assert conn.get_num_new_matched_tokens(request(handle=RHANDLE), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(request(), 0) == (40, False)  # the shm handle still works
    worker = make_connector(cx, tmp_path, role="WORKER")
    worker.register_kv_caches(std_caches())
    run_step(worker, cx.BlendserveMetadata([cx.Load("req-1", RHANDLE, (4, 1, 3), 0, 40)]))
    assert worker.get_block_ids_with_load_errors() == {4, 1, 3}


def test_a_bad_redis_url_fails_at_start_up(cx, tmp_path):
    with pytest.raises(SegmentError, match="scheme"):
        make_connector(cx, tmp_path, redis_url="rediss://kv-host:6380")


# ------------------------------------------------------------------ head_range (pure; lives in the connector)
@pytest.mark.parametrize("total, local, rank, world, want", [
    (8, 8, 0, 1, (0, 8)),
    (8, 8, 3, 4, (0, 8)),  # a cache holding every head
    (8, 4, 0, 2, (0, 4)),
    (8, 4, 1, 2, (4, 8)),
    (8, 2, 3, 4, (6, 8)),
    (1, 1, 5, 8, (0, 1)),
])
def test_head_range_slices(cx, total, local, rank, world, want):
    assert cx.head_range(total, local, rank, world) == want


@pytest.mark.parametrize("total, world", [(2, 8), (4, 8), (2, 4), (4, 16)])
def test_head_range_replicates_as_vllm_does(cx, total, world):
    # vLLM's QKVParallelLinear: num_kv_head_replicas = world // total; a rank holds head rank // replicas
    for rank in range(world):
        h = rank // (world // total)
        assert cx.head_range(total, 1, rank, world) == (h, h + 1)


@pytest.mark.parametrize("total, local, world", [(4, 3, 2), (8, 2, 2), (8, 2, 8), (4, 1, 2)])
def test_head_range_refuses_an_impossible_split(cx, total, local, world):
    with pytest.raises(SegmentError, match="cannot place"):
        cx.head_range(total, local, 0, world)
