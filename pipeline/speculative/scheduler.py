"""The step loop: one scheduler owns the models and advances every running request together.

Every request (plain, draft:K, ngram:K; streamed or not) is a `Job` handed to `StepLoop.submit`.
Jobs join between steps (their prompts prefilled, batched among the joiners) and leave when
they finish, are cancelled, or fail. One step:
  1. proposals, each row by its own arm: the rows drafting with the draft model step together,
     one batched draft pass per draft position (a row drops out once it has its k guesses);
     n-gram rows by lookup; plain rows none;
  2. one target pass over every row's `[last, d1..dk]` (ragged: each row its own length, 0
     guesses included), on per-row caches (`rows.RowCache`);
  3. each row's acceptance (the longest prefix the target agrees with, plus the target's own
     next token) and its own cache rollback. Every committed token is the target's greedy
     choice, so each row's output is its target-only greedy output, whatever else ran beside it.

Cost: a row's share of a step's time is the step's fixed part split equally among its rows plus
the part its own fed tokens add (`StepCost`: time = a + b * tokens fed, fitted online). A row's
`cost_s` is its prefill plus its shares; `tokens / cost_s` is what its arm cost the batch
(the policy's reward). With one row the share is the whole step: tokens/s as a lone request
sees them.

This module is the only one in the serving path that starts a thread: the loop's own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .arms import Arm
from .engine import GenerationResult, SpeculativeEngine
from .proposers import NgramProposer
from .rows import RowCache, draft_next, prefill, target_scores

log = logging.getLogger(__name__)


class Cancelled(Exception):
    """The caller cancelled (client gone, shutdown) before its generation could start or finish."""


@dataclass(eq=False)
class Job:
    """One request as the loop runs it. `on_tokens(output_so_far)` runs in the loop's thread
    after each step that added tokens; True ends the row (a stop string). `cancel` set: the row
    leaves after the current step with its output so far (before it joins: `Cancelled`)."""

    prompt: list[int]
    max_tokens: int
    arm: Arm
    on_tokens: Callable[[list[int]], bool] | None = None
    cancel: threading.Event | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def finish(self, result=None, error=None) -> None:
        self.result, self.error = result, error
        self.done.set()


@dataclass(eq=False)
class _Row:
    job: Job
    seq: list[int]
    tslot: int
    dslot: int | None
    ngram: NgramProposer | None
    start: float
    epoch: int
    out: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    k_eff: int = 0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    proposed_pos: list[int] = field(default_factory=list)
    accepted_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    cost_s: float = 0.0
    first_s: float | None = None


class StepCost:
    """Step time = a + b * tokens fed, fitted by exponentially weighted least squares over the
    steps seen (a prior until they vary). Pure."""

    def __init__(self, a: float = 1.0, b: float = 0.0, decay: float = 0.995):
        self.prior = (a, b)
        self.decay = decay
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.sw = d * self.sw + 1
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        var = self.sw * self.sxx - self.sx * self.sx
        if self.sw >= 4 and var > 1e-9 * max(1.0, self.sw * self.sxx):
            b = (self.sw * self.sxy - self.sx * self.sy) / var
            a = (self.sy - b * self.sx) / self.sw
            if a > 0 and b >= 0:
                return a, b
        return self.prior

    def shares(self, fed: list[int]) -> list[float]:
        """Each row's fraction of a step that fed these token counts (they sum to 1)."""
        a, b = self.coefficients()
        n = len(fed)
        parts = [a / n + b * f for f in fed]
        total = sum(parts)
        return [p / total for p in parts] if total > 0 else [1 / n] * n


