"""Loading controller: the recompute ratio at which recomputing layer i hides loading layer i+1.

Grounded in measurement (CacheBlend section 5.3):

- compute: per layer, t(n) = fixed + n * per_token for n tokens computed at that layer, fitted
  (decayed least squares) from the engine's per-layer times and sizes (CUDA events on CUDA,
  perf_counter on the CPU); priors until observations arrive;
- load: per layer, bytes_per_layer / bandwidth. The bandwidth is the whole path's, per tier: the
  tier's delivery into the staging buffer (its read counters: the disk tier's read and checksum,
  the memory tier's copy into staging; a pinned memory tier and the device tier deliver in place)
  plus the upload to the device (the packer's measured host-to-device time per byte, reported
  through the store; none for the device tier), mixed by the share of bytes each tier served. The
  engine's reports (whole-path load time per layer) stand in when the store has no tier counters;
- start-up estimates: `calibrate` (one seam) is called once, when the controller is built, and
  returns `PathCosts` measured on the engine's device (`transfer.calibrate`: a small staged read,
  copy and upload, a small layer forward at two sizes); they price what has not been measured yet.
  Without it, CPU-scale constants;
- the schedule: every layer up to the check layer computes all N tokens; from the check layer on
  the forced tokens (uncached: the question, passages that missed the cache, EPIC sinks) plus
  ratio x multiplier of the cached passage tokens, narrowed at the schedule's layers. Passages
  that missed the cache are uncached work, not cached tokens, and move no bytes.

`choose` picks the smallest ratio >= floor (up to cap) whose selected layers each take at least
one layer's load; the prefill then costs about load_0 + sum_i max(compute_i, load_i+1). When even
that is slower than full prefill (sum_i t(N)), it answers `full_prefill=True`: the engine then
serves the request by full prefill and says so (`ratio_source` "controller:full_prefill").
A fallback is not forever: after `probe_every` full-prefill answers in a row the next request is
served by blend anyway (a probe), so the load and compute estimates are measured again (a tier
that got faster, a page cache that warmed up) instead of staying at what made blend lose.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blend_engine.scheduler.admission import moving_average
from blend_engine.scheduler.budget import PrefillWork

if TYPE_CHECKING:
    from blend_engine.kv_store.base import KVStore

logger = logging.getLogger(__name__)

PRIOR_BANDWIDTH = 1.0e9  # bytes/s: a local SSD or page cache
PRIOR_TOKEN_LAYER_S = 30e-6  # seconds per token per layer: a ~100M model on a few CPU cores
PRIOR_LAYER_FIXED_S = 0.0  # seconds per layer whatever its size (kernel launches, norms, the python loop)
PRIOR_UPLOAD_S_PER_BYTE = 0.0  # without a calibration: the read counters alone (the CPU packs in place)
_FAST = float("inf")
_GRID = 0.01  # ratio resolution


@dataclass(frozen=True)
class PathCosts:
    """Start-up estimates of the load path and of compute on the engine's device, measured once.
    Seconds per byte of each leg of the path; seconds per layer of compute (fixed and per token)."""

    storage_read_s: float  # a storage tier's (disk) read into the staging buffer, checksum included
    stage_s: float  # the memory tier's copy into the staging buffer (0 when it is pinned: DMA in place)
    upload_s: float  # staging buffer to the device (the CPU: the packer's copy into the compute dtype)
    layer_fixed_s: float
    token_layer_s: float

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not value >= 0:  # also NaN
                raise ValueError(f"PathCosts.{name} must be >= 0 seconds, got {value}")

    def read_s(self, kind: str) -> float:
        """Seconds per byte of a tier of this kind's delivery into staging, before it is measured."""
        return {"device": 0.0, "memory": self.stage_s}.get(kind, self.storage_read_s)


@dataclass(frozen=True)
class RatioChoice:
    """The controller's answer: a ratio, or full prefill (loading is slower than recomputing)."""

    ratio: float
    full_prefill: bool = False
    predicted_ms: float = 0.0  # the blend prefill at `ratio`, as the model predicts it
    full_prefill_ms: float = 0.0  # full prefill, as the model predicts it


@dataclass(frozen=True)
class ControllerState:
    """A snapshot for stats endpoints. Plain numbers only."""

    bandwidth: float
    token_layer_s: float
    tier_bandwidth: dict
    observations: int
    last_ratio: float
    layer_fixed_s: float = 0.0
    full_prefill_choices: int = 0


class _LinearFit:
    """Decayed least squares of t = a + b n (per-layer compute seconds vs tokens)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.s = [0.0] * 5  # sum 1, n, n^2, t, n t

    def add(self, pairs: list[tuple[int, float]]) -> None:
        self.s = [x * (1 - self.decay) for x in self.s]
        for n, t in pairs:
            for i, v in enumerate((1.0, n, n * n, t, n * t)):
                self.s[i] += v

    def solve(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) or None before any data."""
        s0, s1, s2, sy, sxy = self.s
        if s0 <= 0 or s1 <= 0:
            return None
        det = s0 * s2 - s1 * s1
        if det > 1e-9 * s0 * s2:
            b = (s0 * sxy - s1 * sy) / det
            a = (sy - b * s1) / s0
            if a >= 0 and b > 0:
                return a, b
        return 0.0, max(sy / s1, 1e-12)  # one size only (or a negative intercept): proportional


