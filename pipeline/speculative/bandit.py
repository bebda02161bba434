"""Epsilon-greedy choice of the draft length per request. Pure: arms and rewards, no models.

Schedule (the seed's, and the default): every arm is pulled `warmup_pulls` times first, in
order; then with probability eps_t = max(floor, start * decay**t) (t = decisions after warm-up)
a uniformly random arm is explored, otherwise the arm with the best running-average reward is
exploited. Means are updated incrementally: r_a <- r_a + (r - r_a) / n_a.

`explore="plausible"` (optional) explores only among arms that could still be the best: those
whose mean plus `z` standard errors reaches the best arm's mean (arms with fewer than two
rewards always qualify). Arms that are clearly slower stop costing exploration time, which is
what keeps the bandit close to the best single arm when one arm dominates.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..workspace import atomic_write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    arm: int
    explored: bool
    warmup: bool
    epsilon: float
    means: dict[int, float]
    counts: dict[int, int]


class EpsilonGreedy:
    """Thread-safe epsilon-greedy bandit with an injected RNG."""

    def __init__(
        self,
        arms: list[int],
        rng: random.Random,
        warmup_pulls: int = 2,
        epsilon_start: float = 0.3,
        epsilon_floor: float = 0.05,
        epsilon_decay: float = 0.97,
        explore: str = "uniform",
        z: float = 2.0,
    ):
        if explore not in ("uniform", "plausible"):
            raise ValueError(f"explore must be 'uniform' or 'plausible', not {explore!r}")
        if not arms:
            raise ValueError("a bandit needs at least one arm")
        self.arms = list(arms)
        self.rng = rng
        self.warmup_pulls = warmup_pulls
        self.epsilon_start = epsilon_start
        self.epsilon_floor = epsilon_floor
        self.epsilon_decay = epsilon_decay
        self.explore = explore
        self.z = z
        self.counts = {a: 0 for a in self.arms}
        self.means = {a: 0.0 for a in self.arms}
        self.m2 = {a: 0.0 for a in self.arms}  # sum of squared deviations (Welford)
        self.t = 0  # decisions taken after warm-up
        self.warmup_issued = 0  # warm-up decisions handed out (rewards may still be pending)
        self._lock = threading.Lock()

    def epsilon(self) -> float:
        return max(self.epsilon_floor, self.epsilon_start * self.epsilon_decay**self.t)

    def best_arm(self) -> int:
        # Ties go to the first arm in config order: deterministic.
        return max(self.arms, key=lambda a: (self.means[a], -self.arms.index(a)))

    def candidates(self) -> list[int]:
        """Arms exploration may pick: all of them, or (plausible) those that may be the best."""
        if self.explore == "uniform":
            return self.arms
        best = self.means[self.best_arm()]
        out = []
        for a in self.arms:
            n = self.counts[a]
            if n < 2:
                out.append(a)
                continue
            stderr = math.sqrt(self.m2[a] / (n - 1) / n)
            if self.means[a] + self.z * stderr >= best:
                out.append(a)
        return out

    def choose(self) -> Decision:
        with self._lock:
            warm_total = self.warmup_pulls * len(self.arms)
            if self.warmup_issued < warm_total:
                arm = self.arms[self.warmup_issued % len(self.arms)]
                self.warmup_issued += 1
                return self._decision(arm, explored=True, warmup=True, eps=1.0)
            eps = self.epsilon()
            explored = self.rng.random() < eps
            arm = self.rng.choice(self.candidates()) if explored else self.best_arm()
            self.t += 1
            return self._decision(arm, explored=explored, warmup=False, eps=eps)

    def _decision(self, arm: int, explored: bool, warmup: bool, eps: float) -> Decision:
        return Decision(arm, explored, warmup, eps, dict(self.means), dict(self.counts))

    def update(self, arm: int, reward: float) -> None:
        if arm not in self.counts:
            raise ValueError(f"unknown arm {arm}; arms are {self.arms}")
        with self._lock:
            self.counts[arm] += 1
            delta = reward - self.means[arm]
            self.means[arm] += delta / self.counts[arm]
            self.m2[arm] += delta * (reward - self.means[arm])

    # --- persistence -------------------------------------------------------------------------
    def state(self) -> dict:
        with self._lock:
            return {
                "arms": self.arms,
                "counts": {str(a): n for a, n in self.counts.items()},
                "means": {str(a): m for a, m in self.means.items()},
                "m2": {str(a): v for a, v in self.m2.items()},
                "t": self.t,
                "warmup_issued": self.warmup_issued,
            }

    def load_state(self, state: dict) -> None:
        """Adopt a saved state; raises ValueError when it does not fit these arms."""
        if sorted(state["arms"]) != sorted(self.arms):
            raise ValueError(f"saved arms {state['arms']} differ from configured {self.arms}")
        counts = {int(a): int(n) for a, n in state["counts"].items()}
        means = {int(a): float(m) for a, m in state["means"].items()}
        if set(counts) != set(self.arms) or set(means) != set(self.arms):
            raise ValueError("saved counts/means do not cover the arms")
        if any(n < 0 for n in counts.values()) or int(state["t"]) < 0:
            raise ValueError("negative counts in saved state")
        m2 = {int(a): float(v) for a, v in state.get("m2", {}).items()} or {
            a: 0.0 for a in self.arms
        }
        with self._lock:
            self.counts, self.means, self.m2 = counts, means, {a: m2.get(a, 0.0) for a in self.arms}
            self.t = int(state["t"])
            self.warmup_issued = int(state.get("warmup_issued", sum(counts.values())))


def save_bandit(bandit: EpsilonGreedy, path: Path) -> None:
    atomic_write_json(path, bandit.state())


def load_bandit(bandit: EpsilonGreedy, path: Path) -> str:
    """Restore saved state if any. A corrupt file is set aside (renamed) and reported."""
    if not path.exists():
        return "fresh"
    try:
        bandit.load_state(json.loads(path.read_text()))
        return "restored"
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        path.rename(aside)
        log.warning(
            "bandit state %s is unusable (%s); set aside as %s, starting fresh", path, exc, aside
        )
        return "corrupt"
