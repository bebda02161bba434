"""The step loop: the rows running together, and one step over all of them. Phoenix's one
engine: the server, the bench, the local teacher and the benchmarks all run through it.

Pure: token ids and models in, ids and counts out; no threads, no clock but `perf_counter` for
the figures it returns. The serving scheduler (`serving/scheduler.py`) owns one `RowBatch` and
calls `join`, `step` and `leave` from its one thread.

A row (`row.Row`) is one request: its prompt, budget and arm (0, draft:K, ngram:K, eagle:K).
Rows join between steps (`join`: their prompts prefilled, batched among the joiners, into
per-row caches, `rows.RowCache`) and leave when they finish, are cancelled or fail. One step:
  1. proposals: each row's proposer (`propose/`, by its arm's strategy) guesses up to the
     row's k_eff tokens, the rows of one proposer together; plain rows guess none;
  2. one target pass over every row's `[last, d1..dk]` (ragged: each row its own length, 0
     guesses included), which also returns the target states a proposer reads (`taps`);
  3. each row's acceptance and its own cache rollback. A greedy row (temperature 0) keeps the
     longest prefix the target agrees with, plus the target's own next token: every committed
     token is the target's greedy choice, so its output is its target-only greedy output,
     whatever ran beside it. A sampled row accepts by speculative sampling (`sampling.verify`),
     its guesses drawn from its proposer's distribution, each token drawn with the row's own
     generator: its output is distributed as the target's samples are.
A row asking for logprobs gets, per committed token, the target's log-probability and its top
alternatives, from the same pass (`sampling.top_logprobs`).

Cost: a step is timed whole, less the proposals priced apart (their own `StepCost`s) and the
caller's callbacks, into `cost` against tokens fed, and split among its rows by
`StepCost.shares` (a / rows + b * its tokens). A row's `cost_s` is its prefill plus its shares
plus its proposals: `tokens / cost_s` is what its arm cost the batch (the policy's reward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from .arms import Arm
from .cost import StepCost
from .loaded import Models
from .propose import Proposer
from .propose.draft_model import DraftModelProposer
from .propose.eagle import EagleProposer
from .propose.ngram import NgramProposer
from .row import GenerationResult, Row
from .rows import RowCache, prefill, split_rows, target_logits
from .runner import prepare
from .sampling import GREEDY, Sampling, greedy_ids, probabilities_of, top_logprobs, verify


class RowBatch:
    """The rows running together over one set of models (module docstring). At most
    `max_rows` rows, each at most `limit` tokens of prompt + output (default: the models'
    context, else 4096: the caches grow to it); not thread-safe (one caller: the scheduler).
    `lean`: run Llama-family models through their lean runner (`runner.py`); False:
    transformers' own forward for every model (the same output)."""

    def __init__(self, models: Models, max_rows: int = 16, limit: int | None = None,
                 lean: bool = True):  # fmt: skip
        self.models = models
        self.lean = lean
        self.max_rows = max(1, max_rows)
        model_limit = models.max_context or 4096
        self.limit = min(limit, model_limit) if limit else model_limit
        self.cost = StepCost()  # the target pass: time against tokens fed
        self.draft_cost = StepCost()  # one draft pass: time against rows drafted for
        self.head_cost = StepCost()  # one head pass (a read, or a guess): time against its rows
        self.rows: list[Row] = []
        self.epoch = 0  # bumped by each `set_models` (a new draft)
        self.steps = 0
        self.changes = 0  # bumped by every join and leave: the rows' set (`ServingCore._gate`)
        self.max_rows_seen = 0
        self._tcache: RowCache | None = None
        self._proposers: dict[str, Proposer] = {}

    @property
    def room(self) -> int:
        return self.max_rows - len(self.rows)

    @property
    def vocab(self) -> int:
        return self.models.target.get_output_embeddings().weight.shape[0]

    def check(self, prompt: Sequence[int], max_tokens: int, arm: Arm) -> None:
        """Refuse a request that cannot join (alone, before it joins): ValueError naming why."""
        if not prompt:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(prompt) >= self.limit:
            raise ValueError(f"prompt of {len(prompt)} tokens fills the {self.limit}-token context")
        if arm.needs_draft and self.models.drafter is None:
            raise ValueError(f"arm {arm} needs a draft model; this engine has none")
        if arm.needs_head and self.models.head is None:
            raise ValueError(f"arm {arm} needs an EAGLE-3 head; this engine has none")

    def _cache(self) -> RowCache:
        if self._tcache is None:
            prepare(self.models.target, self.limit, self.lean)
            self._tcache = RowCache(self.models.target, self.max_rows, self.limit)
        return self._tcache

    def _proposer(self, strategy: str) -> Proposer | None:
        """The proposer of a strategy over these models, made on first use (None: the models
        have nothing it needs)."""
        p = self._proposers.get(strategy)
        if p is None:
            m = self.models
            if strategy == "ngram":
                p = NgramProposer()
            elif strategy == "draft" and m.drafter is not None:
                p = DraftModelProposer(m.drafter, self.max_rows, self.limit, self.vocab,
                                       self.draft_cost, self.lean)  # fmt: skip
            elif strategy == "eagle" and m.head is not None:
                p = EagleProposer(m.head, self.vocab, self.head_cost)
            if p is not None:
                self._proposers[strategy] = p
        return p

    def set_models(self, models: Models) -> None:
        """A new draft (or head) over the same target, from the next step on. The draft rows
        running move to the new draft, whose cache starts empty: each catches up on its next
        proposal (its output stays exact). A new EAGLE-3 head: the eagle rows running stop
        guessing (the states they fed the old head are gone; they finish plain, exact), new
        ones use it."""
        if models.target is not self.models.target:
            raise ValueError("set_models: another target (only the draft may change)")
        kept = {k: p for k, p in self._proposers.items()
                if k == "ngram" or (k == "eagle" and p.head is models.head)}  # fmt: skip
        self.models, self._proposers = models, kept
        self.epoch += 1
        for r in self.rows:
            if r.proposer is not None and r.arm.needs_head and r.proposer is not kept.get("eagle"):
                r.proposer.leave(r)
                r.proposer = None
        draft_rows = [r for r in self.rows if r.proposer is not None and r.arm.needs_draft]
        new = self._proposer("draft")
        for r in draft_rows:
            r.proposer, r.dslot = new, None
        if new is not None:
            new.adopt(draft_rows)

    def reset(self) -> list[Row]:
        """Drop every row and every cache (after a step failed); returns the rows dropped."""
        rows, self.rows = self.rows, []
        self.changes += 1
        self._tcache, self._proposers = None, {}
        return rows

    def join(
        self,
        items: Sequence[
            tuple[object, Sequence[int], int, Arm]
            | tuple[object, Sequence[int], int, Arm, Sampling]
        ],
    ) -> list[Row]:
        """Add rows `(key, prompt, max_tokens, arm[, sampling])` (at most `room`; each `check`ed
        first; sampling default greedy): their prompts prefilled, one batched pass per model.
        If the prefill fails, the joiners are released and the error raised; the rows already
        running are untouched."""
        if len(items) > self.room:
            raise ValueError(f"{len(items)} rows do not fit: {self.room} free of {self.max_rows}")
        tc = self._cache()
        now = time.perf_counter()
        joined = [self._new_row(tc, now, *item) for item in items]
        self.rows += joined
        self.changes += 1
        try:
            states = self._prefill(tc, joined)
            for p in {id(r.proposer): r.proposer for r in joined if r.proposer}.values():
                mine = [(r, s) for r, s in zip(joined, states, strict=True) if r.proposer is p]
                seconds = p.join([r for r, _ in mine], [s for _, s in mine])
                for r, _ in mine if seconds else ():  # an equal share of its own prefill each
                    r.charge(seconds / len(mine), drafting=True)
        except Exception:
            for r in joined:
                self.leave(r)
            raise
        self.max_rows_seen = max(self.max_rows_seen, len(self.rows))
        return joined

    def _new_row(self, tc: RowCache, now: float, key, prompt, max_tokens, arm: Arm,
                 sampling: Sampling = GREEDY) -> Row:  # fmt: skip
        return Row(
            key=key, prompt=list(prompt), max_tokens=max_tokens, arm=arm, epoch=self.epoch,
            start=now, tslot=tc.alloc(), seq=list(prompt),
            proposer=self._proposer(arm.strategy) if arm.k > 0 else None,
            sampling=sampling, gen=sampling.generator(),
            logprobs=[] if sampling.logprobs is not None else None,
            eligible_pos=[0] * arm.k, proposed_pos=[0] * arm.k, accepted_pos=[0] * arm.k,
        )  # fmt: skip

    def _prefill(self, tc: RowCache, joined: list[Row]) -> list[torch.Tensor | None]:
        """The joiners' prompts (all but the last token) into the target's cache, each charged
        for its own; returns each joiner's target states at its prompt positions where its
        proposer reads them (`taps`), else None."""
        taps = self._taps(joined)
        t0 = time.perf_counter()
        fed = prefill(self.models.target, tc, [r.tslot for r in joined],
                      [r.seq[:-1] for r in joined], taps)  # fmt: skip
        dt = time.perf_counter() - t0
        sizes = [max(1, len(r.seq) - 1) for r in joined]
        for r, n in zip(joined, sizes, strict=True):
            r.charge(dt * n / sum(sizes))
        states: list[torch.Tensor | None] = [None] * len(joined)
        if taps and fed is not None:  # fed is None when every prompt was one token
            with_feed = [i for i, r in enumerate(joined) if len(r.seq) > 1]
            parts = fed[1].split([len(joined[i].seq) - 1 for i in with_feed])
            for i, part in zip(with_feed, parts, strict=True):
                if joined[i].proposer is not None and joined[i].proposer.taps:
                    states[i] = part
        return states

    def _taps(self, rows: list[Row]) -> tuple[int, ...]:
        """The target layers to read in a pass over `rows`: those their proposers read."""
        for r in rows:
            if r.proposer is not None and r.proposer.taps:
                return r.proposer.taps
        return ()

    def leave(self, row: Row) -> None:
        """Take a row out (finished, cancelled): its slots freed, the last rows moved in."""
        moved = self._cache().release(row.tslot)
        if moved is not None:
            next(r for r in self.rows if r.tslot == moved).tslot = row.tslot
        if row.proposer is not None:
            row.proposer.leave(row)
        self.rows.remove(row)
        self.changes += 1
        # Rows in slot order: a pass over all of them reads the cache as a view (`RowCache.plan`,
        # contiguous slots) instead of copying every layer's keys and values out and back.
        self.rows.sort(key=lambda r: r.tslot)

    def calibrate(self, prompt: Sequence[int], arms: Sequence[Arm], tokens: int = 16) -> None:
        """Time the steps each of `arms` makes, one row alone (`tokens` tokens of `prompt`
        each), into the cost curves, before any request: a policy that knows a strategy's
        acceptance (`GoodputBandit.seed`) can then price it without a warm-up request. Only
        on an empty batch (a server's start-up); the rows leave when done."""
        if self.rows:
            raise ValueError("calibrate: the batch is not empty")
        for arm in arms:
            self.join([("calibrate", prompt, tokens, arm)])
            while self.rows:
                self.step()

    def step(
        self,
        on_tokens: Callable[[Row], bool] | None = None,
        gate: Callable[[list[Row]], list[int]] | None = None,
    ) -> list[tuple[Row, str]]:
        """One step over every row. `on_tokens(row)` runs for each row that committed tokens;
        True ends it (a stop string, a caller gone). `gate(rows)`, if given, says per row the
        most tokens it may guess this step (rows' `k_eff` set by arm and budget); it binds the
        `adaptive` (bandit) rows only: a row capped at 0 runs this step as a plain row.
        Returns `(row, finish_reason)` for the rows that finished ("stop": end-of-turn or
        `on_tokens`; "length": budget or context), which have left the batch. After an
        exception the caller fails every row (`reset`)."""
        t0 = time.perf_counter()
        rows = list(self.rows)
        self._limit(rows, gate)
        drafting_s = self._propose(rows)
        feeds = [[r.seq[-1], *r.drafts] for r in rows]
        t1 = time.perf_counter()
        logits, tapped = self._verify(rows, feeds)
        preds = split_rows(greedy_ids(logits).tolist(), feeds)
        t2 = time.perf_counter()
        fed = [len(f) for f in feeds]
        shares = self.cost.shares(fed)
        self.steps += 1
        mine = logits.split(fed)  # each row's scores, one per fed token
        probs, shared = self._probabilities(rows, mine)
        finished, owns, callbacks_s = [], [], 0.0
        for j, r in enumerate(rows):
            r0 = time.perf_counter()
            new, hit_eos = self._commit(r, preds[j], mine[j], probs.get(j), tapped[j])
            own = time.perf_counter() - r0 + (0.0 if r.sampling.greedy else shared)
            owns.append(own)  # its own draws and logprobs (a greedy row: ~0)
            r.verify_s += (t2 - t1) * shares[j] + own  # its cost_s: below, with the rest
            r.rows_seen += len(rows)
            if r.first_s is None:
                r.first_s = t2 - r.start
            c0 = time.perf_counter()
            stop = bool(new) and on_tokens is not None and on_tokens(r)
            callbacks_s += time.perf_counter() - c0
            if hit_eos or stop:
                finished.append((r, "stop"))
            elif len(r.out) >= r.max_tokens or len(r.seq) >= self.limit:
                finished.append((r, "length"))
        for r, _ in finished:
            self.leave(r)
        # The whole step but the proposals priced apart and the caller's callbacks.
        step_s = time.perf_counter() - t0 - drafting_s - callbacks_s
        self.cost.observe(sum(fed), step_s, len(rows))
        rest = max(0.0, step_s - sum(owns))
        for r, share, own in zip(rows, shares, owns, strict=True):
            r.cost_s += rest * share + own
        return finished

    def _limit(self, rows: list[Row], gate) -> None:
        """Each row's k_eff this step: its arm's k within its budget and the context, capped
        for the adaptive rows by `gate`; the positions it could guess at are counted."""
        for r in rows:
            k = min(r.arm.k, r.max_tokens - len(r.out) - 1, self.limit - len(r.seq) - 1)
            r.k_eff, r.drafts, r.q = max(0, k) if r.proposer is not None else 0, [], []
        if gate is not None and any(r.adaptive and r.k_eff > 0 for r in rows):
            for r, cap in zip(rows, gate(rows), strict=True):
                if r.adaptive:
                    r.k_eff = max(0, min(r.k_eff, int(cap)))
        for r in rows:
            r.guess_rounds += r.k_eff > 0
            for i in range(r.k_eff):
                r.eligible_pos[i] += 1

    def _propose(self, rows: list[Row]) -> float:
        """Every guessing row's drafts, its proposer's rows together; returns the seconds of
        the proposals priced apart (charged to their rows as drafting)."""
        groups: dict[int, list[Row]] = {}
        for r in rows:
            if r.k_eff > 0:
                groups.setdefault(id(r.proposer), []).append(r)
        drafting_s = 0.0
        for group in groups.values():
            t0 = time.perf_counter()
            d = group[0].proposer.propose(group)
            for i, r in enumerate(group):
                r.drafts, r.q = d.tokens[i][: r.k_eff], d.q[i]
                if d.seconds is not None:
                    r.charge(d.seconds[i], drafting=True)
            if d.seconds is not None:
                drafting_s += time.perf_counter() - t0
        return drafting_s

    def _verify(self, rows: list[Row], feeds: list[list[int]]):
        """The target's one pass over every row's feed: the logits after every fed token
        ([sum of feeds, V]) and, per row, the states its proposer reads (else None)."""
        taps = self._taps(rows)
        logits = target_logits(self.models.target, self._cache(), [r.tslot for r in rows],
                               feeds, taps)  # fmt: skip
        if not taps:
            return logits, [None] * len(rows)
        logits, tapped = logits
        return logits, tapped.split([len(f) for f in feeds])

    @staticmethod
    def _probabilities(rows: list[Row], mine) -> tuple[dict, float]:
        """The target's distributions for the sampled rows (by index), and each one's share of
        the seconds computing them took."""
        t0 = time.perf_counter()
        sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
        probs = probabilities_of([mine[i] for i in sampled], [rows[i].sampling for i in sampled])
        shared = (time.perf_counter() - t0) / max(1, len(sampled))
        return dict(zip(sampled, probs, strict=True)), shared

    def _commit(self, r: Row, preds: list[int], scores, p, states) -> tuple[list[int], bool]:
        """Accept a row's guesses (greedy: the longest prefix the target agrees with; sampled:
        `sampling.verify`), cut its caches back to what is valid and commit the new tokens, up
        to an end-of-turn token. Returns (the tokens committed, whether it hit end-of-turn)."""
        d = r.drafts
        if r.sampling.greedy:
            m = 0
            while m < len(d) and d[m] == preds[m]:
                m += 1
            new = d[:m] + [preds[m]]
        else:
            m, nxt = verify(d, torch.stack(r.q) if r.q else None, p, r.gen)
            new = d[:m] + [nxt]
        if r.logprobs is not None:
            r.logprobs += top_logprobs(scores[: len(new)], new, r.sampling.logprobs)
        r.rounds += 1
        r.proposed += len(d)
        r.accepted += m
        for i in range(len(d)):
            r.proposed_pos[i] += 1
            r.accepted_pos[i] += i < m
        self._cache().crop(r.tslot, len(r.seq) + m)
        if r.proposer is not None:
            r.proposer.accepted(r, len(r.seq) + m, None if states is None else states[: m + 1])
        hit_eos = False
        for i, tok in enumerate(new):
            if tok in self.models.eos_token_ids:
                new, hit_eos = new[:i], True
                if r.logprobs is not None:
                    del r.logprobs[len(r.out) + i :]
                break
        r.seq += new
        r.out += new
        return new, hit_eos


