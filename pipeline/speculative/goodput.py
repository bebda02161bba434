"""The goodput policy (`bandit.policy: goodput`, the default) and its per-step gate. Pure."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .bandit import Context, Decision, EpsilonGreedy, strategy_of, temperature_bucket
from .cost import added_passes, shared_passes, step_seconds


@dataclass(frozen=True)
class StepRow:
    """One row of a step, as `GoodputBandit.step_caps` sees it."""

    arm: str
    k: int  # the most it could guess this step (its arm's k, less what its budget leaves)
    adaptive: bool  # the bandit's row: the gate caps its guesses; else the caller's arm
    fed: float = 1.0  # its mean tokens fed a step so far (a fixed row is priced at these)
    tokens: float = 1.0  # ... and committed
    temperature: float = 0.0


class GoodputBandit(EpsilonGreedy):
    """The arm with the best predicted goodput (batch tokens/s with this row in it) at the load
    the request joins. Other rows feed F_o and commit R_o a step (default rows - 1 plain). With
    `cost.py`'s curves S(x) (step feeding x), D(m) / H(m) (draft / head pass for m rows):

        tokens(s:k) = 1 + sum_{i<k} P_s[i]
        step(s:k)   = sum_{j<=k} (Q_s[j-1] - Q_s[j]) * S(F_o + 1 + j)
        draft(s:k)  = k * (D(m + 1) - D(m))   (eagle: H; m other rows in the pass; m = 0: D(1))
        goodput     = (R_o + tokens) / (step + P_o + draft)  (arm 0: (R_o + 1) / (S(F_o + 1) + P_o))

    P_s[i]: share of rounds able to guess at i whose guesses 1..i+1 were all accepted; Q_s[i]:
    share that guessed at i (Q_s[-1] = 1, Q_s[k] = 0); P_o: the other rows' proposals per step.
    Acceptance is learnt per strategy, position and temperature bucket (unmeasured buckets borrow
    greedy), decaying by `decay` per round. Where plain wins beside others but a speculative arm
    would win alone, the request gets that arm (`Decision.deferred`), capped per step by
    `step_caps`. Exploration is limited to arms within `explore_margin` of the best (or
    unpredicted). Without loop figures: the plausible policy. Rationale: docs/serving.md."""

    def __init__(
        self, arms, rng, *args, explore_margin: float = 0.1, decay: float = 0.998,
        speculate_margin: float = 0.05, margin_per_row: float = 0.0, learners: int = 1, **kw,
    ):  # fmt: skip
        """`learners`: rows a step that may guess with their acceptance unknown (`step_caps`)."""
        super().__init__(arms, rng, *args, **kw)
        self.learners = learners
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
        """Acceptance key per strategy and temperature bucket: `ngram`, `ngram@2`, ..."""
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
        cost, last = context.others_drafting, 1.0  # last: the share that guessed j or more
        for j in range(k + 1):
            more = min(last, prop[j] / elig[j]) if j < k else 0.0  # ... j + 1 or more
            cost += (last - more) * step_seconds(context.step_cost, fed_o + 1 + j)
            last = more
        if s == "draft" and context.draft_cost is not None:
            cost += added_passes(context.draft_cost, context.draft_rows, k)
        if s == "eagle" and context.head_cost is not None:  # its read and guesses: shared
            cost += added_passes(context.head_cost, context.head_rows, k)
        if s == "pard" and context.parallel_cost is not None:  # one pass, whatever k
            cost += added_passes(context.parallel_cost, context.parallel_rows, 1)
        return (tokens_o + tokens) / max(cost, 1e-9)

    def seed(self, prior: dict[str, tuple[list, list, list]], rounds: float) -> list[str]:
        """Seed acceptance from `drafts.bench_prior`: `prior[key]` = (eligible, proposed, accepted)
        per position, scaled to at most `rounds` rounds. Skips keys already known and strategies
        no arm uses. Returns the keys seeded."""
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
        """Whether speculative `arm` needs no warm-up pull (acceptance and every cost measured).
        Plain is always pulled: the drift guard compares with it."""
        s, k = strategy_of(arm), int(str(arm).partition(":")[2] or 0)
        if not s or k == 0 or self.predict(arm, context) is None:
            return False
        if max(x for x, _ in context.step_cost) < 1 + k:
            return False
        if s == "draft" and context.draft_cost is None:
            return False
        if s == "pard" and context.parallel_cost is None:
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
        """The arm predicted best for this request alone, if speculative; else None."""
        if context.alone_cost is None:
            return None
        alone = replace(context, rows=1, step_cost=context.alone_cost, draft_rows=0, head_rows=0,
                        others_fed=0.0, others_tokens=0.0, others_drafting=0.0)  # fmt: skip
        values = {a: v for a in self.arms if (v := self.predict(a, alone)) is not None}
        best = max(values, key=lambda a: (values[a], -self.arms.index(a)))
        return best if strategy_of(best) else None

    def guesses(self, arm, temperature: float = 0.0) -> list[tuple[float, float]] | None:
        """[(guesses fed, tokens committed) per step at cap j] for j up to where `arm`'s acceptance
        is measured; None if plain or unmeasured. Call under the lock."""
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

    def step_caps(self, rows: list[StepRow], step_cost, draft_cost=None, head_cost=None,
                  parallel_cost=None):  # fmt: skip
        """The most tokens each row may guess this step. Alone or without figures: its k. Else one
        cap c for the adaptive rows, the c in 0..k maximising

            goodput(c) = sum_r tokens_r(c) / (S(sum_r (1 + guesses_r(c))) + H + D)

        (ngram rows guess all or none; H, D: `shared_passes`; fixed rows at what they fed so far);
        c > 0 must beat c = 0 by `margin(rows)`. Learners: the first `learners` adaptive rows whose
        acceptance does not reach their k guess their whole k (priced as fixed), the rest get 0.
        So after a swap the new draft is measured within `warmup_pulls` x (forgotten arms)
        guessing bandit requests, whatever the load."""
        full = [r.k for r in rows]
        if len(rows) <= 1 or step_cost is None:
            return full
        with self._lock:
            unknown = [i for i, r in enumerate(rows) if r.adaptive and r.k > 0
                       and not self._reaches(r.arm, r.k, r.temperature)]  # fmt: skip
        learning = set(unknown[: self.learners])
        view = [replace(r, adaptive=False) if i in learning else r for i, r in enumerate(rows)]
        values, plans = self.step_values(view, step_cost, draft_cost, head_cost, parallel_cost)
        cap = max(range(len(values)), key=lambda c: (values[c], -c))
        if values[cap] < (1 + self.margin(len(rows))) * values[0]:
            cap = 0
        return [min(k, cap if plans[i] else 0) if i in plans else k for i, k in enumerate(full)]

    def _reaches(self, arm, k: int, temperature: float) -> bool:
        """Under the lock: whether `arm`'s acceptance is measured at its first `k` positions."""
        plan = self.guesses(arm, temperature)
        return plan is not None and len(plan) > min(k, self.top)

    def step_values(self, rows: list[StepRow], step_cost, draft_cost=None, head_cost=None,
                    parallel_cost=None):  # fmt: skip
        """([step goodput with adaptive rows capped at c, c = 0..], {adaptive row: `guesses`})."""
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
            if parallel_cost:  # one pass over its rows that guess
                cost += shared_passes(parallel_cost, [min(1.0, g) for g in passes.get("pard", [])])
            return tokens / max(cost, 1e-9)

        return [goodput(c) for c in range(top + 1)], plans

    def margin(self, rows: int) -> float:
        """Relative margin a guess must beat plain by: `speculate_margin` + `margin_per_row` per row
        past two."""
        return self.speculate_margin + self.margin_per_row * max(0, rows - 2)

    def _allowed(self, values: dict, context: Context) -> list:
        """Alone: every arm. Beside others: plain and the arms predicted to beat it by `margin`."""
        plain = next((a for a in self.arms if not strategy_of(a)), None)
        if context.rows <= 1 or plain is None or values.get(plain) is None:
            return list(self.arms)
        bar = (1 + self.margin(context.rows)) * values[plain]
        return [a for a in self.arms if a == plain or (values[a] is not None and values[a] >= bar)]

    def _decision(self, arm, explored, warmup, eps, context=None, values=None) -> Decision:
        shown = {a: v for a, v in (values or self.means).items() if v is not None}
        return Decision(arm, explored, warmup, eps, shown, dict(self.counts))

    def update(self, arm, reward, context=None, acceptance=None, weight=1.0, positions=None):
        """As the plausible policy's, plus `positions` (eligible per position or one number,
        proposed, accepted) teaching the strategy's acceptance. An arm whose acceptance does not
        yet reach its k goes back on `rewarm`."""
        super().update(arm, reward, context, acceptance, weight)
        s, k = strategy_of(arm), int(str(arm).partition(":")[2] or 0)
        if not s or k == 0:
            return
        temperature = 0.0 if context is None else context.temperature
        with self._lock:
            if positions is not None:
                self._teach(self._key(s, context), positions)
            if not self._reaches(arm, k, temperature) and arm not in self.rewarm:
                self.rewarm.append(arm)

    def _teach(self, key: str, positions) -> None:
        """Under the lock: add one request's (eligible, proposed, accepted) per position."""
        elig, prop, acc = positions
        k = min(len(prop), self.top)
        if isinstance(elig, (int, float)):
            elig = [elig] * k
        if k == 0 or not elig or elig[0] <= 0:
            return
        st = self._stats(key)
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
