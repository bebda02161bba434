"""Epsilon-greedy choice of the draft arm per request, and the drift guard. Pure: arms and
rewards, no models.

Arms are any hashable ids (the server's are `arms.Arm` texts: 0, draft:K, ngram:K).

Schedule: every arm is pulled `warmup_pulls` times first, in order; then with probability
eps_t = max(floor, start * decay**t) (t = decisions after warm-up) an arm is explored,
otherwise the arm with the best running-average reward is exploited. Means are updated
incrementally: r_a <- r_a + (r - r_a) / n_a.

`explore="uniform"` (the seed's policy) explores any arm at random; `explore="plausible"`
(policy `plausible`, the default) explores only among arms that could still be the best: those
whose mean plus `z` standard errors reaches the best arm's mean (an arm with one reward uses
the arms' pooled spread; without one, and with no reward, it qualifies). Arms that are clearly slower stop costing exploration time, which is
what keeps the bandit close to the best single arm when one arm dominates.

`ContextualBandit` (policy `contextual`) is the plausible policy with context: the caller passes
a `Context` (prompt length, queue depth) to `choose` and `update`, and each arm's value in a
context cell (prompt-length bucket x load bucket x that arm's strategy's recent-acceptance
bucket x temperature bucket) is its mean there shrunk towards its global mean, (n_c m_c + w m) / (n_c + w), so a cell
with few rewards behaves like the context-free policy and warm-up stays one pull per arm.

`DriftGuard` watches the rewards: when the speculative arm the bandit exploits delivers less
than plain generation by a margin over a window, it holds the bandit to arm 0 for a cool-down,
then probes: the next requests run the best speculative arm (by the bandit's means) until
the window can judge it again.
"""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..workspace import atomic_write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Context:
    """What the policy may condition on, known before a request runs: the request, and the
    batch it joins (the step loop's figures; None where there is no loop, e.g. a replay)."""

    prompt_tokens: int = 0
    queue_depth: int = 0  # other requests in the batch or waiting to join it
    rows: int = 1  # rows in the batch once this one joins, itself included
    # Measured curves, ((n, seconds), ...) ascending (`step_seconds` reads them): a target pass
    # against tokens fed, a draft pass against rows drafted for.
    step_cost: tuple[tuple[float, float], ...] | None = None
    draft_cost: tuple[tuple[float, float], ...] | None = None
    draft_rows: int = 0  # rows drafting with the draft model now (without this one)
    # One EAGLE-3 head pass against rows in it (eagle rows draft together, their reads of their
    # states in one pass).
    head_cost: tuple[tuple[float, float], ...] | None = None
    head_rows: float = 0.0  # rows drafting with the head now (without this one; `head_rows`)
    # What the other rows of that batch feed and commit per step (None: rows - 1 plain rows).
    others_fed: float | None = None
    others_tokens: float | None = None
    # What the other rows' proposals add to every step: their draft-model passes and head
    # passes (`drafting_seconds`), which a plain row waits for as much as a guessing one.
    others_drafting: float = 0.0
    temperature: float = 0.0  # the request's sampling temperature (acceptance falls as it rises)
    alone_cost: tuple[tuple[float, float], ...] | None = None  # the step curve for one row


TEMPERATURE_BUCKETS = (1e-5, 0.5, 1.0)  # greedy, below 0.5, 0.5 to 1, 1 and above


def temperature_bucket(context: Context | None) -> int:
    return 0 if context is None else bisect_right(TEMPERATURE_BUCKETS, context.temperature)


def step_seconds(curve: tuple[tuple[float, float], ...], n: float) -> float:
    """Seconds of a pass of size `n` on a measured curve ((n, seconds) points, ascending):
    linear between points; below the first, the first's time; past the last, the larger of the
    last segment's slope and time proportional to size (what was not measured is not assumed
    cheap: a loaded batch measures only its plain steps, and the flat stretch of a CPU pass below
    it would price every guess beyond them at almost nothing)."""
    if not curve:
        raise ValueError("no measured points")
    (x0, y0) = curve[0]
    if n <= x0:
        return y0
    for (x1, y1), (x2, y2) in zip(curve, curve[1:], strict=False):
        if n <= x2:
            return y1 + (y2 - y1) * (n - x1) / max(x2 - x1, 1e-9)
    xl, yl = curve[-1]
    proportional = yl * n / max(xl, 1e-9)
    if len(curve) == 1:
        return proportional
    xp, yp = curve[-2]
    return max(proportional, yl + max(0.0, (yl - yp) / max(xl - xp, 1e-9)) * (n - xl))


