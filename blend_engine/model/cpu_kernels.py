"""Blendserve's CPU kernels (`csrc/cpu_kernels.cpp`), built once per machine and loaded into torch.ops.

Float32 ops where torch's own CPU kernels are slow at the engine's shapes (measured,
benchmarks/results/cpu_kernels/):
- `paged_decode`: decode attention read straight from the paged pool, one call a layer for all rows,
  the CPU twin of `executor.paged_decode` (Triton), same arguments. Against one SDPA call per
  sequence it reads each key and value row once for all G query heads of its KV head and leaves
  ~10 Python-side ops per sequence and layer out of the step. Each row's keys are cut into work
  items of 512 (by the row's own length, so batched equals alone bit for bit), vectorised 16 keys
  at a time: bound by reading the pool (~20-24 GB/s here; `python -m benchmarks.kernels.decode_attention`).

      pool K[h]:  | ... | start[b] .. start[b] + n[b] - 1 : row b's keys | ... |

- `selected_attention`: a prefill's rows at sorted positions, each over the keys up to its own (a
  blend's selected rows; every row of a causal prefill): register tiles of query vectors over key
  blocks of 64, an online softmax, no [S, N] mask; ~70M (row, key) cells/s at SmolLM2's heads, 1.4-1.8x
  SDPA in position-ordered blocks, 1.16-1.20x one causal SDPA (`python -m benchmarks.kernels.prefill_attention`)
  on the AMD EPYC host; on an AMX Xeon ~120M cells/s, 1.44-1.58x the blocks and 1.18x causal SDPA (2026-12-07;
  before 738c7c7 causal SDPA was faster there from ~2K rows), so the runner measures which is at load
  (`runner.sdpa_causal_faster`).

      keys:   | 0 .............................. N-1 |
      row s:  | 0 ...... pos[s] |   (on a sliding-window layer only the last `window` of them)

- `rows_linear`: x W^T (+ bias) for a few rows (`ROWS`) against an nn.Linear's weight as stored:
  register-tiled dot products that read each weight row once per 8 rows of x, where MKL's sgemm
  takes its slow small-M path (the 211 projections of a SmolLM2 decode step at 8 rows: 35 vs 47 ms).
- `packed_linear`: the same tiles over a weight kept in its GGUF block code (`packed.py`).
- `place_rotated`: a layer of cached chunks into a request's cache, the keys moved by RoPE on the way
  (`executor.placement`): one pass where torch's ops wrote five temporaries and two copies (a blend of
  ~500 tokens spent ~16 ms placing its 29 layers, ~6% of it).
- `rms_norm`: the families' RMSNorm in one pass a row, where torch runs six ops over every row.
- `rope`: fresh queries and keys rotated to their positions in one pass (torch: five ops, bit for bit).

The source is compiled with torch's extension builder (a C++ compiler is needed: ~10 s on 2 cores,
then loaded from torch's extension cache in ~0.1 s). `ensure()` builds or loads it once per process
and says whether it is usable; where it cannot be built, a warning says why and callers keep torch's
kernels (decode attends one sequence at a time, prefill rows go to SDPA, projections to MKL).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # built on the machine that runs it
ROWS = range(3, 129)  # rows where `rows_linear` beat MKL here (1-2 rows: MKL's W @ [x; x]^T is as fast)

_lock = threading.Lock()
_state: dict[str, str | bool] = {}  # "ready": bool, "why": the build's error once tried


def _name() -> str:
    """The extension's name: a hash of its source, the flags, torch's version and this CPU's features,
    so a cache shared by different machines or versions never loads a build made for another."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + _cpu_flags().encode())
    return f"blendserve_cpu_kernels_{h.hexdigest()[:12]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def ensure() -> bool:
    """Build (first time on this machine) or load the kernels, once per process; True when usable."""
    ready = _state.get("ready")
    if ready is not None:
        return bool(ready)
    with _lock:
        if "ready" not in _state:
            ok, why = _load()
            _state["why"], _state["ready"] = why, ok
            if not ok:
                logger.warning("Blendserve's CPU kernels are unavailable (%s); CPU decode steps attend one "
                               "sequence at a time and projections run on MKL alone", why)
        return bool(_state["ready"])


def why_not() -> str:
    """Why `ensure()` failed ("" when it did not, or was not called)."""
    return str(_state.get("why", ""))


def _load() -> tuple[bool, str]:
    from torch.utils import cpp_extension

    name = _name()
    try:
        logger.info("loading Blendserve's CPU kernels %s (built once per machine, ~10 s)", name)
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, a failed build: everything keeps working on torch's kernels
        text = str(exc).strip()
        return False, f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
    return True, ""


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, start: torch.Tensor,
                 n: torch.Tensor, pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q [B, H, G, D] over the pool's k, v [H, slots, D] (float32, on the CPU): row b sees slots
    start[b] .. start[b] + n[b] - 1 (on a sliding-window layer only positions > pos[b] - window).
    Returns [B, H, G, D]. Call `ensure()` first."""
    return torch.ops.blendserve_cpu.paged_decode(q, k_pool, v_pool, start, n, pos, window or 0, scale)


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int | None,
                       scale: float) -> torch.Tensor:
    """A blend's selected rows: q [Hq, S, D] at sorted distinct positions pos [S] over k, v [H, N, D]
    (float32, on the CPU, D 16 x 1..8), row s seeing keys <= pos[s] (and > pos[s] - window on a
    sliding-window layer). Returns [S, Hq*D]. Call `ensure()` first."""
    return torch.ops.blendserve_cpu.selected_attention(q, k, v, pos, window or 0, scale)


def selected_usable(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `selected_attention` takes this cache: float32, a head dim of 16 x 1..8, the kernels built."""
    return dtype == torch.float32 and head_dim % 16 == 0 and 16 <= head_dim <= 128 and ensure()


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T (+ bias [out]), float32 on the CPU: [T, out]. Call `ensure()` first."""
    return torch.ops.blendserve_cpu.rows_linear(x, weight, bias)


def packed_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ W^T (+ bias [out]) for a weight kept as block codes (`packed.PackedWeight`): a4 when
    `m` is given (codes uint8 [out, in/2]), else s8 (codes int8 [out, in]); d, m [out, in/32]. Equal
    to `rows_linear` on the de-quantized weight bit for bit, for any number of rows. Call `ensure()` first."""
    return torch.ops.blendserve_cpu.packed_linear(x, codes, d, m, bias)


def place_rotated(K: torch.Tensor, V: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, dst: torch.Tensor) -> None:
    """K[:, dst] = k moved by the rotation tables cos, sin [Tc, D] (as `ModelRunner.apply_rotation`, bit for
    bit; none: as they are) and V[:, dst] = v, for the cache's K, V [H, C, D] and the chunks' k, v [H, Tc, D]
    (float32, on the CPU; dst [Tc] the cached tokens' slots). Call `ensure()` first."""
    torch.ops.blendserve_cpu.place_rotated(K, V, k, v, cos, sin, dst)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim of x [..., E], float32 on the CPU; each row
    on its own. Call `ensure()` first."""
    return torch.ops.blendserve_cpu.rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [H, T, D] (D contiguous) and tables [T, D], float32 on the CPU,
    bit for bit as torch computes it; [H, T, D] over [T, H, D] memory. Call `ensure()` first."""
    return torch.ops.blendserve_cpu.rope(x, cos, sin)
