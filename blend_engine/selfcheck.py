"""The start-up fidelity gate: is blending safe on *this* model?

A small built-in probe (questions over passages read directly from the bundled sample corpus) is
answered in full_prefill, full_reuse and blend at the configured ratio on a private in-memory
store. For each probe the first-token distribution of full_reuse and blend is compared with a
reference: KL(reference || mode) and top-1 agreement, averaged over the probe. Blend passes when its
KL is at most `MAX_KL_FRACTION` (a quarter) of full reuse's: the repair must remove most of the
divergence that plain reuse leaves.

The gate judges the engine, not the dtype (issue #39). Full prefill and blend run different
attention kernels (causal SDPA over all rows vs the selected rows' masked attention), which round
differently in bf16 / fp16. So blend's reference is full prefill *through blend's own kernels*:
blend at ratio 1.0, which recomputes every token on the selected-rows path. That reference must in
turn equal plain full prefill within the compute dtype's tolerance (`TOLERANCES`: KL and the
resolution of a logit), or the engine is wrong and the gate fails (`kernels_agree`). Top-1
agreement counts a near-tie (the reference's top-2 margin within the dtype's resolution at that
logit's magnitude, `compare`) as agreement: rounding may flip it on a correct engine.

Blend must pass twice: on short passages (one sample document
each) and on long ones (`LONG_PROBES`: ~200-470-word passages of several documents, the chunk
sizes real corpora use, where blend's repair is weakest; issue #28). The result is cached per model fingerprint (JSON under the
data dir), so a restart skips the measurement.

Command line (exit 0 passed, 1 failed, 2 bad input)::

    python -m blend_engine.selfcheck [--model SPEC] [--ratio 0.15] [--kv-format fp16] [--data-dir data]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.cpu_threads import cores_here
from blend_engine.model.runner import ModelRunner
from blend_engine.steps import Steps, drain
from blend_engine.types import BlendPlan, Mode

logger = logging.getLogger(__name__)
RunStepped = Callable[[Callable[[], Steps]], object]  # `EngineLoop.run_stepped`

PROBE_VERSION = 3  # 2: the long-passage probe; 3: blend judged against blend@1.0, dtype tolerances
MAX_KL_FRACTION = 0.25  # blend passes when KL(blend) <= this x KL(full_reuse); calibrated on SmolLM2 (docs/models.md)
KL_FLOOR = 1e-6  # KLs below this count as exact (full reuse already exact: nothing to repair)
GATE_MODES = ("enforce", "warn", "off")
SAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "sample_corpus" / "hotpotqa_sample.jsonl"
CACHE_DIR_NAME = "fidelity"
# Intra-op threads for the measurement on CPU. One thread keeps the gate's time bounded on a shared
# CPU: on the 2-core dev machine under load, SmolLM2 took ~10 s with 1 thread and ~100 s with 2
# (OpenMP spin-waits against other processes). Restored afterwards.
GATE_THREADS = 1

# (passage titles in prompt order, question): short passages (the gate must stay within ~30 s on a
# 2-core CPU for SmolLM2), the answer never in the first passage.
PROBES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("Ethel Houbiers", "Dorothée Jemma", "Lisette Dufour", "Virginie Ledieu"),
     "Who is the French voice of Lisa Simpson?"),
    (("Wegelnburg", "Abergairn Castle", "Château de Longwy", "Scharfenstein Castle (Kiedrich)"),
     "Near which town in Aberdeenshire is Abergairn Castle?"),
    (("RAF Croft", "Croydon Airport", "Naval Submarine Base New London"),
     "Which airport was the main airport for London before Northolt Aerodrome replaced it?"),
)


@dataclass(frozen=True)
class Tolerance:
    """How far two logit vectors [V] computed in one dtype by two correct kernels may differ.

    `eps`: the dtype's machine epsilon (one unit in the last place at 1.0); `tie_ulps`: a top-2
    margin of at most this many units in the last place at the top logit's magnitude is a near-tie
    (kernels may order it either way); `kl`: the largest first-token KL between two correct kernels."""

    eps: float
    tie_ulps: float
    kl: float

    def resolution(self, logit: float) -> float:
        """The margin below which two logits near `logit` are a tie in this dtype."""
        return self.tie_ulps * self.eps * max(abs(logit), 1.0)


# KL bounds between two correct kernels, from measurements on the CPU (docs/results.md, "Fidelity gate by
# dtype"): full prefill vs blend@1.0 in bf16 gave 2.3e-3 .. 5.1e-3 nats on SmolLM2 (the gate's probes)
# and 1.4e-2 on the GPU check's 3-bit packed SmolLM2 (600 tokens); bf16's bound is about 2x the
# largest, still well below a wrong path (full reuse: 0.2 .. 0.95). fp16 has 3 more mantissa bits
# (8x finer steps, ~64x smaller KL); fp32 is exact up to summation order.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(eps=torch.finfo(torch.float32).eps, tie_ulps=64, kl=1e-5),
    torch.float16: Tolerance(eps=torch.finfo(torch.float16).eps, tie_ulps=4, kl=1e-3),
    torch.bfloat16: Tolerance(eps=torch.finfo(torch.bfloat16).eps, tie_ulps=4, kl=3e-2),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The tolerance of a compute dtype (the model's, not the logits' storage dtype: logits upcast
    to fp32 still carry the compute dtype's rounding). Raises ValueError on another dtype."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no fidelity tolerance for compute dtype {dtype}; known: {sorted(map(str, TOLERANCES))}") from None


@dataclass(frozen=True)
class Agreement:
    """`got`'s first token against a reference's: KL(reference || got) in nats, whether it picks the
    reference's token (`same_top1`), whether the reference's top two are a near-tie (`near_tie`,
    `margin` their gap), and whether its pick counts as agreeing (`top1_agrees`: the same token, or
    the reference's runner-up of a near-tie)."""

    kl: float
    same_top1: bool
    near_tie: bool
    margin: float
    top1_agrees: bool
    kl_ok: bool

    @property
    def passed(self) -> bool:
        return self.top1_agrees and self.kl_ok


def compare(ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> Agreement:
    """Two first-token logit vectors [V] of one prompt, computed in `dtype`, judged by its tolerance."""
    tol = tolerance(dtype)
    ref32, got32 = ref.float(), got.float()  # [V] each
    top = ref32.topk(2).values  # [2]
    best, margin = float(top[0]), float(top[0] - top[1])
    pick, want = int(got32.argmax()), int(ref32.argmax())
    tie = margin <= tol.resolution(best)
    agrees = pick == want or (tie and best - float(ref32[pick]) <= tol.resolution(best))
    kl = _kl(torch.log_softmax(ref32, dim=-1), torch.log_softmax(got32, dim=-1))
    return Agreement(kl, pick == want, tie, margin, agrees, kl <= tol.kl)


@dataclass(frozen=True)
class GateResult:
    """The probe's numbers. KLs are mean first-token KL(full_prefill || mode) in nats."""

    kl_blend: float
    kl_full_reuse: float
    top1_blend: float  # share of probes whose greedy first token equals full prefill's
    top1_full_reuse: float
    ratio: float
    max_kl_fraction: float
    passed: bool
    seconds: float
    probes: int
    key: str
    cached: bool = False
    # the long-passage probe (`LONG_PROBES`), judged by the same fraction
    kl_blend_long: float = 0.0
    kl_full_reuse_long: float = 0.0
    top1_blend_long: float = 0.0
    top1_full_reuse_long: float = 0.0
    probes_long: int = 0
    # blend's reference (blend@1.0, blend's kernels) against full prefill, over both probes: the
    # largest KL, and whether every prompt agreed within the compute dtype's tolerance
    kl_kernels: float = 0.0
    kernels_agree: bool = True
    dtype: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"fidelity gate {verdict}: first-token KL blend {self.kl_blend:.4f} vs full reuse "
                f"{self.kl_full_reuse:.4f} (limit {self.max_kl_fraction:g}x), top-1 agreement blend "
                f"{self.top1_blend:.2f} / full reuse {self.top1_full_reuse:.2f}; long passages: KL blend "
                f"{self.kl_blend_long:.4f} vs full reuse {self.kl_full_reuse_long:.4f}, top-1 "
                f"{self.top1_blend_long:.2f} / {self.top1_full_reuse_long:.2f}; ratio {self.ratio:g}, "
                f"{self.probes} + {self.probes_long} probes; blend@1.0 vs full prefill KL {self.kl_kernels:.2e} "
                f"({'within' if self.kernels_agree else 'OUTSIDE'} {self.dtype} tolerance); {self.seconds:.1f} s"
                f"{' (cached)' if self.cached else ''}")


@dataclass(frozen=True)
class GateDecision:
    """What the service does with a result: `fallback` = answer blend requests with full prefill."""

    mode: str  # enforce | warn | off
    result: GateResult | None  # None when the gate is off (or could not run: `error`)
    error: str | None = None

    @property
    def fallback(self) -> bool:
        return self.mode == "enforce" and self.result is not None and not self.result.passed

    @property
    def reason(self) -> str | None:
        if not self.fallback:
            return None
        r = self.result
        if not r.kernels_agree:
            return (f"full_prefill: blend at ratio 1.0 differs from full prefill beyond {r.dtype} rounding "
                    f"(KL {r.kl_kernels:.2e}): an engine fault, not a fidelity trade-off")
        return (f"full_prefill: blend failed the fidelity gate (KL {r.kl_blend:.4f} vs {r.max_kl_fraction:g} x "
                f"full reuse {r.kl_full_reuse:.4f}; long passages KL {r.kl_blend_long:.4f} vs full reuse "
                f"{r.kl_full_reuse_long:.4f})")

    def as_dict(self) -> dict:
        return {"gate": self.mode, "fallback": self.fallback, "reason": self.reason, "error": self.error,
                "result": None if self.result is None else self.result.as_dict()}

# Long passages: each passage is several sample documents (titles) joined as the grouping of
# `benchmarks.common.data.group_paragraphs` joins them; the answer is never in the first passage.
LONG_PROBES: tuple[tuple[tuple[tuple[str, ...], ...], str], ...] = (
    ((("Dubai International Airport", "Gatwick Airport", "Coimbatore International Airport",
       "Vancouver International Airport"),
      ("Grantley Adams International Airport", "Croydon Airport", "Chennai International Airport", "Dublin Airport"),
      ("Athens International Airport", "Heathrow Airport")),
     "Which airport was the main airport for London before Northolt Aerodrome replaced it?"),
    ((("Clun Castle", "Inch Castle", "Castillo de Tabernas", "Cairnburgh Castle", "Schauenberg"),
      ("Wegelnburg", "Isabella Kelly", "Scharfenstein Castle (Kiedrich)", "Abergairn Castle", "Château de Longwy")),
     "Near which town in Aberdeenshire is Abergairn Castle?"),
)
Probe = list[tuple[tuple[str, ...], str]]  # (passages, question) pairs


def _sample_texts(titles: set[str], path: Path) -> dict[str, str]:
    texts: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("title") in titles:
                texts.setdefault(rec["title"], rec["text"])
    missing = titles - texts.keys()
    if missing:
        raise ValueError(f"fidelity probe: {path} lacks passages {sorted(missing)}")
    return texts


def load_probe(path: Path = SAMPLE_CORPUS) -> Probe:
    """The short probe's (passages, question) pairs with passage texts from the sample corpus file."""
    texts = _sample_texts({t for titles, _ in PROBES for t in titles}, path)
    return [(tuple(_passage(texts[t], t) for t in titles), q) for titles, q in PROBES]


def load_long_probe(path: Path = SAMPLE_CORPUS) -> Probe:
    """The long probe: each passage the listed documents joined by a blank line."""
    texts = _sample_texts({t for groups, _ in LONG_PROBES for g in groups for t in g}, path)
    return [(tuple("\n\n".join(_passage(texts[t], t) for t in g) for g in groups), q) for groups, q in LONG_PROBES]


def _passage(text: str, title: str) -> str:
    """A titled passage as the service gives it to the engine (retrieval.text.format_passage, which
    blend_engine may not import)."""
    return f"{title.strip()}\n{text.strip()}"


def gate_key(runner: ModelRunner, config: EngineConfig) -> str:
    """Cache key: model fingerprint plus everything else the numbers depend on."""
    parts = {"model": runner.fingerprint, "dtype": str(runner.dtype), "device": runner.device.type,
             "kv_format": config.kv_format, "ratio": config.default_ratio, "policy": repr(config.policy),
             "system": config.system_prompt, "probe": PROBE_VERSION, "fraction": MAX_KL_FRACTION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """KL(ref || other) for log-probabilities [V]."""
    return float((ref_logp.exp() * (ref_logp - logp)).sum().clamp_min(0.0))


def _cache_segments(engine: BlendEngine, plan: BlendPlan) -> Steps[None]:
    """Store the alone-KV of the system prefix and every passage, as the service has them after use:
    one chunk a unit (on the calling thread: this engine's loop never starts)."""
    for seg in engine.layout(plan).segments:
        if seg.kind != "question":
            engine.chunks.cache_ids(seg.token_ids)
            yield


@dataclass(frozen=True)
class ProbeMeans:
    """One probe's means: per mode (blend, full_reuse) KL to its reference and top-1 agreement; the
    largest KL of blend@1.0 against full prefill and whether every prompt agreed within tolerance."""

    modes: dict[Mode, tuple[float, float]]
    kl_kernels: float = 0.0
    kernels_agree: bool = True


def _logits(engine: BlendEngine, passages: tuple[str, ...], question: str, mode: Mode,
            ratio: float | None = None) -> Steps[torch.Tensor]:
    """One prefill's first-token logits [V], a layer a unit."""
    plan = BlendPlan(passages, question, mode=mode, recompute_ratio=ratio)
    prep = engine.prepare(plan, 0)
    run = engine.start_run(plan, prep, 0)
    with torch.inference_mode():  # also when drained on a caller's thread (the loop's turns are in it)
        for _ in run.steps():
            yield
        return engine.complete_run(plan, prep, run).logits  # [V]


def _probe_means(engine: BlendEngine, probe: Probe, ratio: float) -> Steps[ProbeMeans]:
    """Per mode (blend, full_reuse): mean first-token KL to its reference and top-1 agreement over a
    probe. full_reuse's reference is full prefill; blend's is blend@1.0 (the same kernels), itself
    checked against full prefill within the compute dtype's tolerance. In fp32 (the CPU service)
    the two kernels agree to ~1e-7 nats (docs/results.md), so full prefill serves as both and the
    gate costs what it did before (three prefills per prompt)."""
    dtype = engine.runner.dtype
    kls: dict[Mode, list[float]] = {Mode.BLEND: [], Mode.FULL_REUSE: []}
    agree: dict[Mode, list[float]] = {Mode.BLEND: [], Mode.FULL_REUSE: []}
    kernels: list[Agreement] = []
    for passages, question in probe:
        yield from _cache_segments(engine, BlendPlan(passages, question))
        full = yield from _logits(engine, passages, question, Mode.FULL_PREFILL)  # [V]
        if dtype == torch.float32:  # the kernels agree to ~1e-7 nats in fp32: the extra prefill buys nothing
            same_kernels = full
        else:
            same_kernels = yield from _logits(engine, passages, question, Mode.BLEND, 1.0)  # [V]
            kernels.append(compare(full, same_kernels, dtype))
        for mode, ref in ((Mode.BLEND, same_kernels), (Mode.FULL_REUSE, full)):
            got = yield from _logits(engine, passages, question, mode, ratio if mode is Mode.BLEND else None)  # [V]
            verdict = compare(ref, got, dtype)
            kls[mode].append(verdict.kl)
            agree[mode].append(float(verdict.top1_agrees))
    n = max(len(probe), 1)
    return ProbeMeans({mode: (sum(kls[mode]) / n, sum(agree[mode]) / n) for mode in kls},
                      max((a.kl for a in kernels), default=0.0), all(a.passed for a in kernels))


def _passes(kl_blend: float, kl_full_reuse: float) -> bool:
    return kl_blend <= MAX_KL_FRACTION * kl_full_reuse + KL_FLOOR


def measure(runner: ModelRunner, config: EngineConfig, probe: Probe | None = None,
            long_probe: Probe | None = None) -> GateResult:
    """`measure_steps` run whole on this thread (the command line, tests)."""
    return drain(measure_steps(runner, config, probe, long_probe))


def measure_steps(runner: ModelRunner, config: EngineConfig, probe: Probe | None = None,
                  long_probe: Probe | None = None) -> Steps[GateResult]:
    """Run the short and the long probe on a private in-memory store (the service's store is never
    touched), a layer of one prefill (or one chunk cached) a unit: the service advances it on its
    engine loop between steps (`EngineLoop.run_stepped`), so the model has one thread."""
    t0 = time.perf_counter()
    probe = probe if probe is not None else load_probe()
    long_probe = long_probe if long_probe is not None else load_long_probe()
    engine = BlendEngine(runner, MemoryStore(1 << 30, kv_format=config.kv_format), config)
    short = yield from _probe_means(engine, probe, config.default_ratio)
    long = yield from _probe_means(engine, long_probe, config.default_ratio)
    (kl_b, top1_b), (kl_r, top1_r) = short.modes[Mode.BLEND], short.modes[Mode.FULL_REUSE]
    (kl_bl, top1_bl), (kl_rl, top1_rl) = long.modes[Mode.BLEND], long.modes[Mode.FULL_REUSE]
    kernels_agree = short.kernels_agree and long.kernels_agree
    return GateResult(
        kl_blend=kl_b, kl_full_reuse=kl_r, top1_blend=top1_b, top1_full_reuse=top1_r,
        ratio=config.default_ratio, max_kl_fraction=MAX_KL_FRACTION,
        passed=kernels_agree and _passes(kl_b, kl_r) and (not long_probe or _passes(kl_bl, kl_rl)),
        seconds=time.perf_counter() - t0, probes=len(probe), key=gate_key(runner, config),
        kl_blend_long=kl_bl, kl_full_reuse_long=kl_rl, top1_blend_long=top1_bl, top1_full_reuse_long=top1_rl,
        probes_long=len(long_probe), kl_kernels=max(short.kl_kernels, long.kl_kernels),
        kernels_agree=kernels_agree, dtype=str(runner.dtype).removeprefix("torch."),
    )


def cache_path(data_dir: Path, key: str) -> Path:
    return Path(data_dir) / CACHE_DIR_NAME / f"{key}.json"


def _read_cached(path: Path) -> GateResult | None:
    try:
        data = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(GateResult)}
        return GateResult(**{k: v for k, v in data.items() if k in names and k != "cached"}, cached=True)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:  # unreadable or from another version: measure again
        logger.warning("ignoring unreadable fidelity cache %s: %s", path, exc)
        return None


def _write_cached(path: Path, result: GateResult) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(result.as_dict(), indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only data dir only costs a re-measure on the next start
        logger.warning("could not cache the fidelity result in %s: %s", path, exc)
        tmp.unlink(missing_ok=True)


def _threads(n: int | None, device: torch.device) -> contextlib.AbstractContextManager:
    """`n` cores for this thread alone while measuring (the engine loop keeps its own)."""
    return cores_here(n) if n and device.type == "cpu" else contextlib.nullcontext()


def run_gate(runner: ModelRunner, config: EngineConfig, data_dir: Path | None, refresh: bool = False,
             threads: int | None = GATE_THREADS, run_stepped: RunStepped | None = None) -> GateResult:
    """The cached result for this model and configuration, or a fresh measurement (then cached):
    through `run_stepped` (the service's engine loop) when given, else on this thread with `threads` cores."""
    key = gate_key(runner, config)
    path = cache_path(data_dir, key) if data_dir is not None else None
    if path is not None and not refresh:
        cached = _read_cached(path)
        if cached is not None:
            return cached
    if run_stepped is not None:
        result = run_stepped(lambda: measure_steps(runner, config))
    else:
        with _threads(threads, runner.device):
            result = measure(runner, config)
    if path is not None:
        _write_cached(path, result)
    return result


def decide(mode: str, runner: ModelRunner, config: EngineConfig, data_dir: Path | None,
           run_stepped: RunStepped | None = None) -> GateDecision:
    """Run the gate per the operator's setting (enforce | warn | off) and log the outcome (`run_gate`)."""
    if mode not in GATE_MODES:
        raise ValueError(f"fidelity gate mode must be one of {', '.join(GATE_MODES)}, not {mode!r}")
    if mode == "off":
        logger.info("fidelity gate off: blend requests are served without a start-up check")
        return GateDecision(mode, None)
    result = run_gate(runner, config, data_dir, run_stepped=run_stepped)
    decision = GateDecision(mode, result)
    if result.passed:
        logger.info("%s", result.summary())
    elif decision.fallback:
        logger.warning("%s; blend requests will be answered with full prefill (set BLENDSERVE_ENGINE_FIDELITY_GATE=warn "
                       "to serve blend anyway)", result.summary())
    else:
        logger.warning("%s; serving blend anyway (BLENDSERVE_ENGINE_FIDELITY_GATE=warn)", result.summary())
    return decision


# ====================================================================== command line
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m blend_engine.selfcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model name or local folder (the service reads "
                   "BLENDSERVE_MODEL_NAME; this command reads only its flags)")
    p.add_argument("--ratio", type=float, default=0.15, help="blend recompute ratio (default 0.15, the floor)")
    p.add_argument("--kv-format", default="fp16", choices=["fp16", "fp32", "int8"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--data-dir", type=Path, default=None, help="read/write the cached result here")
    p.add_argument("--refresh", action="store_true", help="measure even when a cached result exists")
    p.add_argument("--threads", type=int, default=GATE_THREADS,
                   help=f"torch intra-op threads while measuring on CPU (default {GATE_THREADS}; 0 = torch default)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not 0 <= args.ratio <= 1:
        sys.stderr.write("--ratio must be within [0, 1]\n")
        return 2
    try:
        t0 = time.perf_counter()
        runner = ModelRunner.load(args.model, args.device, args.dtype)
        load_s = time.perf_counter() - t0
        result = run_gate(runner, EngineConfig(default_ratio=args.ratio, kv_format=args.kv_format), args.data_dir,
                          refresh=args.refresh, threads=args.threads or None)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"selfcheck: {exc}\n")
        return 2
    sys.stdout.write(json.dumps({**result.as_dict(), "model": args.model, "load_s": round(load_s, 2)}) + "\n")
    sys.stdout.write(result.summary() + "\n")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
