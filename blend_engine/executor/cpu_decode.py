"""Decode attention read straight from the paged pool on the CPU: one C++ call a layer for all rows.

The CPU twin of `paged_decode` (Triton, CUDA), same arguments: row b's G query heads of KV head h
over pool slots start[b] .. start[b] + n[b] - 1, windowed from pos[b] - window + 1.

    pool K[h]:  | ... | start[b] .. start[b] + n[b] - 1 : row b's keys | ... |

Against one SDPA call per sequence (`decode._PerSequence`), it reads each key and value row once
for all G query heads of its KV head, copies nothing and leaves ~10 Python-side ops per sequence
and layer out of the step (measured in `benchmarks.decode_attention`). The source
(`csrc/cpu_decode.cpp`) is compiled once per machine with torch's extension builder (a C++
compiler is needed: ~30 s on 2 cores; then loaded from torch's extension cache). `ensure()` builds
or loads it and says whether it is usable; where it cannot be built, a warning says why and decode
keeps the per-sequence path.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_decode.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # built on the machine that runs it

_lock = threading.Lock()
_state: dict[str, str | bool] = {}  # "ready": bool, "why": the build's error once tried


def _name() -> str:
    """The extension's name: a hash of its source, the flags, torch's version and this CPU's features,
    so a cache shared by different machines or versions never loads a build made for another."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + _cpu_flags().encode())
    return f"blendserve_cpu_decode_{h.hexdigest()[:12]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def ensure() -> bool:
    """Build (first time on this machine) or load the kernel, once per process; True when usable."""
    with _lock:
        if "ready" not in _state:
            _state["ready"], _state["why"] = _load()
            if not _state["ready"]:
                logger.warning("the CPU paged-decode kernel is unavailable (%s); CPU decode steps attend one "
                               "sequence at a time", _state["why"])
        return bool(_state["ready"])


def why_not() -> str:
    """Why `ensure()` failed ("" when it did not, or was not called)."""
    return str(_state.get("why", ""))


def _load() -> tuple[bool, str]:
    from torch.utils import cpp_extension

    name = _name()
    try:
        logger.info("loading the CPU paged-decode kernel %s (built once per machine, ~30 s)", name)
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no headers, a failed build: decode keeps working without it
        return False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return True, ""


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, start: torch.Tensor,
                 n: torch.Tensor, pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q [B, H, G, D] over the pool's k, v [H, slots, D] (float32, on the CPU): row b sees slots
    start[b] .. start[b] + n[b] - 1 (on a sliding-window layer only positions > pos[b] - window).
    Returns [B, H, G, D]. Call `ensure()` first."""
    return torch.ops.blendserve_cpu.paged_decode(q, k_pool, v_pool, start, n, pos, window or 0, scale)
