"""Continuous batching for every arm: the rows running together, and one step over all of them.

Pure: token ids and models in, ids and counts out; no threads, no clock but `perf_counter` for
the figures it returns. The serving scheduler (`serving/scheduler.py`) owns one `RowBatch` and
calls `join`, `step` and `leave` from its one thread.

A row is one request: its prompt, budget and arm (0, draft:K, ngram:K). Rows join between steps
(`join`: their prompts prefilled, batched among the joiners, into per-row caches, `rows.RowCache`)
and leave when they finish, are cancelled or fail. One step:
  1. proposals, each row by its own arm: the rows drafting with the draft model step together,
     one batched draft pass per draft position (a row drops out once it has its k guesses);
     n-gram rows by lookup; eagle rows by the EAGLE-3 head, from the target's hidden states
     that each target pass also returns for them (`target_logits(taps=...)`); plain rows none;
  2. one target pass over every row's `[last, d1..dk]` (ragged: each row its own length, 0
     guesses included);
  3. each row's acceptance and its own cache rollback. A greedy row (temperature 0) keeps the
     longest prefix the target agrees with, plus the target's own next token: every committed
     token is the target's greedy choice, so its output is its target-only greedy output,
     whatever ran beside it. A sampled row accepts by speculative sampling (`sampling.verify`),
     its guesses drawn from its proposer's distribution, each token drawn with the row's own
     generator: its output is distributed as the target's samples are.
A row asking for logprobs gets, per committed token, the target's log-probability and its top
alternatives, from the same pass (`sampling.top_logprobs`).

Cost: a step is timed whole (proposals, target pass, acceptance and rollback), less its draft
passes, timed apart, and the caller's per-token callbacks (text work every arm pays per token
committed): `StepCost` against tokens fed (the target pass alone misses the per-token work
around it). The step's time is split among its rows (time = a + b * tokens fed, fitted online;
a row's share = a / rows + b * its tokens, scaled so the shares sum to the step). A draft pass
is split equally among the rows it drafted for. A row's `cost_s` is its prefill plus
its shares: `tokens / cost_s` is what its arm cost the batch (the policy's reward, goodput).
With one row the share is the whole step: tokens/s as a lone request sees them. What the
policy predicts with is `StepCost.curve()`: the measured time per step size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from .arms import Arm
from .cost import StepCost
from .eagle3 import HeadCache
from .engine import GenerationResult, SpeculativeEngine
from .proposers import NgramProposer
from .rows import RowCache, draft_scores, prefill, split_rows, target_logits
from .runner import prepare
from .sampling import (
    GREEDY,
    Sampling,
    draw,
    greedy_ids,
    probabilities_of,
    top_logprobs,
    verify,
)


@dataclass(eq=False)
class Row:
    """One request in the batch: what it asked for, where its caches are, what it has done."""

    key: object  # the caller's handle, returned with the row
    prompt: list[int]
    max_tokens: int
    arm: Arm
    epoch: int  # the batch's draft epoch when it joined
    start: float
    tslot: int
    dslot: int | None = None
    ngram: NgramProposer | None = None
    hcache: HeadCache | None = None  # an eagle row's head cache
    aux_new: list = field(default_factory=list)  # target states of committed positions unread
    sampling: Sampling = GREEDY
    gen: object = None  # the row's torch.Generator (sampled rows)
    q: list = field(default_factory=list)  # the draft's distribution for each guess (sampled)
    logprobs: list | None = None  # per token: (logprob, [(token, logprob), ...])
    seq: list[int] = field(default_factory=list)  # prompt + committed output
    out: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    k_eff: int = 0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    guess_rounds: int = 0  # steps it was let guess (k_eff > 0)
    adaptive: bool = False  # its guesses are gated per step by the batch (`step`'s gate)
    eligible_pos: list[int] = field(default_factory=list)  # steps it could guess at each position
    proposed_pos: list[int] = field(default_factory=list)
    accepted_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    cost_s: float = 0.0
    first_s: float | None = None
    rows_seen: int = 0  # the sum, over its steps, of the rows in the step (its mean batch size)

    def result(self, reason: str, queued_s: float = 0.0) -> GenerationResult:
        return GenerationResult(
            token_ids=self.out,
            arm=str(self.arm),
            finish_reason=reason,
            latency_s=time.perf_counter() - self.start,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            prompt_tokens=len(self.prompt),
            proposed=self.proposed,
            accepted=self.accepted,
            rounds=self.rounds,
            eligible_per_position=self.eligible_pos,
            proposed_per_position=self.proposed_pos,
            accepted_per_position=self.accepted_pos,
            guess_rounds=self.guess_rounds,
            first_token_s=self.first_s,
            cost_s=self.cost_s,
            queued_s=queued_s,
            batch_rows=self.rows_seen / self.rounds if self.rounds else 1.0,
            logprobs=self.logprobs,
        )


class RowBatch:
    """The rows running together over one engine's models (module docstring). At most
    `max_rows` rows, each at most `limit` tokens of prompt + output (default: the models'
    context, else 4096: the caches grow to it); not thread-safe (one caller: the scheduler)."""

    def __init__(
        self, engine: SpeculativeEngine, max_rows: int = 16, limit: int | None = None,
        lean: bool = True,
    ):  # fmt: skip
        """`lean`: run Llama-family models through their lean runner (`runner.py`); False:
        transformers' own forward for every model (the same output)."""
        self.engine = engine
        self.lean = lean
        self.max_rows = max(1, max_rows)
        model_limit = engine.max_context or 4096
        self.limit = min(limit, model_limit) if limit else model_limit
        self.cost = StepCost()  # the target pass: time against tokens fed
        self.draft_cost = StepCost()  # one draft pass: time against rows drafted for
        self.head_cost = StepCost()  # one head pass (a read, or a guess): time against its rows
        self.rows: list[Row] = []
        self.epoch = 0  # bumped by each `set_engine` (a new draft)
        self.steps = 0
        self.changes = 0  # bumped by every join and leave: the rows' set (`ServingCore._gate`)
        self.max_rows_seen = 0
        self._tcache: RowCache | None = None
        self._dcache: RowCache | None = None
        self._vocab: int | None = None  # the target's vocabulary (sampled draft rows)

    @property
    def room(self) -> int:
        return self.max_rows - len(self.rows)

    def check(self, prompt: Sequence[int], max_tokens: int, arm: Arm) -> None:
        """Refuse a request that cannot join (alone, before it joins): ValueError naming why."""
        if not prompt:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(prompt) >= self.limit:
            raise ValueError(f"prompt of {len(prompt)} tokens fills the {self.limit}-token context")
        if arm.needs_draft and self.engine.drafter is None:
            raise ValueError(f"arm {arm} needs a draft model; this engine has none")
        if arm.needs_head and self.engine.head is None:
            raise ValueError(f"arm {arm} needs an EAGLE-3 head; this engine has none")

    def _caches(self) -> tuple[RowCache, RowCache | None]:
        if self._tcache is None:
            prepare(self.engine.target, self.limit, self.lean)
            self._tcache = RowCache(self.engine.target, self.max_rows, self.limit)
        if self._dcache is None and self.engine.drafter is not None:
            prepare(self.engine.drafter.model, self.limit, self.lean)
            self._dcache = RowCache(self.engine.drafter.model, self.max_rows, self.limit)
        return self._tcache, self._dcache

    def set_engine(self, engine: SpeculativeEngine) -> None:
        """A new draft over the same target, from the next step on: its cache starts empty and
        every draft row catches up on its next proposal (its output stays exact). A new EAGLE-3
        head: the eagle rows running stop guessing (the states they fed the old head are gone;
        they finish plain, exact), new ones use it."""
        if engine.target is not self.engine.target:
            raise ValueError("set_engine: another target (only the draft may change)")
        if engine.head is not self.engine.head:
            for r in self.rows:
                r.hcache, r.aux_new = None, []
        self.engine = engine
        self.epoch += 1
        self._dcache = None
        _, dc = self._caches()
        for r in self.rows:
            if r.dslot is not None:
                r.dslot = dc.alloc() if dc is not None else None

    def reset(self) -> list[Row]:
        """Drop every row and both caches (after a step failed); returns the rows dropped."""
        rows, self.rows = self.rows, []
        self.changes += 1
        self._tcache = self._dcache = None
        return rows

    def join(
        self,
        items: Sequence[
            tuple[object, Sequence[int], int, Arm]
            | tuple[object, Sequence[int], int, Arm, Sampling]
        ],
    ) -> list[Row]:
        """Add rows `(key, prompt, max_tokens, arm[, sampling])` (at most `room`; each `check`ed first;
        sampling default greedy):
        their prompts prefilled, one batched pass per model. If the prefill fails, the joiners
        are released and the error raised; the rows already running are untouched."""
        if len(items) > self.room:
            raise ValueError(f"{len(items)} rows do not fit: {self.room} free of {self.max_rows}")
        tc, dc = self._caches()
        now = time.perf_counter()
        joined = []
        for key, prompt, max_tokens, arm, *rest in items:
            sampling = rest[0] if rest else GREEDY
            drafting = arm.needs_draft and dc is not None
            joined.append(
                Row(
                    key=key,
                    prompt=list(prompt),
                    max_tokens=max_tokens,
                    arm=arm,
                    epoch=self.epoch,
                    start=now,
                    tslot=tc.alloc(),
                    dslot=dc.alloc() if drafting else None,
                    ngram=NgramProposer() if arm.strategy == "ngram" and arm.k > 0 else None,
                    hcache=HeadCache() if arm.needs_head and self.engine.head else None,
                    sampling=sampling,
                    gen=sampling.generator(),
                    logprobs=[] if sampling.logprobs is not None else None,
                    seq=list(prompt),
                    eligible_pos=[0] * arm.k,
                    proposed_pos=[0] * arm.k,
                    accepted_pos=[0] * arm.k,
                )
            )
        self.rows += joined
        self.changes += 1
        pad = self.engine.pad_token_id
        drafting = [r for r in joined if r.dslot is not None]
        taps = self._taps(joined)
        try:
            t0 = time.perf_counter()
            fed = prefill(self.engine.target, tc, [r.tslot for r in joined],
                          [r.seq[:-1] for r in joined], pad, taps)  # fmt: skip
            if taps:  # the eagle rows keep their prompt's target states for the head
                with_feed = [r for r in joined if len(r.seq) > 1]
                parts = fed[1].split([len(r.seq) - 1 for r in with_feed])
                for r, part in zip(with_feed, parts, strict=True):
                    if r.hcache is not None:
                        r.aux_new.append(part)
            t1 = time.perf_counter()
            if drafting:
                prefill(self.engine.drafter.model, dc, [r.dslot for r in drafting],
                        [r.seq[:-1] for r in drafting], pad)  # fmt: skip
            t2 = time.perf_counter()
        except Exception:
            for r in joined:
                self.leave(r)
            raise
        sizes = [max(1, len(r.seq) - 1) for r in joined]
        for r, n in zip(joined, sizes, strict=True):  # each joiner pays for its own prompt
            r.verify_s += (t1 - t0) * n / sum(sizes)
            r.cost_s += (t1 - t0) * n / sum(sizes)
        for r in drafting:
            r.draft_s += (t2 - t1) / len(drafting)
            r.cost_s += (t2 - t1) / len(drafting)
        self.max_rows_seen = max(self.max_rows_seen, len(self.rows))
        return joined

    def _taps(self, rows: list[Row]) -> tuple[int, ...]:
        """The target layers to read in a pass over `rows`: the head's, if one is an eagle row."""
        head = self.engine.head
        return head.config.aux_layer_ids if head and any(r.hcache for r in rows) else ()

    def leave(self, row: Row) -> None:
        """Take a row out (finished, cancelled): its slots freed, the last rows moved in."""
        tc, dc = self._caches()
        moved = tc.release(row.tslot)
        if moved is not None:
            next(r for r in self.rows if r.tslot == moved).tslot = row.tslot
        if row.dslot is not None and dc is not None:
            moved = dc.release(row.dslot)
            if moved is not None:
                next(r for r in self.rows if r.dslot == moved).dslot = row.dslot
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
        True ends it (a stop string, a caller gone). `gate(rows)`, if given, says per row
        the most tokens it may guess this step (its `k_eff` set: what its arm and budget
        allow); it binds the `adaptive` rows only (a bandit's choice, where a fixed arm is the
        caller's): a row capped at 0 runs this step as a plain row.
        Returns `(row, finish_reason)` for the rows that finished ("stop": end-of-turn or
        `on_tokens`; "length": budget or context), which have left the batch. After an exception the caller fails every row (`reset`)."""
        t0 = time.perf_counter()
        rows = list(self.rows)
        for r in rows:
            k = min(r.arm.k, r.max_tokens - len(r.out) - 1, self.limit - len(r.seq) - 1)
            r.k_eff, r.drafts, r.q = max(0, k), [], []
        if gate is not None and any(r.adaptive and r.k_eff > 0 for r in rows):
            for r, cap in zip(rows, gate(rows), strict=True):
                if r.adaptive:
                    r.k_eff = max(0, min(r.k_eff, int(cap)))
        for r in rows:
            r.guess_rounds += r.k_eff > 0
            for i in range(r.k_eff):
                r.eligible_pos[i] += 1
        # 1. proposals
        for r in rows:
            if r.ngram is not None and r.k_eff > 0:
                r.drafts = r.ngram.propose(r.seq, r.k_eff)[: r.k_eff]
        drafting_s = self._draft([r for r in rows if r.dslot is not None and r.k_eff > 0])
        drafting_s += self._eagle([r for r in rows if r.hcache is not None and r.k_eff > 0])
        # 2. one target pass over every row
        tc, dc = self._caches()
        feeds = [[r.seq[-1], *r.drafts] for r in rows]
        taps = self._taps(rows)
        t1 = time.perf_counter()
        logits = target_logits(self.engine.target, tc, [r.tslot for r in rows], feeds, taps)
        if taps:
            logits, tapped = logits
            tapped = tapped.split([len(f) for f in feeds])
        preds = split_rows(greedy_ids(logits).tolist(), feeds)
        t2 = time.perf_counter()
        fed = [len(f) for f in feeds]
        shares = self.cost.shares(fed)
        self.steps += 1
        # 3. acceptance and rollback, row by row
        eos = self.engine.eos_token_ids
        finished = []
        pass_s = t2 - t1
        mine = logits.split([len(p) for p in preds])  # each row's scores, one per fed token
        sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
        probs = dict(zip(sampled, probabilities_of([mine[i] for i in sampled],
                                                   [rows[i].sampling for i in sampled]),
                         strict=True))  # fmt: skip
        shared = (time.perf_counter() - t2) / max(1, len(sampled))
        callbacks_s, owns = 0.0, []
        for j, (r, p, share) in enumerate(zip(rows, preds, shares, strict=True)):
            r0 = time.perf_counter()
            d = r.drafts
            if r.sampling.greedy:
                m = 0
                while m < len(d) and d[m] == p[m]:
                    m += 1
                new = d[:m] + [p[m]]
            else:
                q = torch.stack(r.q) if r.q else None
                m, nxt = verify(d, q, probs[j], r.gen)
                new = d[:m] + [nxt]
            if r.logprobs is not None:
                r.logprobs += top_logprobs(mine[j][: len(new)], new, r.sampling.logprobs)
            # Its own draws and logprobs (a greedy row: ~0).
            own = time.perf_counter() - r0 + (0.0 if r.sampling.greedy else shared)
            owns.append(own)
            r.verify_s += pass_s * share + own
            r.rows_seen += len(rows)
            r.rounds += 1
            r.proposed += len(d)
            r.accepted += m
            for i in range(len(d)):
                r.proposed_pos[i] += 1
                r.accepted_pos[i] += i < m
            tc.crop(r.tslot, len(r.seq) + m)
            if r.hcache is not None:  # the states of what it committed: last + accepted
                r.aux_new.append(tapped[j][: m + 1])
            if r.dslot is not None and dc is not None:
                dc.crop(r.dslot, len(r.seq) + m)
            hit_eos = False
            for i, tok in enumerate(new):
                if tok in eos:
                    new, hit_eos = new[:i], True
                    if r.logprobs is not None:
                        del r.logprobs[len(r.out) + i :]
                    break
            r.seq += new
            r.out += new
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
        # The whole step but the draft passes (priced apart) and the caller's callbacks (text
        # work per committed token, whatever the arm): what a token fed costs every row.
        step_s = time.perf_counter() - t0 - drafting_s - callbacks_s
        self.cost.observe(sum(fed), step_s, len(rows))
        rest = max(0.0, step_s - sum(owns))
        for r, share, own in zip(rows, shares, owns, strict=True):
            r.cost_s += rest * share + own
        return finished

    def _draft(self, rows: list[Row]) -> float:
        """The draft model's guesses for `rows`: one batched pass per draft position, each row
        until it has its own k_eff guesses (the first pass also catches each row up on what
        was committed since its last turn). Returns the seconds it took."""
        if not rows:
            return 0.0
        start = time.perf_counter()
        rows = sorted(rows, key=lambda r: r.dslot)  # slot order: the draft cache read as a view
        _, dc = self._caches()
        drafter = self.engine.drafter
        head, ids = drafter.step.args
        active = rows
        feeds = [r.seq[dc.lengths[r.dslot] :] for r in rows]
        i = 0
        while active:
            t0 = time.perf_counter()
            scores = draft_scores(drafter.model, dc, [r.dslot for r in active], feeds, head)
            best = greedy_ids(scores)
            toks = (best if ids is None else ids[best]).tolist()
            dt = time.perf_counter() - t0
            if i > 0 or all(_steady(r, len(f)) for r, f in zip(active, feeds, strict=True)):
                self.draft_cost.observe(len(active), dt)
            # A sampled row draws its guess from the draft's distribution, kept for verify.
            r0 = time.perf_counter()
            sampled = [j for j, r in enumerate(active) if not r.sampling.greedy]
            qs = probabilities_of(
                [scores[j] for j in sampled], [active[j].sampling for j in sampled]
            )
            for j, q in zip(sampled, qs, strict=True):
                r = active[j]
                pick = draw(q, r.gen)
                toks[j] = pick if ids is None else int(ids[pick])
                r.q.append(self._full(q, ids))
            shared = (time.perf_counter() - r0) / max(1, len(sampled))
            for j, r in enumerate(active):
                own = 0.0 if r.sampling.greedy else shared
                r.drafts.append(toks[j])
                r.draft_s += dt / len(active) + own
                r.cost_s += dt / len(active) + own
            i += 1
            active = [r for r in active if r.k_eff > i]
            feeds = [[r.drafts[-1]] for r in active]
        return time.perf_counter() - start

    def _eagle(self, rows: list[Row]) -> float:
        """The EAGLE-3 head's guesses for `rows`: each reads the target states of what it
        committed since its last turn, then all draft their k_eff tokens together, one head
        pass per position (`Eagle3Head.draft_many`), greedy or drawn (a sampled row keeps each
        guess's distribution, over the target's vocabulary, for verify). Each row is charged an
        equal share of the time. `head_cost` times each pass against its rows, as `draft_cost`
        does: the rows' reads of their states are one pass over them all, then each shared pass
        (what a row adds to the head is the growth of the passes it is in; priced as an equal
        share, a guessing row beside another paid more than it added, and a plain row beside
        one guessing less than that neighbour's whole head costs every row of the step).
        Returns the seconds."""
        rows = [r for r in rows if r.aux_new]  # a one-token prompt: no target state yet
        if not rows:
            return 0.0
        start = time.perf_counter()
        head = self.engine.head
        ids = head.target_ids
        jobs = []
        steady = []  # per row: it reads one step's states (see `_steady`)
        for r in rows:
            fresh = torch.cat(r.aux_new) if len(r.aux_new) > 1 else r.aux_new[0]
            steady.append(_steady(r, fresh.shape[0]))
            r.aux_new = []
            choose = None
            if not r.sampling.greedy:

                def choose(scores, r=r):
                    q = probabilities_of([scores], [r.sampling])[0]
                    r.q.append(self._full(q, ids))
                    return draw(q, r.gen)

            jobs.append((r.seq, fresh, r.hcache, r.k_eff, choose))

        def timed(n: int, seconds: float, read: bool) -> None:
            if not read or all(steady):  # a catch-up read is the row's, not a guess's price
                self.head_cost.observe(n, seconds)

        for r, drafts in zip(rows, head.draft_many(jobs, on_pass=timed), strict=True):
            r.drafts = drafts
        dt = time.perf_counter() - start
        for r in rows:
            r.draft_s += dt / len(rows)
            r.cost_s += dt / len(rows)
        return dt

    def _full(self, q: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """A draft distribution over the target's vocabulary (a pruned head's: zero elsewhere;
        a draft with a smaller vocabulary: zero-padded)."""
        if self._vocab is None:
            self._vocab = self.engine.target.get_output_embeddings().weight.shape[0]
        if ids is None and q.shape[-1] == self._vocab:
            return q
        full = q.new_zeros(self._vocab)
        if ids is None:
            n = min(q.shape[-1], self._vocab)
            full[:n] = q[:n]
        else:
            full[ids] = q
        return full


def _steady(row: Row, fresh: int) -> bool:
    """Whether a row's proposer reads no more than one step commits (`arm.k` + 1 tokens) before
    it guesses. An eagle row's first turn reads its whole prompt's states, and a row the gate
    held back catches up on every step it sat out: those reads are the row's (charged to it),
    but not the price of a guess, which is what `draft_cost` and `head_cost` are for. (Timed in, they
    put an eagle:2 row's head at 20 ms a step instead of 4 at 2 rows on the AMD EPYC, and the
    gate then held back rows whose guesses paid 1.2x.)"""
    return fresh <= row.arm.k + 1


def sample_outputs(
    engine: SpeculativeEngine,
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
    batch = RowBatch(engine, max_rows=rows)
    outs, proposed = [], 0
    for start in range(0, n, rows):
        batch.join([(i, prompt, tokens, arm, replace(sampling, seed=seed0 + i))
                    for i in range(start, min(n, start + rows))])  # fmt: skip
        while batch.rows:
            for row, _ in batch.step():
                proposed += row.proposed
                outs.append(tuple(row.out[:tokens]) + (None,) * (tokens - len(row.out)))
    return outs, proposed
