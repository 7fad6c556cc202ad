"""Device-correctness on CPU CI: the engine on a non-CPU model with KV from CPU-side stores.

The tiny Llama's weights live on torch's `meta` device: a real non-CPU device with shapes,
dtypes and no values, available on every build. (FakeTensorMode's fake `cuda` tensors were tried
first: the CPU-only build's Python bindings of indexing and `.contiguous()` refuse CUDA before
dispatch, inside transformers' own rotary embedding, so they cannot run a model.) On it:

- any op whose result needs tensor *values* on the host raises (`.item()`, `int(t)`, `.tolist()`,
  boolean indexing, `nonzero`, `torch.unique`): exactly the host syncs that stall a GPU pipeline;
- `DeviceChecker` (a dispatch mode) raises on any op mixing a CPU tensor with a device tensor,
  except explicit transfers (`.to`, `copy_`) and 0-dim scalars. This is stricter than CUDA.
- it also raises on every *blocking* upload: a `.to(device)` or `copy_` whose host source is not
  page-locked or that is not `non_blocking`, and a `torch.tensor(host data, device=...)` (which
  bypasses dispatch: a function mode catches it). On CUDA each of these synchronises the stream,
  so the host waits for every queued kernel. Pinning has no meaning without CUDA, so the
  executor's one pinning function (`executor.uploads.pinned`) is replaced by a stand-in that
  copies the tensor and remembers it; a source counts as pinned only if it came from there.
  Exempt: the layer packer (`transfer.LayerPacker`), whose copies run on the copy stream on CUDA
  and which takes a plain transfer path on any other device (tested in test_transfer.py).

So a prefill or decode step that completes here is device-correct and free of host syncs and
blocking uploads, except the one named sync per request (`executor.prefill._to_host`, after the
layer loop) and the one per decode step (`sampling._to_host`, the sampled tokens), which the tests
replace by counting stand-ins answering from shapes alone.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import blend_engine.executor.prefill as prefill_mod
import blend_engine.executor.uploads as uploads_mod
import blend_engine.sampling as sampling_mod
from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.attention import selected_block_mask
from blend_engine.executor.decode import decode_batch
from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.loop.engine_loop import EngineLoop
from blend_engine.model.runner import ModelRunner
from blend_engine.transfer import LayerPacker
from blend_engine.types import BlendPlan, GenerationConfig, SelectionPolicy
from tests.helpers import TINY_CONFIG, real_tokenizer

PASSAGES = (
    "Paris is the capital of France. It lies on the Seine and has about two million inhabitants.",
    "The Danube flows through ten countries, more than any other river in the world, into the Black Sea.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, a dormant volcano with three cones.",
)
QUESTION = "Which river flows through ten countries?"
CONFIG = dict(TINY_CONFIG, num_hidden_layers=6)  # the tests' tiny Llama, two layers deeper
FINGERPRINT = "fake-cuda-test"


@functools.lru_cache(maxsize=1)
def _tokenizer():
    return real_tokenizer()  # from the unpacked GGUF cache: no second model load


def _runner(model) -> ModelRunner:
    """A runner whose fingerprint is fixed: the fake model has no weight values to digest."""
    orig = ModelRunner._fingerprint
    ModelRunner._fingerprint = lambda self: FINGERPRINT
    try:
        return ModelRunner(model, _tokenizer(), "tiny")
    finally:
        ModelRunner._fingerprint = orig


_TRANSFERS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.lift_fresh.default,
              torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device}  # `.to` under inference_mode
_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten._unique2.default}


class DeviceMix(AssertionError):
    pass


class BlockingUpload(AssertionError):
    pass


_REAL_PINNED = uploads_mod.pinned
_pinned_storages: dict[int, torch.Tensor] = {}  # storage address -> the stand-in's pinned copy, kept alive
_exempt = threading.local()  # .depth > 0 while the layer packer runs on this thread


def _fake_pinned(host: torch.Tensor) -> torch.Tensor:
    """`executor.uploads.pinned` without CUDA: a copy that counts as page-locked from now on."""
    copy = host.clone()
    _pinned_storages[copy.untyped_storage().data_ptr()] = copy
    return copy


def _is_pinned(t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() in _pinned_storages


def _bound(func, args, kwargs) -> dict:
    """An aten op's arguments by name (defaults included)."""
    schema = func._schema.arguments
    named = {a.name: a.default_value for a in schema if a.has_default_value()}
    named.update(zip([a.name for a in schema], args))
    named.update(kwargs)
    return named


