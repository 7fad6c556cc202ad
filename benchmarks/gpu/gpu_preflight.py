"""The GPU check's preflight (issue 39): at most `BUDGET_S` seconds before anything expensive, so a
broken machine or stack stops the run with one clear line instead of spending its minutes.

Steps, in order, each stopping the preflight with `PreflightFailed("<step>: <reason>")`:
1. `cuda`: a CUDA device is visible and usable (skipped on the CPU: smoke mode);
2. `pinned`: page-locked host memory can be allocated (skipped on the CPU);
3. `copy`: one host-to-device copy on the engine's copy stream, overlapped with a matmul on the
   compute stream and ordered by an event (the pattern `transfer.LayerPacker` uses), arrives intact;
   on the CPU the same code path runs without streams;
4. `layers`: the first `LAYERS` layers of the real model (the carried SmolLM2) run full prefill,
   blend (from a memory tier, through the engine's packer) and one decode step on the device, each
   compared with the same truncated model on the CPU in the same dtype, judged by that dtype's
   tolerance (`selfcheck.compare`). Only those layers are built and de-quantized (seconds, not
   the ~45 s a whole SmolLM2 took to build on a loaded 2-core CPU).
On the CPU (smoke) the steps run the same code, and the budget is reported, not enforced.
Everything it measured goes into the returned dict (and the check's JSON) whether it passed or not.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.gpu.gpu_common import Setup
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.selfcheck import compare
from blend_engine.types import BlendPlan, Mode

logger = logging.getLogger(__name__)
BUDGET_S = 60.0
LAYERS = 3  # layer 0, the check layer (1) and one layer on the selected rows' path
COPY_BYTES = 64 << 20
PASSAGES = ("The Danube flows through ten countries, more than any other river in the world, into the Black Sea.",
            "Paris is the capital of France. It lies on the Seine and has about two million inhabitants.")
QUESTION = "Which river flows through ten countries?"


class PreflightFailed(RuntimeError):
    """One line: '<step>: <reason>'."""


@dataclass
class Preflight:
    setup: Setup
    budget_s: float = BUDGET_S
    report: dict = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)

    def step(self, name: str, fn: Callable[[], dict | None]) -> None:
        """Run one step; record its seconds and findings; raise PreflightFailed with one line on failure."""
        if time.perf_counter() - self.t0 > self.budget_s and self.setup.device.type == "cuda":
            raise PreflightFailed(f"{name}: preflight over its {self.budget_s:.0f} s budget before this step")
        t = time.perf_counter()
        try:
            found = fn() or {}
        except PreflightFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - any fault of the stack becomes the one-line reason
            raise PreflightFailed(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        finally:
            self.report[f"{name}_s"] = round(time.perf_counter() - t, 3)
        self.report.update({f"{name}_{k}": v for k, v in found.items()})


RunnerFactory = Callable[[str, torch.dtype, int], ModelRunner]  # (device, dtype, layers) -> the real model's first layers


def run_preflight(setup: Setup, runner_factory: RunnerFactory,
                  budget_s: float = BUDGET_S) -> dict:
    """All steps; returns the report with `pass` True, or raises PreflightFailed (the report so far is
    on the exception's `report` attribute)."""
    pf = Preflight(setup, budget_s)
    try:
        cuda = setup.device.type == "cuda"
        pf.step("cuda", _cuda_visible if cuda else lambda: {"skipped": "smoke: CPU"})
        pf.step("pinned", _pinned if cuda else lambda: {"skipped": "smoke: CPU"})
        pf.step("copy", lambda: _overlapped_copy(setup))
        pf.step("layers", lambda: _layers(setup, runner_factory))
    except PreflightFailed as exc:
        pf.report.update({"pass": False, "reason": str(exc), "seconds": round(time.perf_counter() - pf.t0, 2)})
        exc.report = pf.report
        raise
    pf.report.update({"pass": True, "seconds": round(time.perf_counter() - pf.t0, 2)})
    if pf.report["seconds"] > budget_s and setup.device.type == "cuda":
        pf.report.update({"pass": False, "reason": f"preflight took {pf.report['seconds']:.0f} s > {budget_s:.0f} s"})
        exc = PreflightFailed(pf.report["reason"])
        exc.report = pf.report
        raise exc
    return pf.report


def _cuda_visible() -> dict:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise PreflightFailed("cuda: torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES or a CPU build of torch)")
    x = torch.ones(1024, device="cuda").sum()  # a kernel really runs
    if float(x) != 1024.0:
        raise PreflightFailed(f"cuda: a sum of 1024 ones gave {float(x)}")
    free, total = torch.cuda.mem_get_info()
    return {"name": torch.cuda.get_device_name(0), "free_gib": round(free / 2**30, 1), "total_gib": round(total / 2**30, 1),
            "torch_cuda": torch.version.cuda}


def _pinned() -> dict:
    buf = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)  # [bytes]
    if not buf.is_pinned():
        raise PreflightFailed("pinned: pin_memory=True gave pageable memory")
    return {"bytes": COPY_BYTES}