def generate(
    models: Models,
    prompt: Sequence[int],
    arm: Arm,
    max_tokens: int,
    sampling: Sampling = GREEDY,
    batch: RowBatch | None = None,
) -> GenerationResult:
    """One request alone through the step loop (in `batch` if given, else a fresh one): the
    one-call form for scripts and checks."""
    batch = batch or RowBatch(models, max_rows=1)
    (row,) = batch.join([(None, prompt, max_tokens, arm, sampling)])
    while True:
        for done, reason in batch.step():
            if done is row:
                return row.result(reason)


def sample_outputs(
    models: Models,
    prompt: Sequence[int],
    arm: Arm,
    n: int,
    tokens: int,
    sampling: Sampling,
    rows: int = 16,
) -> tuple[list[tuple], int]:
    """`n` sampled generations of `prompt` by `arm`, `rows` at a time in one batch, seeded
    `sampling.seed + i` (a distribution check's samples): each output's first `tokens` tokens
    as a tuple, padded with None after an end of turn; and the guesses proposed."""
    seed0 = sampling.seed or 0
    batch = RowBatch(models, max_rows=rows)
    outs, proposed = [], 0
    for start in range(0, n, rows):
        batch.join([(i, prompt, tokens, arm, replace(sampling, seed=seed0 + i))
                    for i in range(start, min(n, start + rows))])  # fmt: skip
        while batch.rows:
            for row, _ in batch.step():
                proposed += row.proposed
                outs.append(tuple(row.out[:tokens]) + (None,) * (tokens - len(row.out)))
    return outs, proposed
