"""`BlendserveConnector`: a vLLM v1 KV connector that loads Blendserve's blended KV of a prompt.

Loaded by a stock vLLM server (tested: vLLM 0.32.0, CPU and, by shape, the CUDA backends):

    --kv-transfer-config '{"kv_connector": "BlendserveConnector",
                           "kv_connector_module_path": "blendserve_vllm.connector",
                           "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"segment_dir": "/dev/shm"}}'

A request names its segment in `kv_transfer_params: {"blendserve_kv": "<handle>"}` (Blendserve's
`/v1/completions` call does):

- `<name>`: a shared-memory segment file `<segment_dir>/<name>` (Blendserve on this host);
- `redis:<name>`: the same bytes under the Redis key `blendserve:segment:<name>` (Blendserve on
  another host, `redis_handover`), in the server of the extra config's `redis_url`
  (`redis://[[user]:password@]host[:port][/db]`; `redis_timeout_s`, default 5, bounds connecting
  and each socket read or write). Without `redis_url` such a handle is 0 hits.

    "kv_connector_extra_config": {"segment_dir": "/dev/shm", "redis_url": "redis://:pw@kv-host:6379/0"}

Per request:

    | prompt tokens 0 .. T-2: from the segment (minus vLLM's own prefix hit) | last token: vLLM |

- scheduler side (the header alone: a file read, or GETRANGE + STRLEN): a handle whose segment
  exists, has the model's shape and whose token hash matches the prompt's first T ids is an
  external hit of T-1 tokens less what vLLM's prefix cache already holds; anything else (Redis
  unreachable included) is 0 hits (logged), never an error.
- worker side: a step's segments are opened at its start (a file mapped, or a Redis value read with
  one GET into a host buffer); at each attention layer (`wait_for_layer_load`) that layer's rows are
  copied from the segment into the request's blocks (`layouts`); after the step the segment is freed
  (the file handed back to its writer for reuse, `segments.release`, the key DEL'd; `free_after_load`,
  default true). A segment gone between
  scheduling and loading, or Redis unreachable, reports its blocks as failed, and vLLM recomputes
  them (`kv_load_failure_policy: recompute`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from blendserve_vllm import layouts, redis_handover
from blendserve_vllm.redis_handover import RedisClient, RedisError, is_redis_handle, redis_name
from blendserve_vllm.segments import DEFAULT_DIR, Segment, SegmentError, SegmentMeta, check_name, release, token_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
PARAM = "blendserve_kv"  # the key in a request's kv_transfer_params


@dataclass(frozen=True)
class ModelShape:
    """What a segment must match: the model's layers, kv heads and head size (all ranks together)."""

    n_layers: int
    kv_heads: int
    head_dim: int

    def fits(self, meta: SegmentMeta) -> bool:
        return (meta.n_layers, meta.kv_heads, meta.head_dim) == (self.n_layers, self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class Load:
    """One request's rows start .. end-1 to copy from segment `handle` into its blocks."""

    req_id: str
    handle: str
    block_ids: tuple[int, ...]
    start: int
    end: int


@dataclass
class BlendserveMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


def hit_tokens(meta: SegmentMeta, prompt_len: int) -> int:
    """Tokens a segment supplies to a prompt: all it holds, but never the prompt's last token (vLLM
    computes that one to get the first output's logits)."""
    return min(meta.n_tokens, prompt_len - 1)


def head_range(total: int, local: int, rank: int, world: int) -> tuple[int, int]:
    """The kv heads [lo, hi) tensor-parallel rank `rank` of `world` holds (`local` of `total`): a
    slice of its own, or one replicated head when the ranks outnumber the heads."""
    if local == total:
        return 0, total
    if local * world == total:
        return rank * local, (rank + 1) * local
    if local == 1 and world > total:
        h = rank * total // world
        return h, h + 1
    raise SegmentError(f"cannot place {total} kv heads over {world} ranks holding {local} each")


class BlendserveConnector(KVConnectorBase_V1):
    """See the module docstring. Per-request state lives in the step's metadata and in `_pending`
    (requests between allocation and their first step), never beyond a request's end."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._dir = str(extra.get("segment_dir", DEFAULT_DIR))
        self._free_after_load = bool(extra.get("free_after_load", True))
        url = extra.get("redis_url")
        self._redis = RedisClient(str(url), float(extra.get("redis_timeout_s", 5.0))) if url else None
        self._block_size = vllm_config.cache_config.block_size
        mc = vllm_config.model_config
        self._shape = ModelShape(mc.get_total_num_hidden_layers(), mc.get_total_num_kv_heads(), mc.get_head_size())
        self._pending: dict[str, tuple[str, int]] = {}  # scheduler: req id -> (handle, external tokens)
        self._caches: dict[str, torch.Tensor] = {}  # worker: layer name -> [B, H, N, C]
        self._step: list[tuple[Segment, torch.Tensor, Load]] = []  # worker: this step's open loads
        self._layers: dict[str, Any] = {}  # worker: this step's attention layers (the CPU backend's `isa`)
        self._failed_blocks: set[int] = set()
        self._cpu_write: layouts.CpuWrite | None = None
        logger.info("Blendserve connector (%s): segments in %s and %s, model %s", role.name, self._dir,
                    self._redis.address if self._redis else "no Redis", self._shape)

    # ================================================================== segments, wherever they are
    def _redis_client(self) -> RedisClient:
        if self._redis is None:
            raise SegmentError("a Redis handle, but this connector has no redis_url")
        return self._redis

    def _read_meta(self, handle: object) -> SegmentMeta:
        if is_redis_handle(handle):
            return redis_handover.read_meta(self._redis_client(), redis_name(handle))
        return Segment.read_meta(self._dir, handle)

    def _open(self, handle: str) -> Segment:
        if is_redis_handle(handle):
            return redis_handover.open_segment(self._redis_client(), redis_name(handle))
        return Segment.open(self._dir, handle)

    def _free(self, handles: list[str]) -> None:
        """Free loaded segments: hand the files back to their writer (`release`), DEL the Redis keys
        (one command; failures logged)."""
        names = [redis_name(h) for h in handles if is_redis_handle(h)]
        for handle in handles:
            if not is_redis_handle(handle):
                release(self._dir, check_name(handle))
        if names:
            try:
                redis_handover.free(self._redis_client(), names)
            except SegmentError as exc:
                logger.warning("could not free %d Blendserve segments in Redis (%s); they expire there",
                               len(names), exc)

    # ================================================================== scheduler side
    def _segment_for(self, request: Request) -> tuple[str, SegmentMeta] | None:
        """The request's usable segment, or None (no handle, or one that cannot be used: logged)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        handle = params.get(PARAM)
        if handle is None:
            return None
        try:
            meta = self._read_meta(handle)
        except SegmentError as exc:
            level = logging.WARNING if isinstance(exc, RedisError) else logging.INFO
            logger.log(level, "request %s: no Blendserve KV (%s); vLLM computes the prompt", request.request_id, exc)
            return None
        ids = list(request.prompt_token_ids or [])
        if not self._shape.fits(meta):
            logger.warning("request %s: segment %s is of another model (%s layers, %s kv heads, head dim %s)",
                           request.request_id, handle, meta.n_layers, meta.kv_heads, meta.head_dim)
            return None
        if meta.n_tokens > len(ids) or token_hash(ids[:meta.n_tokens]) != meta.token_hash:
            logger.warning("request %s: segment %s belongs to other token ids", request.request_id, handle)
            return None
        return handle, meta

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        found = self._segment_for(request)
        if found is None:
            return 0, False
        return max(0, hit_tokens(found[1], len(request.prompt_token_ids or [])) - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            handle = request.kv_transfer_params[PARAM]
            self._pending[request.request_id] = (handle, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads: each newly scheduled request with external tokens, its rows being
        the `n` tokens before its computed count."""
        scheduled = [(new.req_id, new.block_ids, new.num_computed_tokens)
                     for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs  # resumed after a preemption with external tokens again
        scheduled += [(req_id, cached.new_block_ids[i], cached.num_computed_tokens[i])
                      for i, req_id in enumerate(cached.req_ids) if cached.new_block_ids[i] is not None]
        meta = BlendserveMetadata()
        for req_id, block_ids, computed in scheduled:
            pending = self._pending.pop(req_id, None)
            if pending is not None:
                handle, n = pending
                meta.loads.append(Load(req_id, handle, tuple(block_ids[0]), computed - n, computed))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for cache in kv_caches.values():
            layouts.CacheShape.of(cache)  # fails loudly on a cache it cannot write
        self._caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Open this step's segments (a gone or torn one: its blocks are reported failed)."""
        meta = self._connector_metadata
        if not isinstance(meta, BlendserveMetadata) or not meta.loads:
            return
        self._layers = getattr(forward_context, "no_compile_layers", {}) or {}
        for load in meta.loads:
            try:
                seg = self._open(load.handle)
                if not self._shape.fits(seg.meta) or seg.meta.n_tokens < load.end:
                    seg.close()
                    raise SegmentError(f"segment {load.handle} changed shape")
            except SegmentError as exc:
                logger.warning("request %s: cannot load Blendserve KV (%s); vLLM recomputes it", load.req_id, exc)
                self._failed_blocks.update(self._blocks_of(load))
                continue
            self._step.append((seg, layouts.slots(load.block_ids, self._block_size, load.start, load.end), load))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Copy this layer's rows of every load of the step into vLLM's cache, before its attention."""
        if not self._step or layer_name not in self._caches:
            return
        cache = self._caches[layer_name]  # [B, H, N, C]
        layer = extract_layer_index(layer_name)
        lo, hi = self._heads(cache)
        for seg, slot, load in self._step:
            k = seg.k(layer)[load.start:load.end, lo:hi]  # [T, H, D]
            v = seg.v(layer)[load.start:load.end, lo:hi]  # [T, H, D]
            self._write(layer_name, cache, k, v, slot)

    def _write(self, layer_name: str, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot: torch.Tensor) -> None:
        isa = getattr(self._layers.get(layer_name), "isa", None)
        if cache.device.type == "cpu" and isa is not None:  # vLLM's CPU backend
            if self._cpu_write is None:
                self._cpu_write = layouts.vllm_cpu_write()
            layouts.write_cpu(cache, k, v, slot, isa, self._cpu_write)
        else:
            dev = cache.device
            layouts.write_standard(cache, k.to(dev), v.to(dev), slot.to(dev))

    def _heads(self, cache: torch.Tensor) -> tuple[int, int]:
        local = cache.shape[1]
        if local == self._shape.kv_heads:
            return 0, local
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        return head_range(self._shape.kv_heads, local, get_tensor_model_parallel_rank(),
                          get_tensor_model_parallel_world_size())

    def _blocks_of(self, load: Load) -> set[int]:
        first, last = load.start // self._block_size, (load.end - 1) // self._block_size
        return set(load.block_ids[first:last + 1])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a consumer: nothing is saved

    def wait_for_save(self) -> None:
        """After the step's forward: every load is in the cache; close (and free) its segments."""
        step, self._step = self._step, []
        for seg, _, _ in step:
            seg.close()
        if self._free_after_load and step:
            self._free([load.handle for _, _, load in step])

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
