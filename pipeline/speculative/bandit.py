"""What a policy conditions on (`Context`) and answers (`Decision`), and `EpsilonGreedy`, the
`seed` and `plausible` policies every other builds on. Pure. Arms are hashable ids (`arms.Arm`).

Every arm is pulled `warmup_pulls` times in order; then with probability
eps_t = max(floor, start * decay**t) (t: decisions after warm-up) an arm is explored, else the
best mean reward is exploited. `explore="uniform"` (`seed`) explores any arm; `"plausible"`
only arms whose mean + `z` standard errors reaches the best mean (one reward: pooled spread).
"""

from __future__ import annotations

import math
import random
import threading
from bisect import bisect_right
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class Context:
    """What a policy knows before a request runs; loop figures are None without a step loop."""

    prompt_tokens: int = 0
    queue_depth: int = 0  # other requests in the batch or waiting to join it
    rows: int = 1  # rows in the batch once this one joins, itself included
    # Measured curves ((n, seconds), ...): target pass vs tokens fed; draft / head pass vs rows.
    step_cost: tuple[tuple[float, float], ...] | None = None
    draft_cost: tuple[tuple[float, float], ...] | None = None
    draft_rows: int = 0  # rows drafting with the draft model now (without this one)
    head_cost: tuple[tuple[float, float], ...] | None = None
    head_rows: float = 0.0  # rows drafting with the head now (without this one; `head_rows`)
    parallel_cost: tuple[tuple[float, float], ...] | None = None  # one parallel draft pass
    parallel_rows: int = 0  # rows drafting with the parallel draft now (without this one)
    # What the other rows of that batch feed and commit per step (None: rows - 1 plain rows).
    others_fed: float | None = None
    others_tokens: float | None = None
    # What the other rows' proposals add to every step (`drafting_seconds`).
    others_drafting: float = 0.0
    temperature: float = 0.0  # the request's sampling temperature (acceptance falls as it rises)
    alone_cost: tuple[tuple[float, float], ...] | None = None  # the step curve for one row


TEMPERATURE_BUCKETS = (1e-5, 0.5, 1.0)  # greedy, below 0.5, 0.5 to 1, 1 and above


def temperature_bucket(context: Context | None) -> int:
    return 0 if context is None else bisect_right(TEMPERATURE_BUCKETS, context.temperature)


def strategy_of(arm) -> str:
    """The strategy part of an arm id: "draft:4" -> "draft"; 0 / "0" -> "" (no drafting)."""
    text = str(arm)
    return text.partition(":")[0] if ":" in text else ("" if text == "0" else "draft")


@dataclass(frozen=True)
class Decision:
    arm: Hashable
    explored: bool
    warmup: bool
    epsilon: float
    means: dict
    counts: dict
    fallback: bool = False  # the drift guard held this request to plain generation
    probe: bool = False  # the drift guard's probe after a cool-down: the best speculative arm
    cell: tuple = ()  # the contextual policy's cell (empty: no context)
    deferred: bool = False  # plain won at this load: the arm it runs alone, gated step by step


