"""Attention of the selected rows through FlexAttention (`EngineConfig.selected_attention="flex"`).

A blend recomputes S sorted positions `pos` [S] of an N-token prompt; each attends to the keys at
or before its own position (and, on a sliding-window layer, after `position - window`). The
default device path passes that as one boolean mask [S, N] to SDPA (memory-efficient kernel,
K/V expanded to the query heads). FlexAttention instead takes a block mask built from `pos` on
the device (no host sync: `create_block_mask` only evaluates the mask function over the grid),
skips the key blocks no selected row can see, and takes grouped K/V as they are (`enable_gqa`).

On CUDA `flex_attention` is compiled once per process, lazily, at its first call (a one-time cost
of seconds: the GPU check reports it apart; if compiling fails the boolean-mask SDPA path takes
over, logged); elsewhere the eager reference runs (unfused, the full
scores matrix: correct, not fast; the CPU keeps its block path unless asked). Shapes: Hq query
heads, H kv heads, S selected rows, N keys, D head dim.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

SELECTED_ATTENTION = ("auto", "blocks", "sdpa_mask", "flex")

# the eager reference is what we mean to run off CUDA: its "use torch.compile" warning is noise there
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
logger = logging.getLogger(__name__)
_compiled: Callable | None = None
_failed = False  # compiling failed once in this process
_compile_lock = threading.Lock()


def check_selected_attention(kind: str) -> str:
    if kind not in SELECTED_ATTENTION:
        raise ValueError(f"selected_attention must be one of {SELECTED_ATTENTION}, got {kind!r}")
    return kind


def selected_block_mask(pos: torch.Tensor, n_keys: int, window: int | None) -> BlockMask:
    """Rows at sorted absolute positions pos [S] over keys 0..n_keys-1: key j visible iff j <= p
    (and j > p - window on a sliding-window layer). Built on pos's device."""
    if window is None:
        def visible(b, h, q_idx, kv_idx):
            return kv_idx <= pos[q_idx]
    else:
        def visible(b, h, q_idx, kv_idx):
            p = pos[q_idx]
            return (kv_idx <= p) & (kv_idx > p - window)
    return create_block_mask(visible, None, None, pos.shape[0], n_keys, device=pos.device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float,
                fallback: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """q [Hq, S, D] over k, v [H, N, D] under `block_mask`: [S, Hq*D].

    On CUDA, if compiling fails (logged once; e.g. a recompile for new shapes), `fallback()` (the
    caller's boolean-mask SDPA path) serves this and every later call, not the eager reference:
    that one materialises the S x N x Hq scores, gigabytes at 16K tokens."""
    args = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))  # [1, Hq, S, D], [1, H, N, D] x2
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=k.shape[0] != q.shape[0])
    kernel = _kernel(q.device)
    if kernel is None and fallback is not None:
        return fallback()  # [S, Hq*D]
    try:
        out = (kernel or flex_attention)(*args, **kwargs)  # [1, Hq, S, D]
    except Exception:  # noqa: BLE001 - a compiler failure must not fail requests
        if kernel is None or kernel is flex_attention:  # the eager reference itself failed: a real error
            raise
        _compile_failed()
        if fallback is not None:
            return fallback()  # [S, Hq*D]
        out = flex_attention(*args, **kwargs)  # [1, Hq, S, D]
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [S, Hq*D]


def compile_failed() -> bool:
    """Whether compiling flex_attention failed in this process (then the fallback serves "flex")."""
    return _failed


def _kernel(device: torch.device) -> Callable | None:
    """The compiled kernel on CUDA (compiled at its first call; shapes that vary make it dynamic
    after the first recompile), None once compiling has failed; the eager reference elsewhere."""
    global _compiled
    if _failed:
        return None
    if device.type != "cuda":
        return flex_attention
    with _compile_lock:
        if _compiled is None:
            _compiled = torch.compile(flex_attention)
        return _compiled


def _compile_failed() -> None:
    global _failed
    logger.exception("compiling flex_attention failed; the boolean-mask SDPA path (or, without one, the eager "
                     "reference) serves the selected rows from now on")
    with _compile_lock:
        _failed = True
