"""The decode step: one new token for each of B running sequences, whatever their KV lengths.

    seq b:  | sys | chunk_1 .. chunk_k | question | answer so far | new token at input_pos[b] |

The projections, norms and MLP run batched over the B rows ([B, E]: each row its own token at
its own position, so rows never mix). Attention is ragged: row b attends to its own cache
`caches[b]` over keys 0..input_pos[b], through one SDPA call per sequence on a view of that cache
(no padding, no copy of any cache: exact, and O(sum of lengths) work). A lone sequence is the
same step with B = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blend_engine.model import ModelRunner

from .layers import KVCache
from .uploads import upload_ints


@torch.inference_mode()
def decode_batch(runner: ModelRunner, caches: Sequence[KVCache], token_ids: Sequence[int],
                 input_pos: Sequence[int]) -> torch.Tensor:
    """Write token b at position input_pos[b] of caches[b] (every layer's K/V), return the logits
    of the next token for every sequence: [B, V]. Each cache's length becomes input_pos[b] + 1."""
    r = runner
    if len(caches) != len(token_ids) or len(caches) != len(input_pos):
        raise ValueError("decode_batch needs one token and one position per cache")
    for cache, p in zip(caches, input_pos):
        if p >= cache.capacity:
            raise ValueError("KV cache capacity exhausted")
    ids = upload_ints(token_ids, r.device)  # [B], the step's two uploads: pinned, non-blocking
    pos = upload_ints(input_pos, r.device)  # [B]
    hidden = r.embed(ids)  # [B, E]
    cos, sin = r.rope(pos)  # [B, D] each
    windows = [r.window_masks(pos[b:b + 1], p + 1) for b, p in enumerate(input_pos)]  # per seq: layer -> mask
    for layer in range(r.shape.n_layers):
        q, k, v = r.qkv(layer, hidden, cos, sin)  # [Hq, B, D], [H, B, D], [H, B, D]
        outs = []
        for b, (cache, p) in enumerate(zip(caches, input_pos)):
            K, V = cache.k[layer], cache.v[layer]  # [H, C, D] each
            K[:, p:p + 1], V[:, p:p + 1] = k[:, b:b + 1], v[:, b:b + 1]
            outs.append(r.attend(q[:, b:b + 1], K[:, :p + 1], V[:, :p + 1], windows[b](layer)))  # [1, Hq*D]
        hidden = r.finish_layer(layer, hidden, torch.cat(outs))  # [B, E]
    for cache, p in zip(caches, input_pos):
        cache.length = p + 1
    return r.logits(hidden)  # [B, V]
