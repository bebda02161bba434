"""The drift guard (`DriftGuard`), consulted by `serving.policy.Policy`. Pure."""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DriftGuard:
    """Falls back to plain generation when speculation stops paying. Thread-safe.

    Plain rewards fill one window, exploited speculative rewards the other. With `min_samples`
    speculative and a mean below plain's by more than `margin`, it holds `cooldown` requests
    plain (`hold()`), then probes (`probe()`: the caller runs the best speculative arm) for
    `min_samples` requests: "recovered", or a fallback with twice the cool-down (at most 8x)."""

    window: int = 8
    margin: float = 0.2
    cooldown: int = 10
    min_samples: int = 3
    spec: deque = field(default_factory=deque)
    plain: deque = field(default_factory=deque)
    remaining: int = 0  # requests left in the cool-down
    fallbacks: int = 0
    probing: bool = False
    probes: int = 0  # probe decisions handed out in this probe
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def active(self) -> bool:
        return self.remaining > 0

    def hold(self) -> bool:
        """Whether this request must run plain (and counts one request of the cool-down)."""
        with self._lock:
            if self.remaining <= 0:
                return False
            self.remaining -= 1
            if self.remaining == 0:
                self.spec.clear()
                self.probing, self.probes = True, 0
            return True

    def probe(self) -> bool:
        """Whether this request probes speculation (after a cool-down, at most `min_samples`)."""
        with self._lock:
            if not self.probing or self.remaining > 0 or self.probes >= self.min_samples:
                return False
            self.probes += 1
            return True

    def observe(self, plain: bool, exploited: bool, reward: float) -> dict | None:
        """One bandit request's tokens/s; returns a "fallback"/"recovered" event dict, or None."""
        with self._lock:
            if plain:
                self._push(self.plain, reward)
                return None
            if not exploited or self.remaining > 0:
                return None
            self._push(self.spec, reward)
            if len(self.spec) < self.min_samples or not self.plain:
                return None
            spec, base = statistics.fmean(self.spec), statistics.fmean(self.plain)
            figures = {"speculative_tps": spec, "plain_tps": base, "margin": self.margin}
            if spec < base * (1 - self.margin):
                self.fallbacks += 1
                self.remaining = self.cooldown * min(8, 2 ** (self.fallbacks - 1))
                self.probing = False
                self.spec.clear()
                return {"event": "fallback", "cooldown_requests": self.remaining, **figures}
            if self.probing:
                self.probing, self.fallbacks = False, 0
                return {"event": "recovered", **figures}
            return None

    def reset_speculative(self) -> None:
        """Forget the speculative window and any fallback (a new draft); the plain window stays."""
        with self._lock:
            self.spec.clear()
            self.remaining, self.fallbacks, self.probing = 0, 0, False

    def _push(self, window: deque, reward: float) -> None:
        window.append(reward)
        while len(window) > self.window:
            window.popleft()
