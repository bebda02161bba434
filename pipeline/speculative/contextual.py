"""The contextual policy (`bandit.policy: contextual`). Pure."""

from __future__ import annotations

from bisect import bisect_right

from .bandit import Context, Decision, EpsilonGreedy, strategy_of, temperature_bucket

PROMPT_BUCKETS = (128, 256, 512)  # prompt tokens: <128, 128-255, 256-511, 512+
LOAD_BUCKETS = (1, 4)  # other requests: 0, 1-3, 4+
ACCEPTANCE_BUCKETS = (0.15, 0.35)  # a strategy's recent acceptance: low, mid, high


class ContextualBandit(EpsilonGreedy):
    """The plausible policy valued per cell (prompt length x load x recent acceptance x
    temperature): (n_c m_c + w m) / (n_c + w), w = `prior_weight`. `acceptance_alpha`: the
    latest request's weight in a strategy's recent acceptance."""

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
