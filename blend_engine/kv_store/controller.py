"""Loading controller: pick the recompute ratio at which recompute hides the KV load.

Per layer, loading costs bytes_per_layer / bandwidth and recomputing r of the N cached tokens
costs about r * N * seconds_per_token_layer. The ratio that balances the two is free quality
(the load has to be waited for anyway), so the controller picks

    ratio = min(cap, max(floor, load_s / (N * seconds_per_token_layer)))

Bandwidth is a running (EWMA) estimate per tier, from the tiers' own read counters, combined by
the share of bytes each tier served recently; recompute speed is a running estimate from the
engine's per-layer compute times. Priors apply until the first observations arrive.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from blend_engine.kv_store.base import KVStore, StoreStats

logger = logging.getLogger(__name__)

PRIOR_BANDWIDTH = 1.0e9  # bytes/s: a local SSD or page cache
PRIOR_TOKEN_LAYER_S = 30e-6  # seconds per token per layer: a ~100M model on a few CPU cores
_FAST = float("inf")


@dataclass(frozen=True)
class ControllerState:
    """A snapshot for stats endpoints. Plain numbers only."""

    bandwidth: float
    token_layer_s: float
    tier_bandwidth: dict
    observations: int
    last_ratio: float


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class BandwidthController:
    """Implements the engine's `RatioController` protocol. Thread-safe."""

    def __init__(self, floor: float = 0.15, cap: float = 0.5, alpha: float = 0.3,
                 prior_bandwidth: float = PRIOR_BANDWIDTH, prior_token_layer_s: float = PRIOR_TOKEN_LAYER_S) -> None:
        if not 0 <= floor <= cap <= 1:
            raise ValueError(f"need 0 <= floor <= cap <= 1, got floor={floor}, cap={cap}")
        self.floor, self.cap, self.alpha = floor, cap, alpha
        self._lock = threading.Lock()
        self._bandwidth: float | None = None  # effective, from reports
        self._prior_bandwidth = prior_bandwidth
        self._token_layer_s: float | None = None
        self._prior_token_layer_s = prior_token_layer_s
        self._tier_bw: dict[str, float] = {}
        self._tier_seen: dict[str, tuple[int, float]] = {}
        self._tier_share: dict[str, float] = {}
        self._observations = 0
        self._last_ratio = floor

    # ------------------------------------------------------------------ estimates
    def _update_tiers(self, store: KVStore) -> None:
        """Fold the tiers' read counters (bytes, seconds) since the last look into the estimates."""
        stats = store.stats()
        tiers = [StoreStats(**{k: v for k, v in t.items() if k in StoreStats.__dataclass_fields__})
                 for t in stats.extra.get("tiers", [])] or [stats]
        deltas: dict[str, int] = {}
        for t in tiers:
            seen_b, seen_s = self._tier_seen.get(t.name, (0, 0.0))
            db, ds = t.bytes_read - seen_b, t.read_seconds - seen_s
            self._tier_seen[t.name] = (t.bytes_read, t.read_seconds)
            if db <= 0:
                continue
            deltas[t.name] = db
            bw = db / ds if ds > 0 else _FAST
            self._tier_bw[t.name] = bw if bw == _FAST else _ewma(self._tier_bw.get(t.name), bw, self.alpha)
        total = sum(deltas.values())
        if total:
            for name in set(self._tier_share) | set(deltas):
                self._tier_share[name] = _ewma(self._tier_share.get(name), deltas.get(name, 0) / total, self.alpha)

    def _tier_bandwidth(self) -> float | None:
        """Harmonic mix of tier bandwidths weighted by the share of bytes each served."""
        if not self._tier_share:
            return None
        seconds_per_byte = sum(share / self._tier_bw.get(name, self._prior_bandwidth)
                               for name, share in self._tier_share.items())
        return 1.0 / seconds_per_byte if seconds_per_byte > 0 else _FAST

    def estimate(self) -> tuple[float, float]:
        """(bandwidth bytes/s, seconds per token-layer of recompute)."""
        with self._lock:
            return self._estimate()

    def _estimate(self) -> tuple[float, float]:
        bw = self._bandwidth or self._tier_bandwidth() or self._prior_bandwidth
        return bw, self._token_layer_s or self._prior_token_layer_s

    # ------------------------------------------------------------------ protocol
    def choose(self, n_cached_tokens: int, n_layers: int, bytes_per_layer: int, store: KVStore) -> float:
        with self._lock:
            try:
                self._update_tiers(store)
            except Exception as exc:  # stats are advisory; fall back on the other estimates
                logger.warning("controller could not read store stats: %s", exc)
            bw, per_token = self._estimate()
            ratio = self.balance(n_cached_tokens, bytes_per_layer, bw, per_token)
            self._last_ratio = ratio
            return ratio

    def balance(self, n_cached_tokens: int, bytes_per_layer: int, bandwidth: float, token_layer_s: float) -> float:
        if n_cached_tokens <= 0 or bandwidth == _FAST:
            return self.floor
        load_s = bytes_per_layer / bandwidth
        even = load_s / (n_cached_tokens * token_layer_s)
        return min(self.cap, max(self.floor, even))

    def observe(self, report, bytes_per_layer: int) -> None:
        """Learn from one blend report: load bandwidth and recompute seconds per token-layer."""
        n_layers = len(report.layer_load_ms)
        with self._lock:
            self._observations += 1
            if n_layers and report.load_ms > 0:
                bw = bytes_per_layer * n_layers / (report.load_ms / 1e3)
                self._bandwidth = _ewma(self._bandwidth, bw, self.alpha)
            per_token = _token_layer_seconds(report)
            if per_token is not None:
                self._token_layer_s = _ewma(self._token_layer_s, per_token, self.alpha)

    def state(self) -> ControllerState:
        with self._lock:
            bw, per_token = self._estimate()
            return ControllerState(bw, per_token, dict(self._tier_bw), self._observations, self._last_ratio)


def _token_layer_seconds(report) -> float | None:
    """Seconds per recomputed token per layer, from the layers that recomputed a subset."""
    sizes, times = report.selected_per_layer, report.layer_compute_ms
    pairs = [(n, t) for n, t in zip(sizes, times) if 0 < n < report.context_tokens] or list(zip(sizes, times))
    tokens = sum(n for n, _ in pairs)
    if tokens <= 0:
        return None
    return sum(t for _, t in pairs) / 1e3 / tokens
