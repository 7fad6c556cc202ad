"""The pooled decode step at fixed shapes, replayed as CUDA graphs (issue #35 item 6).

A decode step's only varying shapes are B (rows) and, when the rows' keys are gathered out of the
pool (`decode.Pooled`'s "gather" kernel), Lmax (the longest row's keys); the "triton" kernel reads
the pool in place and has no Lmax. Here a step runs at (batch_bucket(B), key_bucket(Lmax) or 0):

    rows:  | seq 1 .. seq B | padding up to the batch bucket: write the pool's scratch block, attend to 1 key |
    keys:  | row b's n[b] keys | its last key again, masked, up to the key bucket |

and its per-step inputs (token ids, positions, run starts, key counts) are one [4, B] upload into a
static buffer, so the step (`decode.forward` over `decode.Pooled`) has no host sync and one graph
per shape replays every step of that shape. Graphs are captured on first
use, in the thread that runs the step (the engine loop's), and share one memory pool: replays run
one at a time on that thread's stream, and a step's logits are copied out before the next.

`capture=False` runs the same padded step eagerly: the CPU test of everything but the capture.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from blend_engine.model.runner import ModelRunner

from .decode import Pooled, forward, pooled_kernel, row_inputs
from .kv_pool import KVPool
from .layers import KVCache
from .uploads import upload

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # the batch sizes captured (a step of more rows runs eagerly)
MIN_KEYS = 256  # the smallest key bucket


def batch_bucket(b: int) -> int | None:
    """The smallest captured batch size that holds b rows; None past the largest."""
    return next((size for size in BATCH_BUCKETS if size >= b), None)


def key_bucket(n: int) -> int:
    """n keys rounded up to a multiple of a quarter of the power of two at or below n (at least
    MIN_KEYS): 4 buckets an octave, padding below a quarter of n (or MIN_KEYS), and a context that
    grows token by token changes graph every ~n/4 steps."""
    step = max(MIN_KEYS, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


class DecodeGraphs:
    """Owns the static inputs and the graphs of the pooled decode steps over one `KVPool`."""

    def __init__(self, runner: ModelRunner, pool: KVPool, capture: bool = True, kernel: str | None = None) -> None:
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.r, self.pool, self.capture = runner, pool, capture
        self.kernel = kernel or pooled_kernel(runner.device)  # `decode.Pooled`'s
        self.inputs = torch.zeros(4, BATCH_BUCKETS[-1], dtype=torch.long, device=runner.device)  # [4, Bmax]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (B, L) -> graph, logits
        self._mempool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, caches: Sequence[KVCache]) -> bool:
        """Every cache a run of this pool, and a captured batch size that holds them."""
        kv = self.pool.kv
        return batch_bucket(len(caches)) is not None and all(c.pool is kv for c in caches)

    @torch.inference_mode()
    def step(self, caches: Sequence[KVCache], token_ids: Sequence[int], input_pos: Sequence[int]) -> torch.Tensor:
        """`decode.decode_batch`'s pooled step for these rows: logits [b, V] (a copy)."""
        b = len(caches)
        size = batch_bucket(b)
        if size is None:
            raise ValueError(f"a step of {b} rows is past the largest captured batch ({BATCH_BUCKETS[-1]})")
        n_keys = key_bucket(max(input_pos) + 1) if self.kernel == "gather" else 0
        self._load(size, caches, token_ids, input_pos)
        if not self.capture:
            return self._run(size, n_keys)[:b].clone()  # [b, V]
        graph, logits = self.graphs.get((size, n_keys)) or self._captured(size, n_keys)
        graph.replay()
        return logits[:b].clone()  # [b, V]

    def _load(self, size: int, caches: Sequence[KVCache], token_ids: Sequence[int], input_pos: Sequence[int]) -> None:
        """The step's inputs into the static buffer: rows b..size-1 are padding (token 0 at position 0
        of the scratch block, one key)."""
        pad = size - len(caches)
        padding = (0, 0, self.pool.scratch_slot, 1)  # token, position, first slot, key count
        rows = row_inputs(caches, token_ids, input_pos)
        host = torch.tensor([row + [p] * pad for row, p in zip(rows, padding)], dtype=torch.long)  # [4, size]
        self.inputs[:, :size].copy_(upload(host, self.r.device), non_blocking=True)

    def _run(self, size: int, n_keys: int) -> torch.Tensor:
        """The step at (size, n_keys) from the static inputs: logits [size, V]."""
        ids, pos, start, n = self.inputs[:, :size]  # [size] each
        return forward(self.r, ids, pos, Pooled(self.r, self.pool.kv, start, n, pos, n_keys, self.kernel))  # [size, V]

    def _captured(self, size: int, n_keys: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the step at (size, n_keys), after a warm-up on a side stream (which runs this step
        for real: it writes the same K/V the replay writes again)."""
        side = torch.cuda.Stream(self.r.device)
        side.wait_stream(torch.cuda.current_stream(self.r.device))
        with torch.cuda.stream(side):
            self._run(size, n_keys)
        torch.cuda.current_stream(self.r.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            logits = self._run(size, n_keys)  # [size, V], in the graphs' pool
        self.graphs[(size, n_keys)] = (graph, logits)
        logger.info("captured the decode step at batch %d, %d keys, %s kernel (%d graphs)", size, n_keys, self.kernel,
                    len(self.graphs))
        return graph, logits