def _upload_of(func, args, kwargs) -> tuple[torch.Tensor, bool] | None:
    """(host source, non_blocking) when this transfer op copies host memory to a device, else None."""
    b = _bound(func, args, kwargs)
    if func is torch.ops.aten.copy_.default:
        src, dst = b["src"], b["self"].device
    elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device):
        src, dst = b["self"], b.get("device")
    else:
        return None
    if not isinstance(src, torch.Tensor) or src.device.type != "cpu" or dst is None or torch.device(dst).type == "cpu":
        return None
    return src, bool(b.get("non_blocking"))


class _NoHostTensorOnDevice(TorchFunctionMode):
    """`torch.tensor` / `as_tensor` / `asarray` of host data straight onto a device: a blocking,
    pageable upload that never reaches the dispatcher."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and not getattr(_exempt, "depth", 0):
            device = kwargs.get("device")
            data = args[0] if args else kwargs.get("data")
            on_host = not isinstance(data, torch.Tensor) or data.device.type == "cpu"
            if device is not None and torch.device(device).type != "cpu" and on_host:
                raise BlockingUpload(f"{func.__name__}(host data, device={device}): a blocking upload")
        return func(*args, **kwargs)


class DeviceChecker(TorchDispatchMode):
    """Raises on an op that mixes CPU and device tensors (other than transfers), reads values, or
    uploads host memory blocking (pageable, or without non_blocking).
    `uploads`: (dtype, shape) of every host-to-device transfer, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._functions = _NoHostTensorOnDevice()

    def __enter__(self):
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCS and any(t.device.type != "cpu" for t in tree_leaves(args) if isinstance(t, torch.Tensor)):
            raise DeviceMix(f"host sync: {func}")  # reading a host tensor's values is free
        upload = _upload_of(func, args, kwargs) if func in _TRANSFERS else None
        if upload is not None:
            if not (_is_pinned(upload[0]) and upload[1]) and not getattr(_exempt, "depth", 0):
                raise BlockingUpload(f"{func} from {'pinned' if _is_pinned(upload[0]) else 'pageable'} host memory, "
                                     f"non_blocking={upload[1]}: the host waits for the device")
            self.uploads.append((upload[0].dtype, tuple(upload[0].shape)))
        if func not in _TRANSFERS:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            devices = {t.device.type for t in tensors if t.dim() > 0}
            if "cpu" in devices and len(devices) > 1:
                raise DeviceMix(f"{func} mixes devices {sorted(devices)}")
        return func(*args, **kwargs)


def _model(family: str):
    """A tiny Llama, or a Mistral whose sliding window (32) is shorter than the prompt."""
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**CONFIG, sliding_window=32))
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _device_runner(family: str) -> ModelRunner:
    with torch.device("meta"):
        model = _model(family)
    return _runner(model.requires_grad_(False))


@functools.lru_cache(maxsize=4)
def _real_kv(family: str, fmt: str = "fp16") -> dict:
    """Real KV of the system prefix and the passages, computed by a real CPU model of the same shape: {key: ChunkKV}."""
    torch.manual_seed(0)
    eng = BlendEngine(_runner(_model(family)), MemoryStore(1 << 26, kv_format=fmt), EngineConfig(kv_format=fmt))
    segments = eng.layout(BlendPlan(PASSAGES, QUESTION)).segments[:-1]  # the system prefix and the passages
    return {eng.key_of(s.token_ids): eng.precompute(s.token_ids) for s in segments}


