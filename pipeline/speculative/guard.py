"""The drift guard: falls back to plain generation when speculation stops paying. Pure: rewards
in, a hold or a probe out; `serving.policy.Policy` consults it before the bandit chooses.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DriftGuard:
    """Falls back to plain generation when speculation stops paying.

    `observe` takes every bandit request's outcome: plain (arm 0) rewards fill one window,
    rewards of speculative arms the bandit chose to exploit fill the other. When the speculative
    window holds `min_samples` and its mean is below the plain window's mean by more than
    `margin` (a fraction), the guard falls back for `cooldown` requests (`hold()` is then True),
    then clears the speculative window and probes (`probe()` is then True: the caller runs the
    best speculative arm by the bandit's means): the next `min_samples` speculative requests
    either recover (event "recovered") or fall back again with twice the cool-down (at most
    8x). Thread-safe; events are returned to the caller."""

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
        """Whether this request should probe speculation: after a cool-down, at most
        `min_samples` requests, which the window then judges."""
        with self._lock:
            if not self.probing or self.remaining > 0 or self.probes >= self.min_samples:
                return False
            self.probes += 1
            return True

    def observe(self, plain: bool, exploited: bool, reward: float) -> dict | None:
        """One bandit request's tokens/s. Returns an event dict ("fallback" or "recovered",
        with both windows' means) when the state changed, else None."""
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
        """Forget the speculative window and any fall-back (a new draft model gets a fresh
        chance); the plain window stays, plain generation has not changed."""
        with self._lock:
            self.spec.clear()
            self.remaining, self.fallbacks, self.probing = 0, 0, False

    def _push(self, window: deque, reward: float) -> None:
        window.append(reward)
        while len(window) > self.window:
            window.popleft()
