"""The GPU check's profile part (issue #57 item 4): the trace summariser on synthetic intervals and
events, a real CPU profile read through it, the traces' tar and the report's table."""

from __future__ import annotations

import gzip
import json
import tarfile
import threading
from types import SimpleNamespace

import pytest
import torch

from benchmarks.gpu.gpu_common import Setup, profiled
from benchmarks.gpu.gpu_profile import Busy, Gap, Span, Trace, idle_gaps, merge, summarise, top_names, trace_of
from benchmarks.gpu.gpu_report import markdown
from benchmarks.gpu.gpu_traces import TraceTar

CPU = Setup(torch.device("cpu"), torch.float32, smoke=True)


def test_overlapping_nested_and_touching_spans_merge_into_busy_stretches():
    spans = [Span("c", 50.0, 60.0), Span("a", 0.0, 10.0), Span("b", 5.0, 20.0),  # a and b overlap
             Span("inner", 6.0, 7.0),  # nested in both
             Span("d", 60.0, 70.0),  # touches c
             Span("outer", 100.0, 200.0), Span("nested", 120.0, 130.0)]
    assert merge(spans) == [Busy(0.0, 20.0, "a", "b"), Busy(50.0, 70.0, "c", "d"), Busy(100.0, 200.0, "outer", "outer")]
    assert merge([]) == []


def test_a_span_starting_with_another_but_ending_later_is_the_one_before_the_gap():
    assert merge([Span("short", 0.0, 5.0), Span("long", 0.0, 9.0)]) == [Busy(0.0, 9.0, "long", "long")]


def test_gaps_lie_between_busy_stretches_named_by_the_ops_around_them():
    busy = merge([Span("a", 0.0, 10.0), Span("b", 5.0, 20.0), Span("c", 25.0, 30.0), Span("d", 80.0, 90.0)])
    assert idle_gaps(busy) == [Gap(20.0, 5.0, "b", "c"), Gap(30.0, 50.0, "c", "d")]
    assert idle_gaps(merge([Span("x", 0.0, 1.0)])) == [] and idle_gaps([]) == []


def test_the_summary_counts_busy_time_gaps_over_the_threshold_and_the_top_names():
    timeline = [Span("gemm", 0.0, 100.0), Span("norm", 90.0, 110.0),  # overlap on two streams: busy 0-110
                Span("gemm", 115.0, 215.0),  # a 5 us gap: under the threshold
                Span("attn", 265.0, 300.0),  # a 50 us gap after gemm
                Span("attn", 320.0, 330.0)]  # a 20 us gap
    trace = Trace("cuda", timeline, [(s.name, s.end - s.start) for s in timeline], launches=7,
                  copies=[Span("Memcpy HtoD", 0.0, 40.0), Span("Memcpy HtoD", 50.0, 60.0)])
    out = summarise(trace, wall_ms=0.5, n_top=2, n_gaps=1)
    assert out["busy_ms"] == pytest.approx(0.110 + 0.100 + 0.035 + 0.010)
    assert out["span_ms"] == pytest.approx(0.330) and out["idle_ms"] == pytest.approx(0.075)
    assert out["busy_share"] == pytest.approx(0.255 / 0.5)
    assert (out["gaps"], out["gap_ms"]) == (2, pytest.approx(0.070))
    assert out["largest_gaps"] == [{"us": 50.0, "at_ms": 0.215, "after": "gemm", "before": "attn"}]
    assert out["top"] == [{"name": "gemm", "ms": 0.2, "count": 2}, {"name": "attn", "ms": 0.045, "count": 2}]
    assert out["launches"] == 7 and out["events"] == 5 and out["timeline"] == "CUDA kernels"
    assert out["copies"] == {"count": 2, "ms": pytest.approx(0.050)}


def test_an_empty_trace_summarises_to_zeros():
    out = summarise(Trace("cpu"), wall_ms=3.0)
    assert (out["busy_ms"], out["span_ms"], out["gaps"], out["gap_ms"], out["launches"]) == (0.0, 0.0, 0, 0.0, 0)
    assert out["largest_gaps"] == [] and out["top"] == [] and "copies" not in out


def test_top_names_sum_time_per_name_and_cut_long_names():
    long = "void at::native::kernel<" + "x" * 200 + ">"
    out = top_names([("a", 1.0), (long, 5.0), ("a", 3.0), ("b", 4.0)], 2)
    assert out == [{"name": long[:100], "ms": 0.005, "count": 1}, {"name": "a", "ms": 0.004, "count": 2}]


def _event(name: str, device: str, start: float, end: float, self_us: float = 0.0, **kw) -> SimpleNamespace:
    kw.setdefault("is_async", False)
    return SimpleNamespace(name=name, device_type=getattr(torch.autograd.DeviceType, device),
                           time_range=SimpleNamespace(start=start, end=end), self_cpu_time_total=self_us, **kw)