def _store(tier: str, tmp_path, family: str, fmt: str = "fp16"):
    store = MemoryStore(1 << 26, kv_format=fmt) if tier == "memory" else DiskStore(tmp_path, kv_format=fmt)
    for key, kv in _real_kv(family, fmt).items():
        assert store.put(key, kv)
    return store


@pytest.fixture(autouse=True)
def fake_pinning(monkeypatch):
    """Pinning stands in for CUDA's (`_fake_pinned`); the layer packer is exempt from the upload check."""
    monkeypatch.setattr(uploads_mod, "pinned", _fake_pinned)
    pack = LayerPacker.__call__

    def exempt(self, layer_kv):
        _exempt.depth = getattr(_exempt, "depth", 0) + 1
        try:
            return pack(self, layer_kv)
        finally:
            _exempt.depth -= 1

    monkeypatch.setattr(LayerPacker, "__call__", exempt)
    yield
    _pinned_storages.clear()


@pytest.fixture
def host_sync_counter(monkeypatch):
    """Replace the engine's one named device->host sync by a counter answering from shapes only."""
    class Counter(list):
        n_tokens = 0  # the prompt length: the stand-in's positions end at its last position

    calls = Counter()

    def to_host(t: torch.Tensor) -> list[int]:
        calls.append(t.numel())
        return list(range(calls.n_tokens - t.numel(), calls.n_tokens))

    monkeypatch.setattr(prefill_mod, "_to_host", to_host)
    return calls


POLICIES = {"default": SelectionPolicy(), "single": plain_policy(check_layer=1, metric="kv"),
            "sinks": plain_policy(check_layer=2, metric="v", sink_tokens=2, schedule=((3, 1.0),))}


@pytest.mark.parametrize("family,tier,depth", [("llama", "memory", 0), ("llama", "disk", 2), ("mistral", "disk", 2)])
def test_every_mode_runs_on_a_device_model_with_cpu_side_kv(family, tier, depth, tmp_path, host_sync_counter):
    store = _store(tier, tmp_path, family)
    runner = _device_runner(family)
    assert runner.device.type == "meta"
    assert runner.windows[0] == (32 if family == "mistral" else None)  # mistral: window masks on the device
    engine = BlendEngine(runner, store, EngineConfig(kv_format="fp16"), loader=LayerLoader(store, depth))
    for mode, policy, ratio in [("full_prefill", None, None), ("full_reuse", None, None),
                                ("blend", "default", 0.15), ("blend", "single", 0.3),
                                ("blend", "sinks", 0.2), ("blend", "default", 1.0)]:
        host_sync_counter.clear()
        plan = BlendPlan(PASSAGES, QUESTION, mode=mode, recompute_ratio=ratio, policy=POLICIES.get(policy or ""))
        host_sync_counter.n_tokens = engine.layout(plan).n_tokens
        with DeviceChecker():
            state = engine.prefill(plan, max_new_tokens=2)
            logits = engine.decode_step(state.cache, 5)
        assert state.logits.device == runner.device and state.logits.shape == (CONFIG["vocab_size"],)
        assert state.cache.k[0].device == runner.device and logits.device == runner.device
        if mode != "full_prefill":
            assert state.report.cache_hits == len(PASSAGES) + 1 and state.report.cache_misses == 0
        assert len(host_sync_counter) <= 1, f"{mode}: more than one device->host sync per request"


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_batched_decode_step_runs_on_the_device_without_host_syncs(family, host_sync_counter):
    """Three requests of other prompt lengths in one decode step (ragged attention, window masks on
    mistral), then a lone one: device tensors only, token ids and positions uploaded, no value read."""
    runner = _device_runner(family)
    engine = BlendEngine(runner, MemoryStore(1 << 20), EngineConfig(kv_format="fp16"))
    caches = []
    for passages in (PASSAGES, PASSAGES[:1], PASSAGES[1:]):
        plan = BlendPlan(passages, QUESTION, mode="full_prefill")
        host_sync_counter.n_tokens = engine.layout(plan).n_tokens
        caches.append(engine.prefill(plan, max_new_tokens=3).cache)
    lengths = [c.length for c in caches]
    assert len(set(lengths)) == 3
    with DeviceChecker() as checker:
        logits = decode_batch(runner, caches, [5, 6, 7], lengths)
        one = engine.decode_step(caches[0], 8)
    assert logits.shape == (3, CONFIG["vocab_size"]) and logits.device == runner.device and one.device == runner.device
    assert [c.length for c in caches] == [lengths[0] + 2, lengths[1] + 1, lengths[2] + 1]
    assert {shape for _, shape in checker.uploads} <= {(3,), (1,)}  # ids and positions only, nothing per layer
    assert host_sync_counter == []  # the decode step reads nothing back (the prefills' positions stand in above)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("path", ["pooled", "padded_static"])
