"""A torch.profiler trace summarised (the GPU check's profile part, issue #57 item 4): the top kernels
by device time (on a CPU: the top ops by self time), the launch count, device busy time against the
wall time, and the idle gaps between consecutive kernels on the device timeline.

`trace_of` reads a profiler's events (`prof.events()`) into a `Trace` of plain spans; everything
after it (`merge`, `idle_gaps`, `summarise`) is a pure function of those spans. On CUDA the timeline
is the kernels of every stream (copies and memsets apart) and a launch is a `cudaLaunchKernel`-like
runtime call (a CUDA graph's launch counted once); on a CPU the timeline is the dispatched ops
(`aten::`, and custom ones such as `blendserve_cpu::`) of every recorded thread and a launch is such
an op."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

GAP_US = 10.0  # a gap on the device timeline longer than this counts as idle
LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "hipLaunch", "hipGraphLaunch")
COPY_PREFIXES = ("Memcpy", "Memset")
NAME_CHARS = 100  # kernel names (templates) are cut to this many characters


@dataclass(frozen=True)
class Span:
    """One event on a timeline: its name and [start, end) in microseconds."""

    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Busy:
    """A merged stretch of the timeline: the op that opened it and the op that ended last in it."""

    start: float
    end: float
    first: str
    last: str


@dataclass(frozen=True)
class Gap:
    """Idle time between two busy stretches: the op that preceded it and the one that ended it."""

    start: float
    us: float
    after: str
    before: str


@dataclass
class Trace:
    """A profile reduced to plain spans: the timeline (kernels, or aten ops on a CPU), the time per
    name that ranks the top (a kernel's duration, an op's self time), launches and device copies."""

    kind: str  # "cuda" or "cpu"
    timeline: list[Span] = field(default_factory=list)
    times: list[tuple[str, float]] = field(default_factory=list)  # (name, us)
    launches: int = 0
    copies: list[Span] = field(default_factory=list)


def merge(spans: Iterable[Span]) -> list[Busy]:
    """Overlapping or nested spans merged into busy stretches, in time order (touching spans merge)."""
    out: list[Busy] = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        if out and s.start <= out[-1].end:
            b = out[-1]
            if s.end > b.end:
                out[-1] = Busy(b.start, s.end, b.first, s.name)
        else:
            out.append(Busy(s.start, s.end, s.name, s.name))
    return out


def idle_gaps(busy: list[Busy]) -> list[Gap]:
    """Every gap between consecutive busy stretches (`merge`'s output), in time order."""
    return [Gap(a.end, b.start - a.end, a.last, b.first) for a, b in itertools.pairwise(busy)]


def top_names(times: Iterable[tuple[str, float]], n: int) -> list[dict]:
    """The n names with the most time (summed over their events), with their event count."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for name, us in times:
        total[name] = total.get(name, 0.0) + us
        count[name] = count.get(name, 0) + 1
    ranked = sorted(total, key=lambda k: (-total[k], k))[:n]
    return [{"name": k[:NAME_CHARS], "ms": total[k] / 1e3, "count": count[k]} for k in ranked]


def summarise(trace: Trace, wall_ms: float, n_top: int = 8, n_gaps: int = 5, gap_us: float = GAP_US) -> dict:
    """The trace's summary: busy time (the union of the timeline) against the wall time of the
    profiled call and against the timeline's own span, gaps longer than `gap_us` (count, sum, the
    largest with the ops around them), the launch count and the top names."""
    busy = merge(trace.timeline)
    gaps = [g for g in idle_gaps(busy) if g.us > gap_us]
    busy_us = sum(b.end - b.start for b in busy)
    span_us = busy[-1].end - busy[0].start if busy else 0.0
    out = {"timeline": "CUDA kernels" if trace.kind == "cuda" else "dispatched ops (CPU)", "wall_ms": wall_ms,
           "span_ms": span_us / 1e3, "busy_ms": busy_us / 1e3, "busy_share": busy_us / 1e3 / wall_ms if wall_ms > 0 else 0.0,
           "launch_kind": "kernel launches" if trace.kind == "cuda" else "ops", "launches": trace.launches,
           "events": len(trace.timeline), "idle_ms": (span_us - busy_us) / 1e3, "gap_us": gap_us, "gaps": len(gaps),
           "gap_ms": sum(g.us for g in gaps) / 1e3,
           "largest_gaps": [{"us": g.us, "at_ms": (g.start - busy[0].start) / 1e3, "after": g.after[:NAME_CHARS],
                             "before": g.before[:NAME_CHARS]} for g in sorted(gaps, key=lambda g: -g.us)[:n_gaps]],
           "top": top_names(trace.times, n_top)}
    if trace.copies:
        out["copies"] = {"count": len(trace.copies), "ms": sum(c.end - c.start for c in trace.copies) / 1e3}
    return out


def trace_of(events: Iterable, cuda: bool) -> Trace:
    """A profiler's events (`prof.events()`: FunctionEvents) as a `Trace`: on CUDA the device's
    kernels and copies, launches counted from the runtime calls; on a CPU the dispatched ops (a
    namespaced name, `ns::op`; user annotations and async events left out)."""
    if cuda:
        return _cuda_trace(events)
    ops = [e for e in events if _on("CPU", e) and "::" in e.name and not e.is_async
           and not getattr(e, "is_user_annotation", False)]
    return Trace("cpu", [_span(e) for e in ops], [(e.name, e.self_cpu_time_total) for e in ops], len(ops))


def _cuda_trace(events: Iterable) -> Trace:
    trace = Trace("cuda")
    for e in events:
        if _on("CPU", e):
            trace.launches += e.name.startswith(LAUNCH_PREFIXES)
        elif not getattr(e, "is_user_annotation", False):  # a GPU-side record_function range is no kernel
            span = _span(e)
            if e.name.startswith(COPY_PREFIXES):
                trace.copies.append(span)
            else:
                trace.timeline.append(span)
                trace.times.append((span.name, span.end - span.start))
    return trace


def _on(device: str, event) -> bool:
    return getattr(event.device_type, "name", str(event.device_type)).endswith(device)


def _span(event) -> Span:
    return Span(event.name, float(event.time_range.start), float(event.time_range.end))