def _overlapped_copy(setup: Setup) -> dict:
    """One copy of a pinned buffer on the copy stream while the compute stream multiplies; the compute
    stream waits for the copy's event, then checks the bytes on the device."""
    from blend_engine.transfer import copy_stream, cuda_ready

    n = COPY_BYTES // 4
    host = torch.arange(n, dtype=torch.int32)  # [n]
    if not cuda_ready(setup.device):
        dev = host.to(setup.device)
        if not torch.equal(dev, host):
            raise PreflightFailed("copy: the copied buffer differs")
        return {"overlap": "n/a (CPU)"}
    host = host.pin_memory()
    a = torch.randn(4096, 4096, device=setup.device, dtype=setup.dtype)  # [4096, 4096]
    stream = copy_stream(setup.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _ = a @ a  # queued on the compute stream
    with torch.cuda.stream(stream):
        dev = host.to(setup.device, non_blocking=True)  # [n]
        done = torch.cuda.Event()
        done.record(stream)
    torch.cuda.current_stream().wait_event(done)
    dev.record_stream(torch.cuda.current_stream())
    same = bool(torch.equal(dev, torch.arange(n, dtype=torch.int32, device=setup.device)))
    seconds = time.perf_counter() - t0
    if not same:
        raise PreflightFailed("copy: the buffer copied on the copy stream differs from its source")
    return {"gb_per_s_with_matmul": round(COPY_BYTES / seconds / 1e9, 2)}


def truncated(runner: ModelRunner, layers: int) -> ModelRunner:
    """A loaded runner's first `layers` layers (embeddings, norm and head kept), a copy."""
    model = copy.deepcopy(runner.model)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return ModelRunner(model.eval(), runner.tokenizer, f"{runner.name} [:{layers}]")


def _paths(runner: ModelRunner, fmt: str) -> dict[str, torch.Tensor]:
    """First-token logits [V] of full prefill, blend@0.15 (KV from a memory tier) and one decode step."""
    store = MemoryStore(1 << 28, kv_format=fmt)
    engine = BlendEngine(runner, store, EngineConfig(kv_format=fmt))
    plan = BlendPlan(PASSAGES, QUESTION)
    for seg in engine.layout(plan).segments:
        if seg.kind != "question":
            engine.cache_ids(seg.token_ids)
    full = engine.prefill(BlendPlan(PASSAGES, QUESTION, mode=Mode.FULL_PREFILL), max_new_tokens=1)
    blend = engine.prefill(BlendPlan(PASSAGES, QUESTION, mode=Mode.BLEND, recompute_ratio=0.15))
    token = int(full.logits.argmax())
    decode = engine.decode_step(full.cache, token)  # [V]
    return {"full": full.logits.float().cpu(), "blend": blend.logits.float().cpu(), "decode": decode.float().cpu()}


def _layers(setup: Setup, runner_factory: RunnerFactory) -> dict:
    fmt = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(setup.dtype, "fp16")
    on_device = _paths(runner_factory(str(setup.device), setup.dtype, LAYERS), fmt)
    on_cpu = _paths(runner_factory("cpu", setup.dtype, LAYERS), fmt)
    found = {}
    for path in ("full", "blend", "decode"):
        verdict = compare(on_cpu[path], on_device[path], setup.dtype)
        found[f"{path}_kl"] = verdict.kl
        if not verdict.passed:
            raise PreflightFailed(f"layers: {path} on {setup.device} differs from the CPU beyond {setup.dtype} "
                                  f"rounding (KL {verdict.kl:.2e}, same top-1: {verdict.same_top1})")
    return found