def test_the_pooled_decode_step_has_no_host_sync_and_uploads_once(family, path, host_sync_counter):
    """Capturable (#35 item 6): three ragged runs of one paged pool decode one pooled step (keys
    gathered; on mistral window masks too), eagerly or at the padded shapes a CUDA graph replays
    (`decode_graphs`, run eagerly here): device tensors only, no value read back, and the step's
    inputs cross in one upload each (ids, positions, run starts, key counts; one [4, B] when padded)."""
    from blend_engine.executor.decode_graphs import DecodeGraphs
    from blend_engine.executor.kv_pool import KVPool
    from blend_engine.scheduler.kv_blocks import Run

    runner = _device_runner(family)
    pool = KVPool(runner, n_blocks=16, block_tokens=16)
    lengths = [37, 5, 70]
    caches = [pool.view(run, n) for run, n in zip([Run(0, 3), Run(3, 1), Run(6, 5)], lengths)]
    graphs = DecodeGraphs(runner, pool, capture=False, kernel="gather") if path == "padded_static" else None
    with DeviceChecker() as checker:
        logits = decode_batch(runner, caches, [5, 6, 7], lengths, "pooled", graphs, kernel="gather")  # [B, V]
    assert logits.shape == (3, CONFIG["vocab_size"]) and logits.device == runner.device
    assert [c.length for c in caches] == [n + 1 for n in lengths]
    want = {(4, 4)} if graphs is not None else {(3,)}
    assert {shape for _, shape in checker.uploads} == want
    assert host_sync_counter == []


