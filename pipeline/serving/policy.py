"""The arm per request: the bandit, the drift guard, and the bandit's state file (written at most
every `save_every_s`, with the draft and head weights ids it measured: restored beside other
weights, their arms start over). No threads, no models; the clock is injected.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..config import BanditConfig
from ..speculative.arms import parse_arm
from ..speculative.bandit import Context, Decision, EpsilonGreedy
from ..speculative.contextual import ContextualBandit
from ..speculative.cost import per_step, step_seconds
from ..speculative.goodput import GoodputBandit, StepRow
from ..speculative.guard import DriftGuard
from ..workspace import atomic_write_json

log = logging.getLogger(__name__)


def short(weights: str | None) -> str:
    return (weights or "unrecorded")[:12]


def plain_rate(context: Context) -> float | None:
    """Tokens/s a plain row gets at this context's load (None: no cost figures)."""
    if context.step_cost is None:
        return None
    n = max(1, context.rows)
    return n / max(step_seconds(context.step_cost, n), 1e-9)


class Policy:
    def __init__(
        self,
        bandit: EpsilonGreedy,
        guard: DriftGuard | None = None,
        state_file: Path | None = None,
        save_every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        draft_weights: str | None = None,
        prior: tuple[dict, str] | None = None,
        prior_rounds: float = 0.0,
        head_weights: str | None = None,
    ):
        """`draft_weights`, `head_weights`: `core.served_weights`, kept in the state file. `prior`:
        `drafts.bench_prior`'s (acceptance, source), seeding a goodput bandit as `prior_rounds`."""
        self.bandit = bandit
        self.draft_weights = draft_weights
        self.head_weights = head_weights
        self.plain_arm = next((a for a in bandit.arms if parse_arm(a).k == 0), None)
        self.guard = guard if self.plain_arm is not None else None
        self.state_file = state_file
        self.save_every_s = save_every_s
        self.clock = clock
        self._saved_at = clock()
        self._dirty = False
        if state_file is not None:
            status = load_bandit(bandit, state_file)
            log.info("bandit state %s: %s", state_file, status)
            if status == "restored":
                self._check_draft(state_file)
        self.seeded: list[str] = []  # strategy keys the prior gave figures to
        if prior is not None and prior_rounds > 0 and isinstance(bandit, GoodputBandit):
            self.seeded = bandit.seed(prior[0], prior_rounds)
            if self.seeded:
                log.info("bandit: acceptance of %s from %s", ", ".join(self.seeded), prior[1])

    def _arms_of(self, draft: bool, head: bool) -> list:
        """The arms on the draft model (if `draft`: sequential or parallel) and on the head (if
        `head`)."""
        arms = [parse_arm(a) for a in self.bandit.arms]
        return [str(a) for a in arms
                if (draft and (a.needs_draft or a.needs_parallel)) or (head and a.needs_head)]  # fmt: skip

    def _check_draft(self, state_file: Path) -> None:
        """Forget the draft's or head's arms if the state measured other weights."""
        try:
            saved = json.loads(state_file.read_text())
        except (OSError, ValueError):
            return
        was = (saved.get("draft_weights"), saved.get("head_weights"))
        stale = self._arms_of(was[0] != self.draft_weights, was[1] != self.head_weights)
        if not stale:
            return
        log.warning(
            "bandit state %s measured draft weights %s and head %s; this server's are %s and "
            "%s: the statistics of %s start over",
            state_file, *(short(w) for w in (*was, self.draft_weights, self.head_weights)),
            ", ".join(stale),
        )  # fmt: skip
        self.bandit.forget(stale)
        self._dirty = True

    @property
    def arms(self) -> list:
        return self.bandit.arms

    def choose(self, context: Context) -> Decision:
        """The arm for a bandit request, unless the drift guard holds it to plain generation."""
        if self.guard is not None and self.guard.hold():
            return Decision(self.plain_arm, False, False, 0.0, {}, {}, fallback=True)
        if self.guard is not None and self.guard.probe():
            means = dict(self.bandit.means)
            spec = [a for a in self.bandit.arms if a != self.plain_arm]
            arm = max(spec, key=lambda a: (means[a], -self.bandit.arms.index(a)))
            return Decision(arm, False, False, 0.0, means, dict(self.bandit.counts), probe=True)
        return self.bandit.choose(context)

    def may_guess(
        self, rows: list, step_cost: tuple, draft_cost: tuple | None,
        head_cost: tuple | None = None, parallel_cost: tuple | None = None,
    ) -> list[int]:  # fmt: skip
        """Per row (`k_eff` set), the most it may guess this step: `GoodputBandit.step_caps`;
        other policies guess their k_eff."""
        if not isinstance(self.bandit, GoodputBandit) or len(rows) <= 1:
            return [r.k_eff for r in rows]
        view = []
        for r in rows:
            fed, tokens = per_step([r])
            view.append(StepRow(str(r.arm), r.k_eff, r.adaptive, fed, tokens,
                                r.sampling.temperature))  # fmt: skip
        return self.bandit.step_caps(view, step_cost, draft_cost, head_cost, parallel_cost)

    def reward(
        self, decision: Decision, result, context: Context, step_cost: tuple | None = None,
        rows: int | None = None,
    ) -> dict | None:  # fmt: skip
        """Teach the bandit one finished `CoreResult`; returns the guard's event, if any. The guard
        compares with plain at `rows` / `step_cost` (default: the context's, the load it joined)."""
        res = result.result
        reward = result.goodput
        weight = max(res.cost_s or res.latency_s, 1e-6)  # an arm's mean: its tokens over its time
        rounds = res.rounds if res.guess_rounds is None else res.guess_rounds
        elig = res.eligible_per_position
        positions = (rounds if elig is None else elig, res.proposed_per_position,
                     res.accepted_per_position)  # fmt: skip
        if isinstance(self.bandit, GoodputBandit):
            self.bandit.update(
                decision.arm, reward, context, res.acceptance, weight, positions=positions
            )
        else:
            self.bandit.update(decision.arm, reward, context, res.acceptance, weight)
        self._dirty = True
        self.save(force=False)
        load = replace(context, rows=rows or context.rows, step_cost=step_cost or context.step_cost)
        base = plain_rate(load)
        if self.guard is None or base is None:  # no cost figures yet: nothing to compare with
            return None
        figure = reward / base  # relative to plain at this load
        exploited = not (decision.explored or decision.warmup or decision.fallback)
        event = self.guard.observe(parse_arm(decision.arm).k == 0, exploited, figure)
        if event is not None:
            log.warning(
                "speculation %s: exploited speculative arms %.2f vs plain %.2f (goodput "
                "relative to plain at its load, margin %.0f%%)%s",
                event["event"],
                event["speculative_tps"],
                event["plain_tps"],
                100 * event["margin"],
                f"; plain generation for the next {event['cooldown_requests']} bandit "
                "requests, then a probe"
                if event["event"] == "fallback"
                else "; the bandit drafts again",
            )
        return event

    def forget_draft_arms(
        self, draft_weights: str | None = None, head_weights: str | None = None
    ) -> None:
        """A new draft: its arms start over, the head's too unless its weights id is known and
        unchanged; the guard forgets its speculative window."""
        same_head = head_weights is not None and head_weights == self.head_weights
        self.draft_weights, self.head_weights = draft_weights, head_weights
        self.bandit.forget(self._arms_of(True, not same_head))
        if self.guard is not None:
            self.guard.reset_speculative()
        self._dirty = True

    def save(self, force: bool = True) -> None:
        """Write the state file if it changed (and, unless `force`, `save_every_s` passed)."""
        if self.state_file is None or not self._dirty:
            return
        now = self.clock()
        if not force and now - self._saved_at < self.save_every_s:
            return
        try:
            weights = {"draft_weights": self.draft_weights, "head_weights": self.head_weights}
            save_bandit(self.bandit, self.state_file, weights)
            self._dirty, self._saved_at = False, now
        except OSError as exc:  # serving goes on; the next save tries again
            log.warning("bandit state %s not saved: %s", self.state_file, exc)