def test_cuda_events_split_into_kernels_copies_and_launches():
    events = [_event("aten::mm", "CPU", 0, 50), _event("cudaLaunchKernel", "CPU", 1, 3),
              _event("cuLaunchKernel", "CPU", 4, 5), _event("cudaGraphLaunch", "CPU", 6, 8),
              _event("cudaMemcpyAsync", "CPU", 9, 10),
              _event("sm90_gemm", "CUDA", 10, 40), _event("triton_attn", "CUDA", 45, 60),
              _event("Memcpy HtoD (Pinned -> Device)", "CUDA", 0, 30), _event("Memset (Device)", "CUDA", 30, 31),
              _event("my_range", "CUDA", 0, 100, is_user_annotation=True)]
    trace = trace_of(events, cuda=True)
    assert trace.launches == 3  # kernel and graph launches; not the copy
    assert [s.name for s in trace.timeline] == ["sm90_gemm", "triton_attn"]
    assert trace.times == [("sm90_gemm", 30.0), ("triton_attn", 15.0)] and len(trace.copies) == 2


def test_cpu_events_are_the_dispatched_ops_custom_ones_included():
    events = [_event("aten::mm", "CPU", 0, 50, 40.0), _event("blendserve_cpu::rows_linear", "CPU", 60, 90, 30.0),
              _event("gpu_check step", "CPU", 0, 100, 5.0, is_user_annotation=True),
              _event("aten::add", "CPU", 95, 99, 4.0, is_async=True)]
    trace = trace_of(events, cuda=False)
    assert [s.name for s in trace.timeline] == ["aten::mm", "blendserve_cpu::rows_linear"] and trace.launches == 2
    assert trace.times == [("aten::mm", 40.0), ("blendserve_cpu::rows_linear", 30.0)]


def test_a_real_cpu_profile_reads_as_aten_ops_with_their_self_time():
    x = torch.randn(64, 64)

    def work() -> None:
        for _ in range(3):
            (x @ x).relu()

    prof, wall_ms = profiled(CPU, work)
    trace = trace_of(prof.events(), cuda=False)
    names = [s.name for s in trace.timeline]
    assert names.count("aten::mm") == 3 and names.count("aten::relu") == 3  # the profiled call only, not the warm-up
    assert trace.launches == len(names) and all(n.startswith("aten::") for n in names)  # no other op ran
    out = summarise(trace, wall_ms)
    assert 0 < out["busy_ms"] <= out["span_ms"] <= wall_ms
    assert {t["name"] for t in out["top"]} >= {"aten::mm"}


def test_every_threads_ops_are_recorded_when_asked():
    x = torch.randn(32, 32)

    def in_a_thread() -> None:
        t = threading.Thread(target=lambda: x.mm(x))
        t.start()
        t.join()

    counted = {}
    for all_threads in (False, True):
        prof, _ = profiled(CPU, in_a_thread, all_threads=all_threads)
        counted[all_threads] = sum(s.name == "aten::mm" for s in trace_of(prof.events(), cuda=False).timeline)
    assert counted == {False: 0, True: 1}


class _Prof:
    def __init__(self, n_events: int) -> None:
        self.n = n_events

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"traceEvents": [{"name": f"op{i}", "ts": i, "dur": 1} for i in range(self.n)]}, f)


def test_traces_go_gzipped_into_one_tar_until_it_is_full(tmp_path):
    import os

    tar = TraceTar(tmp_path / "t.tar", limit=200_000)
    assert tar.add("blend@0.15 GPU", _Prof(10)) == "t.tar:blend_0.15_GPU.json.gz"

    class Noise(_Prof):  # does not compress: over the limit
        def export_chrome_trace(self, path: str) -> None:
            with open(path, "wb") as f:
                f.write(os.urandom(300_000))

    assert tar.add("batched", Noise(0)).startswith("skipped: 0.3 MiB gzipped")
    with tarfile.open(tmp_path / "t.tar") as t:
        assert t.getnames() == ["blend_0.15_GPU.json.gz"]
        trace = json.loads(gzip.decompress(t.extractfile("blend_0.15_GPU.json.gz").read()))
    assert len(trace["traceEvents"]) == 10


def test_the_report_has_a_row_per_profiled_run_and_names_a_failed_one():
    timeline = [Span("gemm", 0.0, 100.0), Span("attn", 150.0, 230.0)]
    summary = summarise(Trace("cuda", timeline, [(s.name, s.end - s.start) for s in timeline], 2), wall_ms=0.4)
    env = {"device_name": "X", "torch": "t", "transformers": "t"}
    profile = {"tokens": 8192, "ratio": 0.15, "clients": 4, "decode_tokens": 8, "seconds": 30.0,
               "runs": {"blend@0.15 GPU": summary, "batched": {"profile_error": "Traceback\nRuntimeError: OOM"}}}
    text = markdown({"environment": env, "reps": 3, "profile": profile})
    assert "## (6) profile: one blend@0.15 of 8192 tokens per KV tier" in text
    assert "| blend@0.15 GPU | 0.4 | 0.2 (45%) | 2 | 1 (0.05) | 50: `gemm` -> `attn` | `gemm` 0.10; `attn` 0.08 |" in text
    assert "| batched | failed: `RuntimeError: OOM` |" in text
