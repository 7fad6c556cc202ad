"""The GPU check's carried-weights codec (3-bit groups) and its report, on the CPU."""

from __future__ import annotations

import torch

from benchmarks.gpu_check import markdown
from benchmarks.gpu_pack import GROUP, pack3, unpack3


def test_three_bit_packing_round_trips_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(37, 300) * torch.linspace(0.1, 3.0, 300)  # not a multiple of the group size
    p = pack3(w)
    assert p["codes"].dtype == torch.uint8 and p["codes"].numel() * 8 == 3 * p["scale"].numel() * GROUP
    back = unpack3(p["codes"], p["scale"], p["low"], w.shape, torch.float32)
    step = p["scale"].float().repeat_interleave(GROUP)[: w.numel()].view(w.shape)
    assert back.shape == w.shape
    assert ((back - w).abs() <= step / 2 + 1e-3).all()
    assert (back - w).abs().mean() < 0.35 * w.abs().mean()  # 3 bits: 8 levels over each group's range


def test_report_renders_a_partial_run():
    env = {"device_name": "X", "torch": "t", "transformers": "t"}
    assert "GPU check" in markdown({"environment": env, "reps": 3})
    row = {"tokens": 8192, "layout_ms": 1.0, "hf_forward_ms": 100.0, "full_prefill_ms": 110.0,
           "blend@0.15 pinned RAM_ms": 30.0, "blend@0.15 GPU_ms": 29.0, "blend@auto local disk_ms": 100.0,
           "auto_served_by": "full_prefill", "auto_ratio": 1.0}
    text = markdown({"environment": env, "reps": 3, "correctness": {"model": "m", "dtype": "bf16", "kv_format": "bf16",
                     "rows": [], "pass": True}, "timing_model": "8b", "ttft": {"rows": [row]}})
    assert "| 8192 |" in text and "3.67x" in text and "full_prefill (1.00)" in text