def per_step(rows) -> tuple[float, float]:
    """What the step loop's `rows` (`batch.Row`: rounds, proposed, accepted, arm.k) feed the
    target and commit per step, summed: each row's own means so far (a row that has not
    stepped yet: its k guesses fed, one token committed)."""
    fed = tokens = 0.0
    for r in rows:
        n = r.rounds
        fed += 1 + (r.proposed / n if n else r.arm.k)
        tokens += 1 + (r.accepted / n if n else 0.0)
    return fed, tokens


def shared_passes(curve, guesses) -> float:
    """Seconds of the batched passes that give each row its `guesses` (one pass per position
    over the rows still guessing; `curve`: a pass against rows in it)."""
    ks = sorted((g for g in guesses if g > 0), reverse=True)
    seconds = done = 0.0
    for m in range(len(ks), 0, -1):  # the passes over m rows: up to the m-th longest guess
        passes = ks[m - 1] - done
        if passes > 0:
            seconds += passes * step_seconds(curve, m)
            done = ks[m - 1]
    return seconds


def guessing_share(r) -> float:
    """The share of a step loop row's (`batch.Row`) steps it guessed in so far (not stepped
    yet: every step)."""
    return min(1.0, r.guess_rounds / r.rounds) if r.rounds else 1.0


def head_rows(rows) -> float:
    """The EAGLE-3 rows of `rows` (`batch.Row`) that share the head's passes, each weighted by
    the share of steps it guesses in: a row the gate holds back reads nothing and shares no
    pass. (Counted whole, four held-back eagle rows priced a fifth's head at a pass's growth
    from four rows to five, where it would run its passes alone.)"""
    return sum(guessing_share(r) for r in rows if r.hcache is not None)


def drafting_seconds(rows, draft_cost, head_cost) -> float:
    """Seconds a step of the step loop's `rows` (`batch.Row`) spends on their proposals, from
    the loop's curves (`Context.draft_cost`, `head_cost`; None: not measured, 0): the draft
    model's rows share one batched pass per position, each over the rows still guessing, and
    so do the EAGLE-3 rows (their reads of their states are one pass over them all, their
    first guess; `Eagle3Head.draft_many`); prompt lookup is free. Each row's guesses per step
    are its own mean so far, over every step (not stepped yet: its k): a row the gate holds
    back in most steps adds little. (Charged a read every step, such rows showed the policy
    a head the batch did not pay for, and a guess beside them looked cheaper than it was.)"""

    def guesses(r) -> float:
        return r.proposed / r.rounds if r.rounds else float(r.arm.k)

    seconds = 0.0
    if head_cost:
        seconds += shared_passes(head_cost, [guesses(r) for r in rows if r.hcache is not None])
    if draft_cost:
        seconds += shared_passes(draft_cost, [guesses(r) for r in rows if r.dslot is not None])
    return seconds


def added_passes(curve, rows: float, passes: float) -> float:
    """What a row adds to `passes` batched passes that `rows` other rows make already: each
    pass's growth from `rows` to `rows` + 1 (alone: the whole pass). `rows` may be a fraction
    (rows that share only some passes, `head_rows`): between its two whole neighbours."""

    def grown(n: int) -> float:
        return step_seconds(curve, n + 1) - (step_seconds(curve, n) if n else 0.0)

    lo = int(rows)
    w = rows - lo
    return passes * max(0.0, (1 - w) * grown(lo) + (w * grown(lo + 1) if w else 0.0))


