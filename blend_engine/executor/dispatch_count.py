"""The fixed cost of a pass over the layers, counted (issue #57): aten ops per layer, and the ops
whose result the host reads, on whatever device runs (the CPU in CI, where it can always be
measured).

    with DispatchCount() as count:
        engine.prefill(plan)
    count.ops(layer)        # aten (and cpu_kernels) calls the compute thread made at that layer
    count.host_reads()      # what read a device value on the host, and where

Two torch modes, both thread-local (only the thread that entered counts):

- a `TorchDispatchMode` counts every op that reaches the dispatcher below autograd, a custom op
  (`cpu_kernels`, through torch.ops) as one, and flags the ops with a data-dependent result the
  host must read: `.item()`, `nonzero`, `masked_select`, `unique`, boolean-mask indexing,
  `repeat_interleave` by a tensor, `bincount`, a copy from a device to the CPU;
- a `TorchFunctionMode` flags the Python-level reads that reach no op at all on the CPU
  (`.tolist()`, `int(t)`, `bool(t)`, `float(t)`, a tensor as an index).

Ops are attributed to the layer the layer loop says it is in (`layers.watch_layers`: a mark at
`LayerLoop.enter` and around `layers.layer_pass`, a no-op when nothing counts), by phase: "load"
(the next layer taken from the loader's stream, where the stream reads on the compute thread),
"place" (the cached chunks written at their offsets), "pass" (projections, selection, attention,
MLP). Not `selected_attention="flex"`: FlexAttention is a higher-order op that refuses a Python
mode. Ops outside every layer (before the loop: uploads, tables; after it: logits, the one read of
the final positions) are counted under layer None.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from blend_engine.executor import layers

# ops whose result (a value or a shape) the host has to read: a device sync on a GPU
HOST_READ_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::allclose",
    "aten::nonzero", "aten::argwhere", "aten::masked_select", "aten::unique_consecutive", "aten::_unique",
    "aten::_unique2", "aten::unique_dim", "aten::unique_dim_consecutive", "aten::bincount", "aten::histc",
})
# indexing ops that read the mask on the host when an index is boolean
MASK_INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_"})
# Tensor methods that hand a device value to Python (on the CPU no op reaches the dispatcher for
# tolist). Not `.numpy()`: it takes only a CPU tensor, so on a device the copy before it is the read.
HOST_READ_METHODS = frozenset({"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "__complex__"})

Where = tuple[int | None, str]  # (layer or None outside the loop, phase)


@dataclass
class HostRead:
    """One host read: where it happened and what it was (an op or a Tensor method)."""

    layer: int | None
    phase: str
    what: str


@dataclass
class Tally:
    """Per (layer, phase): op name -> calls; every host read in order."""

    ops: dict[Where, Counter[str]] = field(default_factory=dict)
    reads: list[HostRead] = field(default_factory=list)


def op_name(func: object) -> str:
    """"aten::index" for aten.index.Tensor: the operator without its overload."""
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


def reads_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether this op's result depends on values the host must read first."""
    if name in HOST_READ_OPS:
        return True
    if name in MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if name == "aten::repeat_interleave":  # by a tensor of counts: the output's length is their sum
        by_tensor = len(args) == 1 or isinstance(args[1], torch.Tensor)
        return by_tensor and kwargs.get("output_size") is None
    if name in COPY_OPS:
        return _device_to_host(name, args, kwargs)
    return False


def _device_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """A blocking copy of a tensor off a device into CPU memory (the host waits for it)."""
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    target = kwargs.get("device")
    return (args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
            and not kwargs.get("non_blocking", False))


class _Ops(TorchDispatchMode):
    def __init__(self, count: DispatchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count._op(op_name(func), args, kwargs)
        return func(*args, **kwargs)


class _Reads(TorchFunctionMode):
    def __init__(self, count: DispatchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in HOST_READ_METHODS:
            return func(*args, **(kwargs or {}))
        self.count._read(f"Tensor.{name}")
        self.count.in_read += 1  # the item / is_nonzero it dispatches is this read, not another
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.count.in_read -= 1


class DispatchCount:
    """Counts, on the thread that enters it, every op and host read by layer and phase (see the module)."""

    def __init__(self) -> None:
        self.tally = Tally()
        self.layer: int | None = None
        self.phase = "outside"
        self.in_read = 0
        self._thread = threading.get_ident()
        self._modes = (_Reads(self), _Ops(self))

    def __enter__(self) -> DispatchCount:
        self._thread = threading.get_ident()
        layers.watch_layers(self._mark)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        layers.watch_layers(None)
        self.layer, self.phase = None, "outside"

    def _mark(self, layer: int | None, phase: str) -> None:
        if threading.get_ident() == self._thread:
            self.layer, self.phase = layer, phase if layer is not None else "outside"

    def _op(self, name: str, args: tuple, kwargs: dict) -> None:
        where = (self.layer, self.phase)
        self.tally.ops.setdefault(where, Counter())[name] += 1
        if not self.in_read and reads_host(name, args, kwargs):
            self._read(name)

    def _read(self, what: str) -> None:
        self.tally.reads.append(HostRead(self.layer, self.phase, what))

    # ---------------------------------------------------------------- results
    def layers(self) -> list[int]:
        """The layers that ran, in order."""
        return sorted({layer for layer, _ in self.tally.ops if layer is not None})

    def ops(self, layer: int | None, phase: str | None = None) -> int:
        """Op calls at `layer` (None: outside the loop), in one phase or all."""
        return sum(sum(c.values()) for (lay, ph), c in self.tally.ops.items()
                   if lay == layer and (phase is None or ph == phase))

    def op_counts(self, layer: int | None, phase: str | None = None) -> Counter[str]:
        """Op name -> calls at `layer`, in one phase or all."""
        out: Counter[str] = Counter()
        for (lay, ph), c in self.tally.ops.items():
            if lay == layer and (phase is None or ph == phase):
                out.update(c)
        return out

    def host_reads(self, layer: int | None = None, inside: bool = True) -> list[HostRead]:
        """The host reads inside the layer loop (`inside`; at `layer` when given), or all of them."""
        return [r for r in self.tally.reads
                if (not inside or r.layer is not None) and (layer is None or r.layer == layer)]


__all__ = ["DispatchCount", "HostRead", "HOST_READ_OPS", "op_name", "reads_host"]