@pytest.fixture
def token_reads(monkeypatch):
    """Replace the decode step's one device->host read (`sampling._to_host`) by a counter answering
    zeros of the same shape (every argmax is token 0, every row uniform)."""
    calls: list[tuple[int, ...]] = []

    def to_host(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return torch.zeros(t.shape, dtype=t.dtype)

    monkeypatch.setattr(sampling_mod, "_to_host", to_host)
    return calls


def test_the_engine_loop_prefills_and_decodes_on_the_device_with_one_read_per_step(
        tmp_path, host_sync_counter, token_reads, monkeypatch):
    """Three requests through the engine loop itself (admission, prefill layers, first token, batched
    decode steps with greedy, sampled and logprob rows), every step of the loop under the checker:
    no blocking upload anywhere, and the tokens reach the host in one read per step, not one per row."""
    failures: list[BaseException] = []
    step = EngineLoop._step

    def checked_step(self):
        with DeviceChecker():
            try:
                step(self)
            except BaseException as exc:
                failures.append(exc)
                raise

    monkeypatch.setattr(EngineLoop, "_step", checked_step)

    def consume(handle) -> None:
        try:
            list(handle.deltas())
        except BaseException as exc:  # a request dropped by the checker fails its caller
            failures.append(exc)

    runner = _device_runner("llama")
    engine = BlendEngine(runner, _store("memory", tmp_path, "llama"), EngineConfig(kv_format="fp16"))
    plan = BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=0.15)
    host_sync_counter.n_tokens = engine.layout(plan).n_tokens
    gens = [GenerationConfig(max_tokens=4, ignore_eos=True), GenerationConfig(max_tokens=4, ignore_eos=True, logprobs=2),
            GenerationConfig(max_tokens=4, ignore_eos=True, temperature=0.8, seed=1)]
    try:
        handles = [engine.generate(plan, g) for g in gens]
        threads = [threading.Thread(target=consume, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        assert [len(h.result.token_ids) for h in handles] == [4, 4, 4]
        assert len(handles[1].result.logprobs) == 4
        steps = engine.loop.steps
    finally:
        engine.close()
    assert len(token_reads) == steps + len(handles)  # one read per decode step, plus each first token
    assert engine.loop.max_batch_seen > 1  # batched steps read once for every row
    V = CONFIG["vocab_size"]
    assert all(1 <= n % V <= 3 and n // V <= 2 for (n,) in token_reads)  # B argmaxes + the logprob and sampled rows


@pytest.fixture
def reader_uploads(monkeypatch):
    """Uploads made by the packer on the prefetch thread (dispatch modes are per thread), checked there too."""
    seen: list[tuple[torch.dtype, tuple[int, ...]]] = []
    pack = LayerPacker.__call__

    def checked(self, layer_kv):
        if threading.current_thread() is threading.main_thread():
            return pack(self, layer_kv)  # under the test's own checker
        with DeviceChecker() as checker:
            out = pack(self, layer_kv)
        seen.extend(checker.uploads)
        return out

    monkeypatch.setattr(LayerPacker, "__call__", checked)
    return seen


@pytest.mark.parametrize("tier,depth", [("memory", 0), ("disk", 2)])
def test_int8_kv_crosses_to_the_device_as_int8(tier, depth, tmp_path, host_sync_counter, reader_uploads):
    """int8 chunks move as int8 plus small fp16 scales (half of fp16's bytes) and are dequantized
    on the device: every host-to-device copy of a cached layer's [H, Tc, D] block is int8."""
    store = _store(tier, tmp_path, "llama", "int8")
    runner = _device_runner("llama")
    engine = BlendEngine(runner, store, EngineConfig(kv_format="int8"), loader=LayerLoader(store, depth))
    H, D, L = CONFIG["num_key_value_heads"], runner.shape.head_dim, CONFIG["num_hidden_layers"]
    for mode, ratio in [("full_reuse", None), ("blend", 0.15)]:
        plan = BlendPlan(PASSAGES, QUESTION, mode=mode, recompute_ratio=ratio)
        layout = engine.layout(plan)
        host_sync_counter.n_tokens = layout.n_tokens
        Tc = sum(s.end - s.offset for s in layout.segments[:-1])  # every segment but the question is cached
        reader_uploads.clear()
        checker = DeviceChecker()
        with checker:
            state = engine.prefill(plan, max_new_tokens=2)
        assert state.report.cache_hits == len(PASSAGES) + 1
        uploads = checker.uploads + reader_uploads
        blocks = [dt for dt, shape in uploads if shape == (H, Tc, D)]
        loaded = L if mode == "full_reuse" else L - engine.config.policy.check_layer  # blend: not what it recomputes whole
        assert blocks == [torch.int8] * (2 * loaded), f"{mode}: cached layers uploaded as {blocks}"
        big = [(dt, shape) for dt, shape in uploads if dt != torch.int8 and math.prod(shape) >= H * Tc]
        assert big == [(torch.float16, (H, Tc))] * loaded, f"{mode}: only V's per-token scales besides int8: {big}"


@pytest.mark.parametrize("window", [None, 32])
def test_flex_block_masks_are_built_on_the_device_without_host_syncs(window):
    """`selected_attention="flex"` builds its block mask from device positions inside the layer loop:
    no host read (FlexAttention itself refuses `meta`, so the engine-level check is on the CPU)."""
    pos = torch.arange(0, 300, 7, device="meta")  # [S]
    with DeviceChecker():
        mask = selected_block_mask(pos, 301, window)
    assert mask.kv_num_blocks.device.type == "meta" and mask.shape[-2:] == (pos.shape[0], 301)


def test_the_checker_catches_syncs_and_device_mixes():
    """The mechanism itself: each of these fails on a device tensor."""
    t = torch.zeros(4, device="meta")
    with DeviceChecker():
        for bad in (lambda: int(t[0]), lambda: t[t > 0], lambda: t.tolist(), lambda: torch.unique(t),
                    lambda: t + torch.zeros(4), lambda: torch.cat([t, torch.zeros(4)])):
            with pytest.raises((DeviceMix, RuntimeError, NotImplementedError)):
                bad()
        assert (t + torch.tensor(1.0)).device == t.device  # 0-dim scalars are fine, as on CUDA


def test_the_checker_refuses_blocking_uploads_and_passes_pinned_non_blocking_ones():
    """Every way of moving host memory to the device that makes CUDA wait: pageable, or blocking."""
    t = torch.zeros(4, device="meta")
    host = torch.arange(4.0)
    with DeviceChecker() as checker:
        for bad in (lambda: host.to(t.device), lambda: host.to(t.device, non_blocking=True),
                    lambda: _fake_pinned(host).to(t.device), lambda: t.copy_(host),
                    lambda: t.copy_(_fake_pinned(host)), lambda: t.__setitem__(slice(None), host),
                    lambda: torch.tensor([1.0, 2.0], device=t.device),
                    lambda: torch.as_tensor(host, device=t.device)):
            with pytest.raises(BlockingUpload):
                bad()
        assert checker.uploads == []
        assert _fake_pinned(host).to(t.device, non_blocking=True).device == t.device
        assert t.copy_(_fake_pinned(host), non_blocking=True).device == t.device
        assert uploads_mod.upload(host, t.device).device == t.device  # the executor's way
        assert checker.uploads == [(torch.float32, (4,))] * 3


@contextlib.contextmanager
def _cuda_syncs_refused():
    """CUDA's own check: a value read or a blocking copy raises (it does not see event waits or
    pageable non-blocking copies: the fake device's checker covers the latter)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real stream's check needs a CUDA device")
@pytest.mark.parametrize("tier,depth", [("memory", 0), ("disk", 2)])
def test_on_cuda_nothing_waits_for_the_device_in_the_prefill_or_the_decode_step(tier, depth, tmp_path, monkeypatch):
    """The fake device's property on a real one: from the request's setup through its last layer, and
    in a decode step, nothing synchronises (the prefill's one named read in `complete_run` and the
    step's token read stay outside). Real pinning here, not the stand-in."""
    monkeypatch.setattr(uploads_mod, "pinned", _REAL_PINNED)
    store = _store(tier, tmp_path, "llama")
    torch.manual_seed(0)
    runner = _runner(_model("llama").requires_grad_(False).to("cuda"))
    engine = BlendEngine(runner, store, EngineConfig(kv_format="fp16"), loader=LayerLoader(store, depth))
    plan = BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=0.15)
    with torch.inference_mode():
        prep = engine.prepare(plan, 2)
        with _cuda_syncs_refused():
            run = engine.start_run(plan, prep, 2)
            for _ in run.steps():
                pass
        state = engine.complete_run(plan, prep, run)
        with _cuda_syncs_refused():
            logits = decode_batch(runner, [state.cache], [5], [state.cache.length])  # [1, V]
    assert state.report.cache_hits == len(PASSAGES) + 1 and logits.shape == (1, CONFIG["vocab_size"])