@dataclass(frozen=True)
class StepRow:
    """What the per-step gate (`GoodputBandit.step_caps`) sees of one row of a step."""

    arm: str
    k: int  # the most it could guess this step (its arm's k, less what its budget leaves)
    adaptive: bool  # the bandit's row: the gate caps its guesses; else the caller's arm
    fed: float = 1.0  # its mean tokens fed a step so far (a fixed row is priced at these)
    tokens: float = 1.0  # ... and committed
    temperature: float = 0.0


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
    """Thread-safe epsilon-greedy bandit with an injected RNG. Its defaults are the `bandit`
    config section's (tested); servers build it from the config (`serving.make_bandit`)."""

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
        # An arm with one reward borrows the spread of the others (pooled), so a warm-up of
        # one pull per arm is enough to rule out a clearly slower arm.
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
        """Drop what was learnt about `arms` (a new draft model makes the draft arms' rewards
        stale) and pull each of them `warmup_pulls` times again before exploiting."""
        arms = [a for a in self.arms if a in set(arms)]
        with self._lock:
            for a in arms:
                self.counts[a], self.means[a], self.m2[a], self.weights[a] = 0, 0.0, 0.0, 0.0
            self._forget_more(arms)
            self.rewarm = [a for _ in range(self.warmup_pulls) for a in arms]

    def _forget_more(self, arms) -> None:
        pass

    def _warmup_arm(self) -> Hashable | None:
        """Under the lock: the next warm-up arm (every arm in turn), then any forgotten arm to
        pull again; None once there is none."""
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
        """Record one reward (output tokens/s). `weight`: the request's latency makes an arm's
        mean its total tokens over its total time (what the bench and the server deliver),
        1.0 the mean of per-request rates. The context-free policies ignore `context` and
        `acceptance` (the request's draft acceptance, None when nothing was proposed)."""
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


PROMPT_BUCKETS = (128, 256, 512)  # prompt tokens: <128, 128-255, 256-511, 512+
LOAD_BUCKETS = (1, 4)  # other requests: 0, 1-3, 4+
ACCEPTANCE_BUCKETS = (0.15, 0.35)  # a strategy's recent acceptance: low, mid, high


def strategy_of(arm) -> str:
    """The strategy part of an arm id: "draft:4" -> "draft"; 0 / "0" -> "" (no drafting)."""
    text = str(arm)
    return text.partition(":")[0] if ":" in text else ("" if text == "0" else "draft")


class ContextualBandit(EpsilonGreedy):
    """Plausible-exploration epsilon-greedy whose values depend on the context cell (module
    docstring). `prior_weight` is w: how many in-cell rewards weigh as much as the global mean;
    `acceptance_alpha` the weight of the latest request in a strategy's recent acceptance."""

    def __init__(self, arms, rng, *args, prior_weight: float = 4.0, acceptance_alpha=0.3, **kw):
        kw.setdefault("explore", "plausible")
        super().__init__(arms, rng, *args, **kw)
        self.prior_weight = prior_weight
        self.acceptance_alpha = acceptance_alpha
        self.recent_acceptance: dict[str, float] = {}  # strategy -> moving average
        self.cells: dict[tuple, list[float]] = {}  # (arm, cell) -> [count, mean]

    def cell(self, arm, context: Context | None) -> tuple:
        if context is None:
            return ()
        acc = self.recent_acceptance.get(strategy_of(arm))
        return (
            bisect_right(PROMPT_BUCKETS, context.prompt_tokens),
            bisect_right(LOAD_BUCKETS, context.queue_depth),
            -1 if acc is None else bisect_right(ACCEPTANCE_BUCKETS, acc),
            temperature_bucket(context),
        )

    def value(self, arm, context: Context | None) -> float:
        n, _, m = self.cells.get((arm, self.cell(arm, context)), (0, 0.0, 0.0))
        w = self.prior_weight
        return (n * m + w * self.means[arm]) / (n + w) if n else self.means[arm]

    def choose(self, context: Context | None = None) -> Decision:
        with self._lock:
            if (arm := self._warmup_arm()) is not None:
                return self._decision(arm, True, True, 1.0, context)
            eps = self.epsilon()
            explored = self.rng.random() < eps
            values = {a: self.value(a, context) for a in self.arms}
            if explored:
                arm = self.rng.choice(self.candidates())
            else:
                arm = max(self.arms, key=lambda a: (values[a], -self.arms.index(a)))
            self.t += 1
            return self._decision(arm, explored, False, eps, context, values)

    def _decision(self, arm, explored, warmup, eps, context=None, values=None) -> Decision:
        return Decision(
            arm,
            explored,
            warmup,
            eps,
            dict(values or self.means),
            dict(self.counts),
            cell=self.cell(arm, context),
        )

    def update(self, arm, reward, context=None, acceptance=None, weight=1.0) -> None:
        if arm not in self.counts:
            raise ValueError(f"unknown arm {arm}; arms are {self.arms}")
        with self._lock:
            key = (arm, self.cell(arm, context))  # the cell the decision was taken in
            self._add(arm, reward, weight)
            if context is not None:
                n, w, m = self.cells.get(key, (0, 0.0, 0.0))
                self.cells[key] = [n + 1, w + weight, m + (reward - m) * weight / (w + weight)]
            s = strategy_of(arm)
            if s and acceptance is not None:
                old = self.recent_acceptance.get(s, acceptance)
                a = self.acceptance_alpha
                self.recent_acceptance[s] = (1 - a) * old + a * acceptance

    def _forget_more(self, arms) -> None:
        gone = set(arms)
        self.cells = {k: v for k, v in self.cells.items() if k[0] not in gone}
        for s in {strategy_of(a) for a in arms}:
            self.recent_acceptance.pop(s, None)

    def state(self) -> dict:
        out = super().state()
        with self._lock:
            out["cells"] = [[str(a), list(c), *v] for (a, c), v in self.cells.items()]
            out["recent_acceptance"] = dict(self.recent_acceptance)
        return out

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        key = {str(a): a for a in self.arms}
        cells = {
            (key[a], tuple(c)): [int(n), float(w), float(m)]
            for a, c, n, w, m in state.get("cells", [])
        }
        acc = {str(s): float(v) for s, v in state.get("recent_acceptance", {}).items()}
        with self._lock:
            self.cells, self.recent_acceptance = cells, acc