def make_bandit(
    b: BanditConfig, arms: list | None = None, policy: str | None = None, seed: int | None = None
) -> EpsilonGreedy:
    """A fresh, seeded bandit per the `bandit` section (`arms`, `policy`, `seed` override it)."""
    args = (arms or b.arms, random.Random(b.seed if seed is None else seed), b.warmup_pulls)
    kw = dict(
        epsilon_start=b.epsilon_start,
        epsilon_floor=b.epsilon_floor,
        epsilon_decay=b.epsilon_decay,
        z=b.z,
    )
    policy = policy or b.policy
    if policy == "contextual":
        return ContextualBandit(*args, prior_weight=b.prior_weight, **kw)
    if policy == "goodput":
        return GoodputBandit(
            *args, explore_margin=b.explore_margin, speculate_margin=b.speculate_margin,
            margin_per_row=b.speculate_margin_per_row, **kw,
        )  # fmt: skip
    return EpsilonGreedy(*args, explore="uniform" if policy == "seed" else "plausible", **kw)


def make_guard(b: BanditConfig) -> DriftGuard | None:
    """The drift guard per `bandit.fallback_*` (None: off)."""
    if not b.fallback:
        return None
    return DriftGuard(
        window=b.fallback_window,
        margin=b.fallback_margin,
        cooldown=b.fallback_cooldown,
        min_samples=b.fallback_min_samples,
    )


def make_policy(
    b: BanditConfig,
    arms: list,
    state_file: Path | None = None,
    policy: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    draft_weights: str | None = None,
    prior: tuple[dict, str] | None = None,
    head_weights: str | None = None,
) -> Policy:
    """The policy per the `bandit` section over `arms`; `prior` weighs `bench_prior_rounds`."""
    return Policy(
        make_bandit(b, arms, policy), make_guard(b), state_file, b.save_every_s, clock=clock,
        draft_weights=draft_weights, prior=prior, prior_rounds=b.bench_prior_rounds,
        head_weights=head_weights,
    )  # fmt: skip


def save_bandit(bandit: EpsilonGreedy, path: Path, extra: dict | None = None) -> None:
    """The bandit's state, plus the caller's `extra` fields (the weights it measured)."""
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