class EpsilonGreedy:
    """Thread-safe epsilon-greedy bandit, RNG injected; defaults are the `bandit` config's."""

    def __init__(
        self,
        arms: list[int],
        rng: random.Random,
        warmup_pulls: int = 1,
        epsilon_start: float = 0.3,
        epsilon_floor: float = 0.05,
        epsilon_decay: float = 0.97,
        explore: str = "plausible",
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
        self.m2 = {a: 0.0 for a in self.arms}  # weighted sum of squared deviations (Welford)
        self.weights = {a: 0.0 for a in self.arms}  # sum of the rewards' weights
        self.t = 0  # decisions taken after warm-up
        self.warmup_issued = 0  # warm-up decisions handed out (rewards may still be pending)
        self.rewarm: list = []  # forgotten arms to pull again before exploiting (`forget`)
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
        # An arm with one reward borrows the others' pooled spread.
        dof = sum(n - 1 for n in self.counts.values() if n > 1)
        pooled = math.sqrt(sum(map(self._ss, self.arms)) / dof) if dof else None
        out = []
        for a in self.arms:
            n = self.counts[a]
            if n == 0 or (n == 1 and pooled is None):
                out.append(a)
                continue
            stderr = math.sqrt(self._ss(a) / (n - 1) / n) if n > 1 else pooled
            if self.means[a] + self.z * stderr >= best:
                out.append(a)
        return out

    def forget(self, arms) -> None:
        """Drop what was learnt about `arms`; pull each `warmup_pulls` times again first."""
        arms = [a for a in self.arms if a in set(arms)]
        with self._lock:
            for a in arms:
                self.counts[a], self.means[a], self.m2[a], self.weights[a] = 0, 0.0, 0.0, 0.0
            self._forget_more(arms)
            self.rewarm = [a for _ in range(self.warmup_pulls) for a in arms]

    def _forget_more(self, arms) -> None:
        pass

    def _warmup_arm(self) -> Hashable | None:
        """Under the lock: the next warm-up arm, then a forgotten one; None when none is left."""
        if self.warmup_issued < self.warmup_pulls * len(self.arms):
            self.warmup_issued += 1
            return self.arms[(self.warmup_issued - 1) % len(self.arms)]
        return self.rewarm.pop(0) if self.rewarm else None

    def choose(self, context: Context | None = None) -> Decision:
        with self._lock:
            if (arm := self._warmup_arm()) is not None:
                return self._decision(arm, explored=True, warmup=True, eps=1.0)
            eps = self.epsilon()
            explored = self.rng.random() < eps
            arm = self.rng.choice(self.candidates()) if explored else self.best_arm()
            self.t += 1
            return self._decision(arm, explored=explored, warmup=False, eps=eps)

    def _decision(self, arm: int, explored: bool, warmup: bool, eps: float) -> Decision:
        return Decision(arm, explored, warmup, eps, dict(self.means), dict(self.counts))

    def update(
        self,
        arm: Hashable,
        reward: float,
        context: Context | None = None,
        acceptance: float | None = None,
        weight: float = 1.0,
    ) -> None:
        """Record one reward (tokens/s). `weight` = latency makes the mean total tokens over total
        time; 1.0, the mean of rates. Context-free policies ignore `context` and `acceptance`."""
        if weight <= 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if arm not in self.counts:
            raise ValueError(f"unknown arm {arm}; arms are {self.arms}")
        with self._lock:
            self._add(arm, reward, weight)

    def _add(self, arm, reward: float, weight: float = 1.0) -> None:
        """Weighted incremental mean and spread (West's weighted Welford)."""
        self.counts[arm] += 1
        self.weights[arm] += weight
        delta = reward - self.means[arm]
        self.means[arm] += delta * weight / self.weights[arm]
        self.m2[arm] += weight * delta * (reward - self.means[arm])

    def _ss(self, arm) -> float:
        """The arm's sum of squared deviations in units of one reward (m2 with unit weights)."""
        w = self.weights[arm]
        return self.m2[arm] / w * self.counts[arm] if w > 0 else 0.0

    # --- persistence -------------------------------------------------------------------------
    def state(self) -> dict:
        with self._lock:
            return {
                "arms": self.arms,
                "counts": {str(a): n for a, n in self.counts.items()},
                "means": {str(a): m for a, m in self.means.items()},
                "m2": {str(a): v for a, v in self.m2.items()},
                "weights": {str(a): v for a, v in self.weights.items()},
                "t": self.t,
                "warmup_issued": self.warmup_issued,
                "rewarm": [str(a) for a in self.rewarm],
            }

    def load_state(self, state: dict) -> None:
        """Adopt a saved state; raises ValueError when it does not fit these arms."""
        key = {str(a): a for a in self.arms}  # saved keys are text; arms may be ids or ints
        if sorted(map(str, state["arms"])) != sorted(key):
            raise ValueError(f"saved arms {state['arms']} differ from configured {self.arms}")
        counts = {key[str(a)]: int(n) for a, n in state["counts"].items()}
        means = {key[str(a)]: float(m) for a, m in state["means"].items()}
        if set(counts) != set(self.arms) or set(means) != set(self.arms):
            raise ValueError("saved counts/means do not cover the arms")
        if any(n < 0 for n in counts.values()) or int(state["t"]) < 0:
            raise ValueError("negative counts in saved state")
        m2 = {key[str(a)]: float(v) for a, v in state.get("m2", {}).items()} or {
            a: 0.0 for a in self.arms
        }
        weights = {key[str(a)]: float(v) for a, v in state.get("weights", {}).items()}
        with self._lock:
            self.counts, self.means, self.m2 = counts, means, {a: m2.get(a, 0.0) for a in self.arms}
            self.weights = {a: weights.get(a, float(counts[a])) for a in self.arms}
            self.t = int(state["t"])
            self.warmup_issued = int(state.get("warmup_issued", sum(counts.values())))
            self.rewarm = [key[str(a)] for a in state.get("rewarm", []) if str(a) in key]
