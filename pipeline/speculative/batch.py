"""The step loop, Phoenix's one engine: rows (`row.Row`, one request each, arm 0, draft:K,
pard:K, ngram:K or eagle:K) join between steps, prefilled into per-row caches, and leave when
done. Pure: ids and models in, ids and counts out; the scheduler calls it from one thread. One step:
  1. each row's proposer (`propose/`) guesses up to k_eff tokens, one proposer's rows together;
  2. one ragged target pass over every row's `[last, d1..dk]`, returning the proposers' `taps`;
  3. per row, acceptance and cache rollback. Greedy: the longest agreeing prefix plus the
     target's next token, so output equals target-only greedy output whatever ran beside it.
     Sampled: `sampling.verify` with the row's own generator, distributed as the target's.
Logprobs come from the same pass (`sampling.top_logprobs`).

Cost: a step's time, less proposals (priced in their own `StepCost`s) and callbacks, goes into
`cost` against tokens fed and is split by `StepCost.shares`. A row's `cost_s` = prefill + shares
+ proposals; `tokens / cost_s` is the policy's reward.
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
from .propose.parallel import ParallelProposer
from .row import GenerationResult, Row
from .rows import RowCache, prefill, split_rows, target_logits
from .runner import prepare
from .sampling import GREEDY, Sampling, greedy_ids, probabilities_of, top_logprobs, verify


class RowBatch:
    """At most `max_rows` rows of at most `limit` tokens each (default the models' context, else
    4096). Not thread-safe. `lean`: Llama models through `runner.py` (same output as False)."""

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
        self.parallel_cost = StepCost()  # one parallel draft pass: time against its rows
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
        if arm.needs_parallel and self.models.parallel_token is None:
            raise ValueError(f"arm {arm} needs a draft trained for parallel drafting; none here")

    def _cache(self) -> RowCache:
        if self._tcache is None:
            prepare(self.models.target, self.limit, self.lean)
            self._tcache = RowCache(self.models.target, self.max_rows, self.limit)
        return self._tcache

    def _proposer(self, strategy: str) -> Proposer | None:
        """The strategy's proposer, made on first use (None: the models lack what it needs)."""
        p = self._proposers.get(strategy)
        if p is None:
            m = self.models
            if strategy == "ngram":
                p = NgramProposer()
            elif strategy == "draft" and m.drafter is not None:
                p = DraftModelProposer(m.drafter, self.max_rows, self.limit, self.vocab,
                                       self.draft_cost, self.lean)  # fmt: skip
            elif strategy == "pard" and m.parallel_token is not None:
                p = ParallelProposer(m.drafter, m.parallel_token, self.max_rows, self.limit,
                                     self.vocab, self.parallel_cost, self.lean)  # fmt: skip
            elif strategy == "eagle" and m.head is not None:
                p = EagleProposer(m.head, self.vocab, self.head_cost)
            if p is not None:
                self._proposers[strategy] = p
        return p

    def set_models(self, models: Models) -> None:
        """A new draft or head over the same target, from the next step on. Running draft rows move
        to the new draft (empty cache, caught up on next proposal); running eagle rows of a
        replaced head finish plain. Output stays exact either way."""
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
        for strategy in ("draft", "pard"):
            moved = [r for r in self.rows if r.proposer is not None and r.arm.strategy == strategy]
            new = self._proposer(strategy)  # None: the new draft cannot; they finish plain
            for r in moved:
                r.proposer, r.dslot = new, None
            if new is not None:
                new.adopt(moved)

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
        """Add and prefill rows `(key, prompt, max_tokens, arm[, sampling=greedy])`, at most
        `room`, each `check`ed first. On failure the joiners are released and the error raised;
        running rows are untouched."""
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
        """Prefill all but each prompt's last token; returns each joiner's tapped states or None."""
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
        # Slot order lets a pass read the cache as a view (`RowCache.plan`), not a copy.
        self.rows.sort(key=lambda r: r.tslot)

    def calibrate(self, prompt: Sequence[int], arms: Sequence[Arm], tokens: int = 16) -> None:
        """On an empty batch, run `tokens` of `prompt` alone per arm to seed the cost curves."""
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
        """One step over every row. `on_tokens(row)` runs per row that committed tokens; True ends
        it. `gate(rows)` caps per row the guesses of `adaptive` rows (0: plain this step).
        Returns `(row, "stop" | "length")` for rows that finished and left. After an exception
        the caller must `reset`."""
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
        """Set each row's k_eff (arm's k within budget and context, `gate`-capped if adaptive)."""
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
        """Draft for guessing rows; returns the seconds of proposals priced apart."""
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
        """Target pass: logits [sum of feeds, V] and per row its tapped states (or None)."""
        taps = self._taps(rows)
        logits = target_logits(self.models.target, self._cache(), [r.tslot for r in rows],
                               feeds, taps)  # fmt: skip
        if not taps:
            return logits, [None] * len(rows)
        logits, tapped = logits
        return logits, tapped.split([len(f) for f in feeds])

    @staticmethod
    def _probabilities(rows: list[Row], mine) -> tuple[dict, float]:
        """Target distributions of sampled rows (by index) and each one's share of the seconds."""
        t0 = time.perf_counter()
        sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
        probs = probabilities_of([mine[i] for i in sampled], [rows[i].sampling for i in sampled])
        shared = (time.perf_counter() - t0) / max(1, len(sampled))
        return dict(zip(sampled, probs, strict=True)), shared

    def _commit(self, r: Row, preds: list[int], scores, p, states) -> tuple[list[int], bool]:
        """Accept a row's guesses, crop its caches, commit up to end-of-turn.
        Returns (tokens committed, hit end-of-turn)."""
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
    """One request alone through the step loop (in `batch`, else a fresh one)."""
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
    """`n` generations seeded `sampling.seed + i`, `rows` at a time: each output's first `tokens`
    as a tuple (None-padded after end of turn), and the total guesses proposed."""
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
