"""The decode step: one new token for each of B running sequences, whatever their KV lengths.

    seq b:  | sys | chunk_1 .. chunk_k | question | answer so far | new token at input_pos[b] |

The projections, norms and MLP run batched over the B rows ([B, E]: each row its own token at
its own position, so rows never mix). Attention is ragged, two ways with the same result:

- `per_sequence`: row b attends to its own cache `caches[b]` over keys 0..input_pos[b], one SDPA
  call per sequence on a view of that cache (no padding, no copy: O(sum of lengths) work, but
  B calls per layer). The oracle, and the only way for caches that are not runs of one pool.
- `pooled`: every cache is a run of the same paged pool (`kv_pool.KVPool`): per layer ONE write of
  the B new K/V rows into the pool and ONE attention call for all rows. A row's Hq/H query heads
  of one KV head ride as that head's query rows ([B, H, G, D]), so grouped K/V are never
  expanded. The call (`pooled_kernel`) reads the pool in place (Triton on CUDA, `cpu_kernels`'s
  C++ kernel on the CPU), or else gathers the keys into [B, H, Lmax, D] for one SDPA call
  (padding masked: O(B x Lmax) work and a copy).

`decode_attention("auto", ...)` picks pooled wherever a kernel reads the pool in place (CUDA, or a
float32 pool on a CPU where `cpu_kernels` builds), else per_sequence: on the CPU the gather costs
more than B calls (measured, docs/results.md).
A lone sequence is the same step with B = 1. On CUDA a pooled step may instead be replayed as a
CUDA graph at padded shapes (`decode_graphs.DecodeGraphs`): the same `forward` and `Pooled`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from blend_engine.model import cpu_kernels
from blend_engine.model.runner import ModelRunner

from . import paged_decode
from .layers import KVCache, layer_pass
from .uploads import upload_ints

DECODE_ATTENTION = ("auto", "pooled", "per_sequence")
POOLED_KERNELS = ("gather", "triton", "cpu")


def check_decode_attention(name: str) -> None:
    if name not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, not {name!r}")


def decode_attention(name: str, device: torch.device, caches: Sequence[KVCache]) -> str:
    """The way this step attends: `name` as asked ("auto": pooled on a device, and on the CPU where
    `pooled_kernel` reads the pool in place, else per_sequence); per_sequence whenever the caches
    are not all runs of one pool."""
    check_decode_attention(name)
    pool = caches[0].pool if caches else None
    if pool is None or any(c.pool is not pool for c in caches):
        return "per_sequence"
    if name == "auto":
        on_cpu = device.type == "cpu"
        return "per_sequence" if on_cpu and pooled_kernel(device, pool[0][0].dtype) == "gather" else "pooled"
    return name


@torch.inference_mode()
def decode_batch(runner: ModelRunner, caches: Sequence[KVCache], token_ids: Sequence[int],
                 input_pos: Sequence[int], attention: str = "auto", graphs: DecodeGraphsLike | None = None,
                 kernel: str | None = None) -> torch.Tensor:
    """Write token b at position input_pos[b] of caches[b] (every layer's K/V), return the logits
    of the next token for every sequence: [B, V]. Each cache's length becomes input_pos[b] + 1.
    `attention`: see `decode_attention`; a pooled step that `graphs` can replay runs as its graph,
    else eagerly with `kernel` (None: `pooled_kernel`'s choice)."""
    r = runner
    check_rows(caches, token_ids, input_pos)
    pooled = decode_attention(attention, r.device, caches) == "pooled"
    if pooled and graphs is not None and graphs.fits(caches):
        logits = graphs.step(caches, token_ids, input_pos)  # [B, V]
    else:
        logits = through_layers(r, eager_rows(r, caches, token_ids, input_pos, attention, kernel))  # [B, V]
    written(caches, input_pos)
    return logits


def check_rows(caches: Sequence[KVCache], token_ids: Sequence[int], input_pos: Sequence[int]) -> None:
    if len(caches) != len(token_ids) or len(caches) != len(input_pos):
        raise ValueError("decode_batch needs one token and one position per cache")
    for cache, p in zip(caches, input_pos):
        if p >= cache.capacity:
            raise ValueError("KV cache capacity exhausted")


def written(caches: Sequence[KVCache], input_pos: Sequence[int]) -> None:
    """The step wrote position input_pos[b] of caches[b]: their lengths."""
    for cache, p in zip(caches, input_pos):
        cache.length = p + 1


def eager_rows(r: ModelRunner, caches: Sequence[KVCache], token_ids: Sequence[int], input_pos: Sequence[int],
               attention: str = "auto", kernel: str | None = None) -> DecodeRows:
    """The step's rows, run eagerly: alone (`decode_batch`) or beside prefill rows in one layer
    pass (the engine loop's fused step). The step's uploads are pinned and non-blocking."""
    rows = row_inputs(caches, token_ids, input_pos)
    ids = upload_ints(rows[0], r.device)  # [B]
    pos = upload_ints(rows[1], r.device)  # [B]
    if decode_attention(attention, r.device, caches) == "pooled":
        start, n = (upload_ints(x, r.device) for x in rows[2:])  # [B] each
        attend: Attend = Pooled(r, caches[0].pool, start, n, pos, max(input_pos) + 1,
                                kernel or pooled_kernel(r.device, r.dtype))
    else:
        attend = _PerSequence(r, caches, input_pos, pos)
    return DecodeRows(r, ids, pos, attend)


def row_inputs(caches: Sequence[KVCache], token_ids: Sequence[int], input_pos: Sequence[int]) -> list[list[int]]:
    """A step's per-row inputs on the host: token ids, positions, each row's first pool slot and its
    key count (`Pooled`'s start and n)."""
    return [list(token_ids), list(input_pos), [c.offset for c in caches], [p + 1 for p in input_pos]]


class Attend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class DecodeGraphsLike(Protocol):
    def fits(self, caches: Sequence[KVCache]) -> bool: ...

    def step(self, caches: Sequence[KVCache], token_ids: Sequence[int], input_pos: Sequence[int]) -> torch.Tensor: ...


class DecodeRows:
    """A decode step's B rows as a row group (`layers.layer_pass`): one token per row at its own
    position, attending through `attend`."""

    def __init__(self, r: ModelRunner, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> None:
        self.r, self._attend = r, attend
        self.hidden = r.embed(ids)  # [B, E]
        self.cos, self.sin = r.rope(pos)  # [B, D] each

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._attend(layer, q, k, v)  # [B, Hq*D]

    def logits(self) -> torch.Tensor:
        """After the last layer: the next token's logits [B, V]."""
        return self.r.logits(self.hidden)


def forward(r: ModelRunner, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One token per row through every layer: ids, pos [B] on the device; returns logits [B, V].
    No host sync and no shape but B's and attend's: the body a CUDA graph captures."""
    return through_layers(r, DecodeRows(r, ids, pos, attend))  # [B, V]


def through_layers(r: ModelRunner, rows: DecodeRows) -> torch.Tensor:
    """The decode rows alone through every layer; logits [B, V]."""
    for layer in range(r.shape.n_layers):
        layer_pass(r, layer, [rows])
    return rows.logits()  # [B, V]


class _PerSequence:
    """One SDPA call per sequence on its own cache view (the oracle)."""

    def __init__(self, r: ModelRunner, caches: Sequence[KVCache], input_pos: Sequence[int], pos: torch.Tensor) -> None:
        self.r, self.caches, self.input_pos = r, caches, input_pos
        self.windows = [r.window_masks(pos[b:b + 1], p + 1) for b, p in enumerate(input_pos)]  # per seq: layer -> mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for b, (cache, p) in enumerate(zip(self.caches, self.input_pos)):
            K, V = cache.k[layer], cache.v[layer]  # [H, C, D] each
            K[:, p:p + 1], V[:, p:p + 1] = k[:, b:b + 1], v[:, b:b + 1]
            outs.append(self.r.attend(q[:, b:b + 1], K[:, :p + 1], V[:, :p + 1], self.windows[b](layer)))  # [1, Hq*D]
        return torch.cat(outs)  # [B, Hq*D]


def pooled_kernel(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """How a pooled step reads the pool: in place with "triton" (`paged_decode`) on CUDA where Triton
    is installed, or "cpu" (`cpu_kernels`) for a float32 pool on the CPU once its kernel builds; else
    "gather" (the rows' keys copied out, one SDPA call)."""
    if device.type == "cuda" and paged_decode.available(device):
        return "triton"
    if device.type == "cpu" and dtype == torch.float32 and cpu_kernels.ensure():
        return "cpu"
    return "gather"


class Pooled:
    """All rows in one attention call a layer, over the pool itself.

    Row b's keys are pool slots start[b] .. start[b] + n[b] - 1 (its run's first n[b] positions);
    its new K/V goes to slot start[b] + pos[b]. Every input is a device tensor: with the "triton"
    kernel nothing has a shape but B, with "gather" `n_keys` (>= the longest n[b]) is the one other
    shape, so a graph captured at B (and n_keys) replays any step that fits it."""

    def __init__(self, r: ModelRunner, kv: tuple[list[torch.Tensor], list[torch.Tensor]], start: torch.Tensor,
                 n: torch.Tensor, pos: torch.Tensor, n_keys: int, kernel: str = "gather") -> None:
        if kernel not in POOLED_KERNELS:
            raise ValueError(f"pooled decode kernel must be one of {', '.join(POOLED_KERNELS)}, not {kernel!r}")
        self.r, self.kernel = r, kernel
        self.k_pool, self.v_pool = kv  # L x [H, slots, D] each
        self.start, self.n, self.pos = start, n, pos  # [B] each
        self.slots = start + pos  # [B]: where each row's new K/V goes
        if kernel == "gather":
            j = torch.arange(n_keys, device=r.device)  # [Lmax]
            self.keys = (start[:, None] + torch.minimum(j[None, :], n[:, None] - 1)).reshape(-1)  # [B*Lmax] slots
            # (a row's padding reads its last valid key, masked)
            self.valid = j[None, :] < n[:, None]  # [B, Lmax]
            self.j = j
            self.masks: dict[int | None, torch.Tensor] = {}  # window -> [B, 1, 1, Lmax]

    def _mask(self, layer: int) -> torch.Tensor:
        window = self.r.windows[layer]
        if window not in self.masks:
            m = self.valid if window is None else self.valid & (self.j[None, :] > self.pos[:, None] - window)  # [B, Lmax]
            self.masks[window] = m[:, None, None, :]  # [B, 1, 1, Lmax]
        return self.masks[window]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        K, V = self.k_pool[layer], self.v_pool[layer]  # [H, slots, D] each
        K.index_copy_(1, self.slots, k)  # the B new keys, [H, B, D] into [H, slots, D]
        V.index_copy_(1, self.slots, v)
        n_q, b, d = q.shape
        h = K.shape[0]
        qb = q.transpose(0, 1).reshape(b, h, n_q // h, d)  # [B, H, G, D]: q head i reads KV head i // G
        if self.kernel == "triton":
            out = paged_decode.paged_decode(qb, K, V, self.start, self.n, self.pos, self.r.windows[layer],
                                            self.r.scaling)  # [B, H, G, D]
        elif self.kernel == "cpu":
            out = cpu_kernels.paged_decode(qb, K, V, self.start, self.n, self.pos, self.r.windows[layer],
                                          self.r.scaling)  # [B, H, G, D]
        else:
            n_keys = self.keys.shape[0] // b
            Kb = K.index_select(1, self.keys).view(h, b, n_keys, d).transpose(0, 1)  # [B, H, Lmax, D]
            Vb = V.index_select(1, self.keys).view(h, b, n_keys, d).transpose(0, 1)  # [B, H, Lmax, D]
            out = self.r.attend_rows(qb, Kb, Vb, self._mask(layer))  # [B, H, G, D]
        return out.reshape(b, n_q * d)  # [B, Hq*D]