class StepLoop:
    """The scheduler (module docstring). `max_rows` running at most; the rest wait in order.
    `beat()` is called after every step and prefill (the server's stuck detection)."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        max_rows: int = 16,
        beat: Callable[[], None] | None = None,
        cost: StepCost | None = None,
    ):
        self.engine = engine
        self.max_rows = max(1, max_rows)
        self.beat = beat or (lambda: None)
        self.cost = cost or StepCost()
        self.limit = engine.max_context or 4096
        self.queue: queue.Queue[Job] = queue.Queue()
        self.calls: queue.Queue[tuple[Callable, threading.Event, list]] = queue.Queue()
        self.rows: list[_Row] = []
        self.epoch = 0  # bumped by a draft swap
        self.max_rows_seen = 0
        self.steps = 0
        self._tcache: RowCache | None = None
        self._dcache: RowCache | None = None
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phoenix-steps", daemon=True)
        self._thread.start()

    # -- callers' side --------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.rows)

    def check(self, prompt: list[int], max_tokens: int, arm: Arm) -> None:
        """Refuse a request that cannot join (alone, before it joins)."""
        if not prompt:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(prompt) >= self.limit:
            raise ValueError(f"prompt of {len(prompt)} tokens fills the {self.limit}-token context")
        if arm.needs_draft and self.engine.drafter is None:
            raise ValueError(f"arm {arm} needs a draft model; this engine has none")

    def submit(self, job: Job) -> GenerationResult:
        """Run one job to its end (blocking); raises `Cancelled` if it was cancelled before it
        joined, or the error that failed its step."""
        self.check(job.prompt, job.max_tokens, job.arm)
        self.queue.put(job)
        self._wake.set()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def call(self, fn: Callable[[StepLoop], object]) -> object:
        """Run `fn(loop)` in the loop's thread between two steps (a draft swap); returns its
        value or raises its error."""
        done, box = threading.Event(), []
        self.calls.put((fn, done, box))
        self._wake.set()
        done.wait()
        value, error = box
        if error is not None:
            raise error
        return value

    # -- the loop -------------------------------------------------------------------------------
    def _caches(self) -> tuple[RowCache, RowCache | None]:
        if self._tcache is None:
            self._tcache = RowCache(self.engine.target, self.max_rows, self.limit)
        if self._dcache is None and self.engine.drafter is not None:
            self._dcache = RowCache(self.engine.drafter.model, self.max_rows, self.limit)
        return self._tcache, self._dcache

    def reset_draft(self) -> None:
        """A new draft (same target): its cache starts empty and every draft row catches up on
        its next proposal. Loop thread only (`call`)."""
        self.epoch += 1
        self._dcache = None
        if self.engine.drafter is None:
            for r in self.rows:
                r.dslot = None
            return
        _, dc = self._caches()
        for r in self.rows:
            if r.dslot is not None:
                r.dslot = dc.alloc()

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                self._run_calls()
                if not self.rows and self.queue.empty():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._drop_cancelled()
                self._admit()
                if not self.rows:
                    continue
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - the step's rows hear of it; the loop goes on
                    log.exception("step failed; its %d rows fail with it", len(self.rows))
                    for r in self.rows:
                        r.job.finish(error=exc)
                    self.rows = []
                    self._tcache = self._dcache = None
                self.beat()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, done, box = self.calls.get_nowait()
            except queue.Empty:
                return
            try:
                box[:] = [fn(self), None]
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                box[:] = [None, exc]
            done.set()

    def _release(self, row: _Row) -> None:
        tc, dc = self._caches()
        moved = tc.release(row.tslot)
        if moved is not None:
            next(r for r in self.rows if r.tslot == moved).tslot = row.tslot
        if row.dslot is not None and dc is not None:
            moved = dc.release(row.dslot)
            if moved is not None:
                next(r for r in self.rows if r.dslot == moved).dslot = row.dslot
        self.rows.remove(row)

    def _finish(self, row: _Row, reason: str) -> None:
        self._release(row)
        now = time.perf_counter()
        arm = row.job.arm
        row.job.finish(
            GenerationResult(
                token_ids=row.out,
                arm=str(arm),
                finish_reason=reason,
                latency_s=now - row.start,
                draft_s=row.draft_s,
                verify_s=row.verify_s,
                prompt_tokens=len(row.job.prompt),
                proposed=row.proposed,
                accepted=row.accepted,
                rounds=row.rounds,
                proposed_per_position=row.proposed_pos,
                accepted_per_position=row.accepted_pos,
                first_token_s=row.first_s,
                cost_s=row.cost_s,
                queued_s=row.start - row.job.submitted,
            )
        )

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.rows if r.job.cancelled]:
            self._finish(r, "stop")

    def _admit(self) -> None:
        """Let waiting jobs join up to `max_rows`: prefill their prompts (target, and the draft
        for draft arms), all joiners in one batched pass per model."""
        room = self.max_rows - len(self.rows)
        jobs: list[Job] = []
        while len(jobs) < room:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job.cancelled:
                job.finish(error=Cancelled("cancelled while waiting to join"))
                continue
            jobs.append(job)
        if not jobs:
            return
        tc, dc = self._caches()
        now = time.perf_counter()
        joined = []
        for job in jobs:
            needs = job.arm.needs_draft and job.arm.k > 0
            row = _Row(
                job=job,
                seq=list(job.prompt),
                tslot=tc.alloc(),
                dslot=dc.alloc() if needs and dc is not None else None,
                ngram=NgramProposer() if job.arm.strategy == "ngram" and job.arm.k > 0 else None,
                start=now,
                epoch=self.epoch,
                proposed_pos=[0] * job.arm.k,
                accepted_pos=[0] * job.arm.k,
            )
            joined.append(row)
        self.rows += joined
        pad = self.engine.pad_token_id
        try:
            t0 = time.perf_counter()
            prefill(self.engine.target, tc, [r.tslot for r in joined],
                    [r.seq[:-1] for r in joined], pad)  # fmt: skip
            t1 = time.perf_counter()
            drafting = [r for r in joined if r.dslot is not None]
            if drafting:
                prefill(self.engine.drafter.model, dc, [r.dslot for r in drafting],
                        [r.seq[:-1] for r in drafting], pad)  # fmt: skip
            t2 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - only the joiners fail
            log.exception("prefill failed for %d joining rows", len(joined))
            for r in joined:
                self._release(r)
                r.job.finish(error=exc)
            return
        sizes = [max(1, len(r.seq) - 1) for r in joined]
        for r, n in zip(joined, sizes, strict=True):  # each joiner pays for its own prompt
            r.verify_s += (t1 - t0) * n / sum(sizes)
            r.cost_s += (t1 - t0) * n / sum(sizes)
        for r in drafting:
            r.draft_s += (t2 - t1) / len(drafting)
            r.cost_s += (t2 - t1) / len(drafting)
        self.max_rows_seen = max(self.max_rows_seen, len(self.rows))
        self.beat()

    def _step(self) -> None:
        rows = list(self.rows)
        for r in rows:
            k = min(r.job.arm.k, r.job.max_tokens - len(r.out) - 1, self.limit - len(r.seq) - 1)
            r.k_eff, r.drafts = max(0, k), []
        # 1. proposals
        for r in rows:
            if r.ngram is not None and r.k_eff > 0:
                r.drafts = r.ngram.propose(r.seq, r.k_eff)[: r.k_eff]
        self._draft([r for r in rows if r.dslot is not None and r.k_eff > 0])
        t1 = time.perf_counter()
        # 2. one target pass over every row
        tc, dc = self._caches()
        feeds = [[r.seq[-1], *r.drafts] for r in rows]
        preds = target_scores(self.engine.target, tc, [r.tslot for r in rows], feeds,
                              self.engine.pad_token_id)  # fmt: skip
        t2 = time.perf_counter()
        fed = [len(f) for f in feeds]
        self.cost.observe(sum(fed), t2 - t1)
        shares = self.cost.shares(fed)
        self.steps += 1
        # 3. acceptance and rollback, row by row
        eos = self.engine.eos_token_ids
        now = time.perf_counter()
        for r, p, share in zip(rows, preds, shares, strict=True):
            r.verify_s += (t2 - t1) * share
            r.cost_s += (t2 - t1) * share
            d = r.drafts
            m = 0
            while m < len(d) and d[m] == p[m]:
                m += 1
            new = d[:m] + [p[m]]
            r.rounds += 1
            r.proposed += len(d)
            r.accepted += m
            for i in range(len(d)):
                r.proposed_pos[i] += 1
                r.accepted_pos[i] += i < m
            tc.crop(r.tslot, len(r.seq) + m)
            if r.dslot is not None and dc is not None:
                dc.crop(r.dslot, len(r.seq) + m)
            hit_eos = False
            for i, tok in enumerate(new):
                if tok in eos:
                    new, hit_eos = new[:i], True
                    break
            r.seq += new
            r.out += new
            if r.first_s is None:
                r.first_s = now - r.start
            stop = False
            if new and r.job.on_tokens is not None:
                stop = bool(r.job.on_tokens(r.out))
            if hit_eos or stop:
                self._finish(r, "stop")
            elif len(r.out) >= r.job.max_tokens or len(r.seq) >= self.limit:
                self._finish(r, "length")

    def _draft(self, rows: list[_Row]) -> None:
        """The draft model's guesses for `rows`: one batched pass per draft position, each row
        until it has its own k_eff guesses. Time is shared equally by the rows of each pass."""
        if not rows:
            return
        _, dc = self._caches()
        drafter = self.engine.drafter
        head, ids = drafter.step.args
        pad = self.engine.pad_token_id
        active = rows
        feeds = [r.seq[dc.lengths[r.dslot] :] for r in rows]  # catch up on what was committed
        i = 0
        while active:
            t0 = time.perf_counter()
            toks = draft_next(drafter.model, dc, [r.dslot for r in active], feeds, pad, head, ids)
            dt = time.perf_counter() - t0
            for r, t in zip(active, toks, strict=True):
                r.drafts.append(t)
                r.draft_s += dt / len(active)
                r.cost_s += dt / len(active)
            i += 1
            active = [r for r in active if r.k_eff > i]
            feeds = [[r.drafts[-1]] for r in active]