class GoodputBandit(EpsilonGreedy):
    """The arm with the best predicted goodput at the load the request joins (policy `goodput`).

    Goodput is what the batch commits per second. A request joins a batch whose other rows feed
    F_o tokens and commit R_o tokens a step (the context's; without them, rows - 1 plain rows:
    F_o = R_o = rows - 1). With the step loop's measured curves (S(x): a whole step, proposals,
    target pass and acceptance, draft passes excepted, feeding x tokens; D(m): a draft pass for
    m rows; H(m): an EAGLE-3 head pass for m rows; `step_seconds`), arm s:k is predicted at

        tokens(s:k) = 1 + sum_{i<k} P_s[i]       P_s[i]: share of s's rounds that could guess
                                                  at position i whose guesses 1..i+1 were all
                                                  accepted
        step(s:k)   = sum_{j<=k} (Q_s[j-1] - Q_s[j]) * S(F_o + 1 + j)
                                                  Q_s[i]: share of them that guessed there
                                                  (Q_s[-1] = 1, Q_s[k] = 0): the step
                                                  priced per number of guesses j
        draft(s:k)  = [s = draft] * k * (D(1) if no other row drafts, else D(m + 1) - D(m))
                      + [s = eagle] * k * (H(1) if no other row uses the head, else
                                           H(m + 1) - H(m))
                                                  (the eagle rows read their states in one
                                                  pass, then share a pass per guess; m: the
                                                  other eagle rows weighted by the share of
                                                  steps they guess in, `head_rows`)
        goodput     = (R_o + tokens) / (step + P_o + draft)
                                                  (arm 0: (R_o + 1) / (S(F_o + 1) + P_o))

    with P_o what the other rows' proposals add to every step (`drafting_seconds`: a row beside
    an EAGLE-3 row waits for its head whatever it runs itself; leaving P_o out priced a plain
    row beside one at the target pass alone, and at 2 rows sent the second request to plain
    where two eagle:2 rows commit more, measured on the AMD EPYC).

    The step is priced per number of guesses, not at the mean feed: a pass's time is flat for
    a few tokens, then grows, and prompt lookup guesses all its k or none (no match). At its
    mean feed (1.8 guesses for ngram:4 in the bench) its steps looked as cheap as an eagle:2
    row's, while two in five of them fed 5 tokens; at 2 clients it got 13 of 32 requests, and
    the bandit read 1.05x target-only where eagle:2 for every request read 1.23x (AMD EPYC).

    Where plain wins beside other rows but a speculative arm would win alone, the request
    still gets that arm (`Decision.deferred`), and the step loop's gate (`step_caps`) caps its
    guesses each step at what pays at that batch: none, or fewer than its k, at a full batch;
    all of them once the batch has thinned towards the request alone. (The speculative arm
    best at the crowded load instead gave prompt lookup to 33 of 48 requests at 4 clients,
    guessing in 16% of steps at acceptance 0.18: 0.94x and 0.99x target-only in two runs,
    against 1.00x and 1.04x with the strategy that wins alone; AMD EPYC.) A plain arm is for
    the request's whole life, so a choice of plain beside a plain row made the next request's
    choice beside it plain too: at 2 clients a guess beside a plain row gained 3% and two
    guessing rows 1.12-1.20x (AMD EPYC, eagle:2), and two plain rows stayed plain until one was
    explored. Deferred, the gate judges the rows guessing together, which is the batch's
    choice.

    This is the batch's goodput with this row in it: a row's guesses are charged at their
    marginal cost, the time they add to every row's step. One client (R_o = F_o = 0): a pass of a few tokens
    costs about one token's, and drafting pays as far as acceptance carries it. Beside n - 1
    plain rows the row's extra tokens are a 1/n gain to the batch, against what its guesses add
    to the whole step: on a CPU, where a pass grows with every token past a few, the policy
    drafts less as rows grow, then not at all. (A per-row share of the step, the previous rule,
    priced a row's guesses at a 1/n part of what they cost the rows beside it, and kept prompt
    lookup at 16 rows where it lost a fifth of the batch's throughput.) Acceptance is learnt
    per strategy, position and temperature bucket from
    every request (it does not depend on the load, nor on k for a greedy proposer; it falls as
    the temperature rises: a bucket not measured yet borrows the greedy figures), so what one
    client taught holds at sixteen, with no exploration per load. The counts decay (`decay` per
    round) so a drifting draft is followed. Warm-up and exploration are the plausible policy's: every arm in
    turn, then with probability epsilon an arm whose prediction is within `explore_margin` of
    the best (an arm predicted clearly slower at this load is never explored there). Without
    the loop's figures in the context it falls back to the measured means (plausible policy)."""

    def __init__(
        self, arms, rng, *args, explore_margin: float = 0.1, decay: float = 0.998,
        speculate_margin: float = 0.05, margin_per_row: float = 0.0, **kw,
    ):  # fmt: skip
        super().__init__(arms, rng, *args, **kw)
        self.explore_margin = explore_margin
        self.speculate_margin = speculate_margin
        self.margin_per_row = margin_per_row
        self.decay = decay
        self.top = max((int(str(a).partition(":")[2] or 0) for a in self.arms), default=0)
        # strategy -> [rounds that could guess at position i..., proposed at i..., accepted at i...]
        self.positions: dict[str, list[float]] = {}

    def _stats(self, key: str) -> list[float]:
        return self.positions.setdefault(key, [0.0] * (3 * self.top))

    @staticmethod
    def _key(strategy: str, context: Context | None) -> str:
        """Acceptance is kept per strategy and temperature bucket: `ngram`, `ngram@2`, ..."""
        b = temperature_bucket(context)
        return f"{strategy}@{b}" if b else strategy

    def predict(self, arm, context: Context | None) -> float | None:
        """Predicted goodput (tokens/s) of `arm` at this context; None: not known yet."""
        if context is None or context.step_cost is None:
            return None
        n = max(1, context.rows)
        fed_o = n - 1 if context.others_fed is None else context.others_fed
        tokens_o = n - 1 if context.others_tokens is None else context.others_tokens
        s, k = strategy_of(arm), int(str(arm).partition(":")[2] or 0)
        if not s or k == 0:
            plain = step_seconds(context.step_cost, fed_o + 1) + context.others_drafting
            return (tokens_o + 1) / max(plain, 1e-9)
        # Acceptance at this temperature; until it is measured, the greedy figures stand in.
        st = self.positions.get(self._key(s, context)) or self.positions.get(s)
        top = self.top
        if st is None or any(st[i] <= 0 for i in range(min(k, top))):
            return None  # a position this arm guesses at was never measured
        elig, prop, acc = st[:top], st[top : 2 * top], st[2 * top :]
        tokens = 1 + sum(acc[i] / elig[i] for i in range(k))
        # The whole batch's step, per number of guesses (class docstring), and the other rows'
        # proposals.
        cost, last = context.others_drafting, 1.0  # last: the share that guessed j or more
        for j in range(k + 1):
            more = min(last, prop[j] / elig[j]) if j < k else 0.0  # ... j + 1 or more
            cost += (last - more) * step_seconds(context.step_cost, fed_o + 1 + j)
            last = more
        if s == "draft" and context.draft_cost is not None:
            cost += added_passes(context.draft_cost, context.draft_rows, k)
        if s == "eagle" and context.head_cost is not None:  # its read and guesses: shared
            cost += added_passes(context.head_cost, context.head_rows, k)
        return (tokens_o + tokens) / max(cost, 1e-9)

    def seed(self, prior: dict[str, tuple[list, list, list]], rounds: float) -> list[str]:
        """Start from acceptance measured elsewhere (the bench: `drafts.bench_prior`).
        `prior[key]`: (rounds that could guess at position i, proposed at i, accepted at i) per
        strategy key (`_key`: `eagle`, `ngram@2`, ...), scaled to weigh at most `rounds` rounds
        (the counts decay as live rounds come, so live requests soon outweigh it). Keys with
        figures already (a restored state) and strategies no arm uses are left alone. Returns
        the keys seeded."""
        used = {strategy_of(a) for a in self.arms}
        seeded = []
        with self._lock:
            for key, (elig, prop, acc) in prior.items():
                if key in self.positions or key.partition("@")[0] not in used:
                    continue
                if not elig or elig[0] <= 0:
                    continue
                scale = min(1.0, rounds / elig[0])
                st = self._stats(key)
                for part, values in enumerate((elig, prop, acc)):
                    for i, x in enumerate(values[: self.top]):
                        st[part * self.top + i] = scale * float(x)
                seeded.append(key)
        return seeded

    def _known(self, arm, context: Context) -> bool:
        """Whether `arm` needs no warm-up pull at this context: a speculative arm whose
        acceptance is known (a prior, or earlier requests) and whose every cost the loop has
        measured (a step at least as long as it feeds; the draft pass or the head, if it uses
        one). Plain is always pulled: the drift guard compares with it."""
        s, k = strategy_of(arm), int(str(arm).partition(":")[2] or 0)
        if not s or k == 0 or self.predict(arm, context) is None:
            return False
        if max(x for x, _ in context.step_cost) < 1 + k:
            return False
        if s == "draft" and context.draft_cost is None:
            return False
        return not (s == "eagle" and context.head_cost is None)

    def choose(self, context: Context | None = None) -> Decision:
        if context is None or context.step_cost is None:
            return super().choose(context)  # no loop figures: the measured means decide
        with self._lock:
            while (arm := self._warmup_arm()) is not None:
                if not self._known(arm, context):
                    return self._decision(arm, True, True, 1.0, context)
            values = {a: self.predict(a, context) for a in self.arms}
            known = {a: v for a, v in values.items() if v is not None}  # arm 0 always is
            eps = self.epsilon()
            explored = self.rng.random() < eps
            allowed = self._allowed(values, context)
            known = {a: v for a, v in known.items() if a in allowed}
            if not known:  # no plain arm, and no acceptance measured yet: the measured means
                explored = False
                arm = max(allowed, key=lambda a: (self.means[a], -self.arms.index(a)))
            elif explored:  # an unknown arm, or one within the margin of the best prediction
                floor = (1 - self.explore_margin) * max(known.values())
                arm = self.rng.choice(
                    [a for a in allowed if values[a] is None or values[a] >= floor]
                )
            else:
                arm = max(known, key=lambda a: (known[a], -self.arms.index(a)))
            deferred = False
            spec = {a: v for a, v in values.items() if v is not None and strategy_of(a)}
            if context.rows > 1 and not explored and not strategy_of(arm) and spec:
                if (alone := self._alone(context)) is not None:  # capped per step
                    arm, deferred = alone, True
            self.t += 1
            return replace(self._decision(arm, explored, False, eps, context, values),
                           deferred=deferred)  # fmt: skip

    def _alone(self, context: Context):
        """The arm predicted best for this request alone (`Context.alone_cost`), if it is a
        speculative one; else None."""
        if context.alone_cost is None:
            return None
        alone = replace(context, rows=1, step_cost=context.alone_cost, draft_rows=0, head_rows=0,
                        others_fed=0.0, others_tokens=0.0, others_drafting=0.0)  # fmt: skip
        values = {a: v for a in self.arms if (v := self.predict(a, alone)) is not None}
        best = max(values, key=lambda a: (values[a], -self.arms.index(a)))
        return best if strategy_of(best) else None

    def guesses(self, arm, temperature: float = 0.0) -> list[tuple[float, float]] | None:
        """What a row of `arm` guesses and commits a step if it may guess at most j tokens,
        for j = 0..k: [(guesses fed, tokens committed), ...] from its strategy's acceptance
        at this temperature (until measured there, the greedy figures), as far as its positions
        were measured. None: plain, or not even its first position measured. Read under the
        lock (`step_values`)."""
        s, k = strategy_of(arm), int(str(arm).partition(":")[2] or 0)
        if not s or k == 0:
            return None
        ctx = Context(temperature=temperature)
        st = self.positions.get(self._key(s, ctx)) or self.positions.get(s)
        top = self.top
        if st is None or st[0] <= 0:
            return None
        out, fed, tokens = [(0.0, 1.0)], 0.0, 1.0
        for i in range(min(k, top)):
            if st[i] <= 0:  # never measured this far (a shorter arm, capped rows): up to here
                break
            fed += st[top + i] / st[i]
            tokens += st[2 * top + i] / st[i]
            out.append((fed, tokens))
        return out

    def step_caps(self, rows: list[StepRow], step_cost, draft_cost=None, head_cost=None):
        """The most tokens each row of a step may guess (the step loop asks every step, as
        SmartSpec and vLLM's dynamic speculation choose the draft length by the batch). Alone,
        or without the loop's figures: each row its arm's k (the arm was chosen for it).
        Beside other rows, one cap c for the adaptive rows (the bandit's) together, the c in
        0..k with the best predicted goodput of the whole step,

            goodput(c) = sum_r tokens_r(c) / (S(sum_r (1 + guesses_r(c))) + H + D)

        with S the step curve (at the mean feed, except that a prompt-lookup row guesses all
        its j or none, so the step is priced per number of its guesses, as `predict` does),
        H and D the head's and the draft model's shared passes (`shared_passes`) over the
        rows' guesses; an adaptive row at cap c guesses and
        commits what its strategy's acceptance predicts for min(k, c) guesses (`guesses`), a
        fixed row what it has so far. c > 0 must beat c = 0 by `margin(rows)`: a wrong guess
        costs every row.

        Together, because the rows share the passes: an EAGLE-3 row's head pass costs about
        the same for one row as for four, so judged one row at a time beside rows that do not
        guess, none paid for the first pass, and the rows sat out steps where all guessing
        paid 1.06-1.13x (4 clients, Intel Xeon). One cap, because more guesses a row cost every
        row at a full batch: judged all-or-nothing at each row's own k, eagle:4 rows guessed 4
        where 2 paid, and the batch read 0.97x target-only. Adaptive rows whose strategy has no
        measured acceptance sit out (they learn alone)."""
        full = [r.k for r in rows]
        if len(rows) <= 1 or step_cost is None:
            return full
        values, plans = self.step_values(rows, step_cost, draft_cost, head_cost)
        cap = max(range(len(values)), key=lambda c: (values[c], -c))
        if values[cap] < (1 + self.margin(len(rows))) * values[0]:
            cap = 0
        return [min(k, cap if plans[i] else 0) if i in plans else k for i, k in enumerate(full)]

    def step_values(self, rows: list[StepRow], step_cost, draft_cost=None, head_cost=None):
        """The predicted goodput of a step of `rows` with the adaptive rows capped at c, for c
        in 0..their largest k (`step_caps`), and each adaptive row's `guesses` (None: not
        known)."""
        with self._lock:
            plans = {i: self.guesses(r.arm, r.temperature) for i, r in enumerate(rows)
                     if r.adaptive and r.k > 0}  # fmt: skip
        top = max((min(rows[i].k, len(p) - 1) for i, p in plans.items() if p), default=0)

        def goodput(cap: int) -> float:
            fed = tokens = 0.0
            passes: dict[str, list[float]] = {"draft": [], "eagle": []}
            spread = [1.0]  # the chance of each number of prompt-lookup guesses beyond `fed`
            for i, r in enumerate(rows):
                if r.k == 0:  # it cannot guess this step (plain, or its budget's last token)
                    g, t = 0.0, 1.0
                elif i in plans:
                    p = plans[i]
                    j = min(cap, r.k, len(p) - 1) if p else 0
                    g, t = p[j] if p else (0.0, 1.0)
                    if strategy_of(r.arm) == "ngram" and j > 0:  # all its j guesses or none
                        share = g / j
                        spread = [(1 - share) * a + (share * spread[n - j] if n >= j else 0.0)
                                  for n, a in enumerate(spread + [0.0] * j)]  # fmt: skip
                        g = 0.0
                else:
                    g, t = r.fed - 1, r.tokens
                fed += 1 + g
                tokens += t
                passes.setdefault(strategy_of(r.arm), []).append(g)
            cost = sum(w * step_seconds(step_cost, fed + n) for n, w in enumerate(spread) if w)
            if head_cost:
                cost += shared_passes(head_cost, passes["eagle"])
            if draft_cost:
                cost += shared_passes(draft_cost, passes["draft"])
            return tokens / max(cost, 1e-9)

        return [goodput(c) for c in range(top + 1)], plans

    def margin(self, rows: int) -> float:
        """How far a guess must be predicted to beat plain beside other rows: `speculate_margin`
        at 2 rows, and `margin_per_row` more for every row past two. The prediction errs more
        the more rows a step holds, and towards guessing: on the AMD EPYC (serving_load, 1 to
        8 clients on one server), with a flat 5% the bandit read 1.14-1.17x target-only at 2
        clients but 0.92-0.94x at 4; with a flat 15%, 0.99-1.02x at 4 and 8 clients, but it
        stopped guessing at 2 (0.96x). A near-tie goes to plain: a wrong guess
        costs every row beside it."""
        return self.speculate_margin + self.margin_per_row * max(0, rows - 2)

    def _allowed(self, values: dict, context: Context) -> list:
        """The arms a request may get. Alone: all. Beside other rows: plain, and the speculative
        arms predicted to beat plain by `margin(rows)`; no arm is explored there whose
        acceptance is unknown (acceptance does not depend on the load: it is learnt alone)."""
        plain = next((a for a in self.arms if not strategy_of(a)), None)
        if context.rows <= 1 or plain is None or values.get(plain) is None:
            return list(self.arms)
        bar = (1 + self.margin(context.rows)) * values[plain]
        return [a for a in self.arms if a == plain or (values[a] is not None and values[a] >= bar)]

    def _decision(self, arm, explored, warmup, eps, context=None, values=None) -> Decision:
        shown = {a: v for a, v in (values or self.means).items() if v is not None}
        return Decision(arm, explored, warmup, eps, shown, dict(self.counts))

    def update(self, arm, reward, context=None, acceptance=None, weight=1.0, positions=None):
        """As the plausible policy's, plus `positions`: (rounds that could guess at each
        position, proposed at each, accepted at each) of the request, which teach its
        strategy's acceptance. (A number for the first: every position, as many rounds; a
        step loop row capped below its k by the gate could not guess past the cap, and counted
        there as a round that did not, it taught its strategy a shorter reach than it has.)"""
        super().update(arm, reward, context, acceptance, weight)
        s = strategy_of(arm)
        if not s or positions is None:
            return
        elig, prop, acc = positions
        k = min(len(prop), self.top)
        if isinstance(elig, (int, float)):
            elig = [elig] * k
        if k == 0 or not elig or elig[0] <= 0:
            return
        with self._lock:
            st = self._stats(self._key(s, context))
            keep = self.decay ** elig[0]
            for i in range(len(st)):
                st[i] *= keep
            top = self.top
            for i in range(k):
                st[i] += elig[i]
                st[top + i] += prop[i]
                st[2 * top + i] += acc[i]

    def _forget_more(self, arms) -> None:
        gone = {strategy_of(a) for a in arms}
        for key in [k for k in self.positions if k.partition("@")[0] in gone]:
            self.positions.pop(key)

    def state(self) -> dict:
        out = super().state()
        with self._lock:
            out["positions"] = {s: list(v) for s, v in self.positions.items()}
        return out

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        width = 3 * self.top
        positions = {
            str(s): [float(x) for x in v]
            for s, v in state.get("positions", {}).items()
            if len(v) == width
        }
        with self._lock:
            self.positions = positions


@dataclass
class DriftGuard:
    """Falls back to plain generation when speculation stops paying (module docstring).

    `observe` takes every bandit request's outcome: plain (arm 0) rewards fill one window,
    rewards of speculative arms the bandit chose to exploit fill the other. When the speculative
    window holds `min_samples` and its mean is below the plain window's mean by more than
    `margin` (a fraction), the guard falls back for `cooldown` requests (`hold()` is then True),
    then clears the speculative window and probes (`probe()` is then True: the caller runs the
    best speculative arm, since the slow rewards may have taught the bandit to stay plain): the
    next `min_samples` speculative requests either recover (event "recovered") or fall back
    again with twice the cool-down (at most 8x). Thread-safe; events are returned to the caller."""

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


def save_bandit(bandit: EpsilonGreedy, path: Path, extra: dict | None = None) -> None:
    """The bandit's state, plus the caller's `extra` fields (the draft it measured)."""
    atomic_write_json(path, {**bandit.state(), **(extra or {})})


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