class BandwidthController:
    """Implements the engine's `RatioController` protocol. Thread-safe."""

    def __init__(self, floor: float = 0.15, cap: float = 0.5, alpha: float = 0.3,
                 prior_bandwidth: float = PRIOR_BANDWIDTH, prior_token_layer_s: float = PRIOR_TOKEN_LAYER_S,
                 prior_layer_fixed_s: float = PRIOR_LAYER_FIXED_S, probe_every: int = 16,
                 calibrate: Callable[[], PathCosts] | None = None) -> None:
        if not 0 <= floor <= cap <= 1:
            raise ValueError(f"need 0 <= floor <= cap <= 1, got floor={floor}, cap={cap}")
        self.floor, self.cap, self.alpha = floor, cap, alpha
        self._lock = threading.Lock()
        self._bandwidth: float | None = None  # effective, from reports
        self.calibration = calibrate() if calibrate is not None else None  # once, at start-up
        if self.calibration is not None:
            c = self.calibration
            logger.info("controller start-up estimates: storage read %.2f GB/s, staging copy %s, upload %s, "
                        "layer %.3f ms + %.2f us/token", _gbps(c.storage_read_s), _gbps_text(c.stage_s),
                        _gbps_text(c.upload_s), c.layer_fixed_s * 1e3, c.token_layer_s * 1e6)
            prior_bandwidth = 1.0 / (c.storage_read_s + c.upload_s) if c.storage_read_s + c.upload_s > 0 else _FAST
            prior_layer_fixed_s, prior_token_layer_s = c.layer_fixed_s, c.token_layer_s
        self._prior_bandwidth = prior_bandwidth
        self._upload_prior = self.calibration.upload_s if self.calibration else PRIOR_UPLOAD_S_PER_BYTE
        self._prior = (prior_layer_fixed_s, prior_token_layer_s)
        self._fit = _LinearFit(alpha)
        self._tier_bw: dict[str, float] = {}  # whole path (delivery into staging + upload), bytes/s
        self._tier_read: dict[str, float] = {}  # delivery into staging, seconds per byte (measured)
        self._tier_kind: dict[str, str] = {}
        self._tier_seen: dict[str, tuple[int, float]] = {}
        self._tier_share: dict[str, float] = {}
        self._upload: float | None = None  # seconds per byte, measured
        self._upload_seen = (0, 0.0)
        self._observations = 0
        self._full_prefill = 0
        self._fallbacks = 0  # full-prefill answers since blend last ran
        self.probe_every = probe_every  # 0: never probe
        self._last_ratio = floor

    # ------------------------------------------------------------------ estimates
    def _update_tiers(self, store: KVStore) -> None:
        """Fold the tiers' read counters and the store's upload counters (bytes, seconds) since the
        last look into the estimates."""
        stats = store.stats()
        self._update_upload(stats.extra)
        deltas: dict[str, int] = {}
        tiers = [(t["name"], t.get("kind", "storage"), t["bytes_read"], t["read_seconds"])
                 for t in stats.extra.get("tiers", [])] or \
            [(stats.name, stats.extra.get("kind", "storage"), stats.bytes_read, stats.read_seconds)]
        for name, kind, bytes_read, read_seconds in tiers:
            self._tier_kind[name] = kind
            seen_b, seen_s = self._tier_seen.get(name, (0, 0.0))
            db, ds = bytes_read - seen_b, read_seconds - seen_s
            self._tier_seen[name] = (bytes_read, read_seconds)
            if db <= 0:
                continue
            deltas[name] = db
            self._tier_read[name] = moving_average(self._tier_read.get(name), max(ds, 0.0) / db, self.alpha)
        for name in self._tier_read:
            cost = self._tier_read[name] + self._upload_cost(self._tier_kind.get(name, "storage"))
            self._tier_bw[name] = 1.0 / cost if cost > 0 else _FAST
        total = sum(deltas.values())
        if total:
            for name in set(self._tier_share) | set(deltas):
                self._tier_share[name] = moving_average(self._tier_share.get(name), deltas.get(name, 0) / total, self.alpha)

    def _update_upload(self, extra: dict) -> None:
        """The packer's host-to-device time per byte, as the layer streams reported it to the store."""
        seen_b, seen_s = self._upload_seen
        b, sec = extra.get("upload_bytes", 0), extra.get("upload_seconds", 0.0)
        self._upload_seen = (b, sec)
        if b > seen_b:
            self._upload = moving_average(self._upload, max(sec - seen_s, 0.0) / (b - seen_b), self.alpha)

    def _upload_cost(self, kind: str) -> float:
        """Seconds per byte to move a tier's bytes from staging to the device (none from the device tier)."""
        if kind == "device":
            return 0.0
        return self._upload if self._upload is not None else self._upload_prior

    def _unmeasured_bw(self, name: str) -> float:
        """A tier that has served a share but no bytes yet (gone quiet): its kind's start-up estimate."""
        kind = self._tier_kind.get(name, "storage")
        read = self.calibration.read_s(kind) if self.calibration else (1.0 / self._prior_bandwidth)
        cost = read + self._upload_cost(kind)
        return 1.0 / cost if cost > 0 else _FAST

    def _tier_bandwidth(self) -> float | None:
        """Harmonic mix of tier bandwidths weighted by the share of bytes each served."""
        if not self._tier_share:
            return None
        seconds_per_byte = sum(share / self._tier_bw.get(name, self._unmeasured_bw(name))
                               for name, share in self._tier_share.items())
        return 1.0 / seconds_per_byte if seconds_per_byte > 0 else _FAST

    def estimate(self) -> tuple[float, float]:
        """(bandwidth bytes/s, seconds per token-layer of recompute)."""
        with self._lock:
            bw, (_, per_token) = self._estimate()
            return bw, per_token

    def _estimate(self) -> tuple[float, tuple[float, float]]:
        bw = self._tier_bandwidth() or self._bandwidth or self._prior_bandwidth
        return bw, self._fit.solve() or self._prior

    # ------------------------------------------------------------------ protocol
    def choose(self, work: PrefillWork, store: KVStore) -> RatioChoice:
        with self._lock:
            try:
                self._update_tiers(store)
            except Exception as exc:  # stats are advisory; fall back on the other estimates
                logger.warning("controller could not read store stats: %s", exc)
            bw, cost = self._estimate()
            choice = self._probe(self.plan(work, bw, cost))
            self._last_ratio = choice.ratio
            self._full_prefill += choice.full_prefill
            return choice

    def _probe(self, choice: RatioChoice) -> RatioChoice:
        """After `probe_every` fallbacks in a row, serve this request by blend (lock held)."""
        if not choice.full_prefill:
            self._fallbacks = 0
            return choice
        self._fallbacks += 1
        if not self.probe_every or self._fallbacks <= self.probe_every:
            return choice
        self._fallbacks = 0
        logger.info("controller: blend again after %d full prefills, to measure it anew", self.probe_every)
        return dataclasses.replace(choice, full_prefill=False)

    def plan(self, work: PrefillWork, bandwidth: float, cost: tuple[float, float]) -> RatioChoice:
        """The choice for `work` under a bandwidth (bytes/s) and per-layer cost (fixed s, s per token)."""
        fixed, per_token = cost
        full_s = work.n_layers * (fixed + per_token * work.n_tokens)
        if work.n_cached <= 0 or work.bytes_per_layer <= 0:
            return RatioChoice(self.floor, predicted_ms=full_s * 1e3, full_prefill_ms=full_s * 1e3)
        load = 0.0 if bandwidth == _FAST else work.bytes_per_layer / bandwidth
        steps = int(round((self.cap - self.floor) / _GRID))
        grid = [self.floor + i * _GRID for i in range(steps)] + [self.cap]
        best = None
        for ratio in grid:
            compute = [fixed + per_token * n for n in work.tokens_per_layer(ratio)]
            total = load + sum(max(c, load if i + 1 < work.n_layers else 0.0) for i, c in enumerate(compute))
            best = (ratio, total)
            if all(c >= load for c in compute[:-1]):  # every load hidden behind the layer before it
                break
        ratio, total = best
        return RatioChoice(ratio, full_prefill=total >= full_s, predicted_ms=total * 1e3,
                           full_prefill_ms=full_s * 1e3)

    def observe(self, report, bytes_per_layer: int, compute: bool = True) -> None:
        """Learn from one report: load bandwidth (blend) and, when `compute`, the per-layer compute
        cost (any mode; not from a prefill whose layers shared their pass with other rows: their
        times count those rows too)."""
        n_layers = len(report.layer_load_ms)
        with self._lock:
            self._observations += 1
            if n_layers and report.load_ms > 0 and bytes_per_layer > 0:
                bw = bytes_per_layer * n_layers / (report.load_ms / 1e3)
                self._bandwidth = moving_average(self._bandwidth, bw, self.alpha)
            pairs = [(n, t / 1e3) for n, t in zip(report.selected_per_layer, report.layer_compute_ms)]
            if len(pairs) > 1:
                pairs = pairs[:-1]  # the last layer runs attention and the MLP for one position only
            if pairs and compute:
                self._fit.add(pairs)

    def state(self) -> ControllerState:
        with self._lock:
            bw, (fixed, per_token) = self._estimate()
            return ControllerState(bw, per_token, dict(self._tier_bw), self._observations, self._last_ratio,
                                   fixed, self._full_prefill)


def _gbps(s_per_byte: float) -> float:
    return 1e-9 / s_per_byte if s_per_byte > 0 else float("inf")


def _gbps_text(s_per_byte: float) -> str:
    return "in place" if s_per_byte <= 0 else f"{_gbps(s_per_byte):.2f} GB/s"
