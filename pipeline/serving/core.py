"""The serving core: a `Request` in, a `CoreResult` out, on one step loop; no HTTP. Shared by
the server, the local teacher and the bench (`make_core` builds every core).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from .. import compiling, drafts, models
from ..artifacts import weights_id
from ..config import Config
from ..errors import ConfigError
from ..speculative.arms import parse_arm, usable
from ..speculative.bandit import Context
from ..speculative.batch import RowBatch
from ..speculative.cost import drafting_seconds, head_rows, per_step
from ..speculative.goodput import GoodputBandit
from .policy import Policy, make_policy
from .request import CoreResult, Mode, Request, parse_mode
from .scheduler import Job, Scheduler
from .text import TextTracker

log = logging.getLogger(__name__)

# The step gate's caps stand this many steps while the same rows run (`ServingCore._gate`).
GATE_EVERY = 4

# What `ServingCore.calibrate` generates from (any short prompt: only the steps' times are kept).
CALIBRATION_PROMPT = "Write a Python function that returns the sum of the squares of a list."


class ServingCore:
    """Target (+ optional draft) models on one step loop, a tokenizer, and the policy."""

    def __init__(
        self,
        pair: models.Pair,
        policy: Policy,
        model_id: str,
        draft_id: str | None,
        default_mode: str = "bandit",
        max_rows: int = 16,
        limit: int | None = None,
        draft_info: dict | None = None,
        target_spec: str | None = None,
        start: bool = True,
    ):
        """`limit`: longest prompt + output (default the models' context); `draft_info`:
        `ServedDraft.describe()`; `start=False`: the loop runs on the caller's thread until
        `scheduler.start()`."""
        self.pair = pair
        self.tokenizer = pair.tokenizer
        self.policy = policy
        self.model_id = model_id
        self.draft_id = draft_id
        self.draft_info = draft_info
        self.target_spec = target_spec or model_id
        self.has_draft = pair.models.drafter is not None
        self.has_head = pair.models.head is not None
        self.has_parallel = pair.models.parallel_token is not None
        if not all(usable(a, *self.kinds) for a in policy.arms):
            raise ValueError(
                f"bandit arms {policy.arms} include draft, pard or eagle arms, and there is no "
                "draft model (trained for parallel drafting, for pard) or head for them"
            )
        self.default_mode = parse_mode(default_mode, policy.arms, *self.kinds)
        self.scheduler = Scheduler(RowBatch(pair.models, max_rows, limit), gate=self._gate,
                                   start=start)  # fmt: skip
        self._labels = {0: draft_id}  # draft epoch -> the draft's label
        self._gate_memo: tuple[int, int, list[int]] | None = None  # (changes, step, caps)
        # A longer prompt cannot fit the context whatever its tokens: refused before tokenising.
        self.max_prompt_chars = self.max_context * models.longest_token_chars(self.tokenizer)

    # -- what the server reads --------------------------------------------------------------------
    @property
    def models(self):
        """The models the step loop runs over now."""
        return self.scheduler.batch.models

    @property
    def bandit(self):
        return self.policy.bandit

    @property
    def guard(self):
        return self.policy.guard

    @property
    def draft_epoch(self) -> int:
        return self.scheduler.batch.epoch

    @property
    def compiled(self) -> bool:
        """Whether the target's steps run compiled (`compiling.compile_engine`)."""
        runner = getattr(self.models.target, "_phoenix_runner", None)
        return runner is not None and runner.compiled

    @property
    def generating(self) -> int:
        """Requests in the batch now (not those waiting to join)."""
        return self.scheduler.running

    @property
    def max_context(self) -> int:
        return self.scheduler.batch.limit

    def mode(self, text: str | None) -> Mode:
        if text is None:
            return self.default_mode
        return parse_mode(text, self.policy.arms, *self.kinds)

    def chat_prompt_ids(
        self, messages: list[dict], template_kwargs: dict | None = None
    ) -> list[int]:
        return models.chat_prompt_ids(self.tokenizer, messages, template_kwargs)

    def text_prompt_ids(self, text: str) -> list[int]:
        return models.text_prompt_ids(self.tokenizer, text)

    @property
    def kinds(self) -> tuple[bool, bool, bool]:
        """(has_draft, has_head, has_parallel): what `usable` and `parse_mode` ask of an engine."""
        return self.has_draft, self.has_head, self.has_parallel

    def _drafting_curves(self) -> tuple:
        """The measured (draft, head, parallel draft) pass curves (None: not measured yet)."""
        b = self.scheduler.batch
        return tuple(c.curve() if c.seen else None
                     for c in (b.draft_cost, b.head_cost, b.parallel_cost))  # fmt: skip

    # -- the hand-off -----------------------------------------------------------------------------
    def context(self, prompt_tokens: int, temperature: float = 0.0) -> Context:
        """What the policy sees of the batch a request would join now."""
        batch, s = self.scheduler.batch, self.scheduler
        others = s.running + s.waiting
        rows = min(batch.max_rows, others + 1)
        running = list(batch.rows)
        beside = running[: rows - 1]  # the rows it would run beside
        fed, tokens = per_step(beside)
        plain = max(0, rows - 1 - len(running))  # waiting requests: counted as plain rows
        draft, head, par = self._drafting_curves()
        return Context(
            prompt_tokens=prompt_tokens,
            queue_depth=others,
            rows=rows,
            step_cost=batch.cost.curve(rows) if batch.cost.seen else None,
            draft_cost=draft,
            draft_rows=sum(1 for r in beside if r.dslot is not None and r.arm.strategy == "draft"),
            parallel_cost=par,
            parallel_rows=sum(
                1 for r in beside if r.dslot is not None and r.arm.strategy == "pard"
            ),
            head_cost=head,
            head_rows=head_rows(beside),
            temperature=temperature,
            others_fed=fed + plain,
            others_tokens=tokens + plain,
            others_drafting=drafting_seconds(beside, draft, head, par),
            alone_cost=batch.cost.curve(1) if batch.cost.seen else None,
        )

    def _gate(self, rows: list) -> list[int]:
        """Per-step caps on each row's guesses, redone when rows change or every `GATE_EVERY`
        steps. Caps bound guesses only, so outputs stay exact."""
        batch = self.scheduler.batch
        if not batch.cost.seen:
            return [r.k_eff for r in rows]
        memo = self._gate_memo
        if memo is not None and memo[0] == batch.changes and batch.steps - memo[1] < GATE_EVERY:
            return memo[2]
        caps = self.policy.may_guess(rows, batch.cost.curve(len(rows)), *self._drafting_curves())
        self._gate_memo = (batch.changes, batch.steps, caps)
        return caps

    def calibrate(self, tokens: int = 16) -> None:
        """Before serving, time plain and every bandit arm alone (`RowBatch.calibrate`)."""
        arms = sorted({parse_arm(a) for a in self.policy.arms} | {parse_arm(0)},
                      key=lambda a: (a.k > 0, str(a)))  # fmt: skip
        prompt = self.chat_prompt_ids([{"role": "user", "content": CALIBRATION_PROMPT}])
        t0 = time.perf_counter()
        self.scheduler.call(lambda batch: batch.calibrate(prompt, arms, tokens))
        log.info("step loop: timed %s alone in %.1f s", ", ".join(map(str, arms)),
                 time.perf_counter() - t0)  # fmt: skip

    def submit(self, req: Request) -> None:
        """Hand one request to the loop (does not block): `req.future` gets its CoreResult."""
        context = self.context(len(req.prompt_ids), req.sampling.temperature)
        decision = self.policy.choose(context) if req.mode.kind == "bandit" else None
        arm = parse_arm(decision.arm) if decision else req.mode.arm
        tracker = TextTracker(self.tokenizer, req.stop)
        sent = [0]  # tokens whose logprobs went out with their text

        def covered(out: list[int], logprobs: list | None) -> list:
            """Logprob entries (token, logprob, top) of the tokens whose text is now final."""
            if logprobs is None:
                return []
            n = min(tracker.covered(out), len(logprobs))
            entries = [(out[i], *logprobs[i]) for i in range(sent[0], n)]
            sent[0] = max(sent[0], n)
            return entries

        def on_tokens(out: list[int], logprobs: list | None = None) -> bool:
            delta = tracker.update(out)
            entries = covered(out, logprobs)
            if (delta or entries) and req.on_text is not None:
                req.on_text(delta, entries)
            return tracker.stopped

        def on_done(job: Job) -> None:
            if job.error is not None:
                req.future.set_exception(job.error)
                return
            res = job.result
            if not tracker.stopped:
                tracker.update(res.token_ids)
            tail = tracker.rest()
            entries = covered(res.token_ids, res.logprobs)
            if (tail or entries) and req.on_text is not None:
                req.on_text(tail, entries)
            cancelled = req.cancel.is_set()
            # vLLM's name for a request whose client left: not a success, not a stop string.
            finish = "abort" if cancelled else ("stop" if tracker.stopped else res.finish_reason)
            out = CoreResult(
                tracker.text, finish, req.mode, res, decision, tracker.stopped,
                draft=self._labels.get(job.epoch), rows=context.rows,
                temperature=req.sampling.temperature,
                logprobs=None if res.logprobs is None else [
                    (t, *e) for t, e in zip(res.token_ids[: sent[0]], res.logprobs, strict=False)
                ],
            )  # fmt: skip
            # A reward earned (even in part) on a draft swapped out since is not the new one's.
            stale = (arm.needs_draft or arm.needs_parallel) and job.epoch != self.draft_epoch
            if decision is not None and not cancelled and not stale:
                load = max(1, round(res.batch_rows))
                cost = self.scheduler.batch.cost.curve(load)
                out.guard_event = self.policy.reward(decision, out, context, cost, load)
            req.future.set_result(out)

        job = Job(req.prompt_ids, req.max_tokens, arm, on_done, on_tokens, req.cancel,
                  req.submitted, sampling=req.sampling, adaptive=decision is not None)  # fmt: skip
        self.scheduler.submit(job)

    def generate(self, req: Request, timeout: float | None = None) -> CoreResult:
        """`submit` and wait; a loop not started runs here until done."""
        self.submit(req)
        if not self.scheduler.started:
            self.scheduler.drain()
        return req.result(timeout)

    def swap_draft(self, pair: models.Pair, draft_id: str, draft_info: dict) -> float:
        """Serve `pair` (same target, new draft; `draft_info`: `ServedDraft.describe()`) from the
        next step on. Running rows stay exact (their rewards are dropped); the replaced draft's
        or head's arm statistics and the guard's speculative window start over. Returns the
        seconds generation paused."""

        def swap(batch: RowBatch) -> float:
            t0 = time.perf_counter()
            batch.set_models(pair.models)
            self.pair, self.draft_id, self.draft_info = pair, draft_id, draft_info
            self._labels[batch.epoch] = draft_id
            self.policy.forget_draft_arms(*served_weights(pair, (draft_info or {}).get("head")))
            return time.perf_counter() - t0

        paused = self.scheduler.call(swap)
        self.policy.save()
        return paused

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop (waiting requests hear `Cancelled`) and write the policy's state."""
        self.scheduler.stop(timeout)
        self.policy.save()


def served_weights(pair: models.Pair, head: str | None = None) -> tuple[str | None, str | None]:
    """(draft, head) weights ids: a directory's hash, else the spec text; None if none. `head`:
    a head served beside the draft model; a draft that is a head counts as the head."""
    ref = pair.draft_ref
    if ref is None:
        return None, None
    if pair.models.drafter is None and pair.models.head is not None:  # the draft is a head
        return None, weights_of(ref)
    return weights_of(ref), weights_of(head) if head and pair.models.head is not None else None


def weights_of(ref: str) -> str:
    return (weights_id(ref) if Path(ref).is_dir() else None) or str(ref)


def build_core(
    cfg: Config, ws, served=None, mode: str | None = None, full_head: bool = False
) -> ServingCore:
    """Load the models and build a started core. `served`: `drafts.resolve_served`'s (None:
    target only); `full_head`: ignore `engine.draft_vocab`."""
    mode = mode or cfg.server.mode
    pair = models.load_pair(
        cfg,
        ws,
        served.spec if served else None,
        full_head=full_head,
        head_dir=served.head if served else None,
    )
    compiling.compile_engine(cfg, ws, pair)  # before /health says ready: warm, not in a request
    core = make_core(
        cfg,
        pair,
        mode,
        draft_id=served.label if served else None,
        draft_info=served.describe() if served else None,
        state_file=ws.state / "bandit.json",
        prior=drafts.bench_prior(cfg, ws, served),
        start=False,
    )
    bandit = core.policy.bandit
    if isinstance(bandit, GoodputBandit) and bandit.positions:  # acceptance known: time steps
        core.calibrate()  # here, on the thread that loaded the models (`Scheduler`)
    core.scheduler.start()
    return core


def _check_parallel(pair: models.Pair, mode: str, arms: list) -> None:
    """A draft that names no mask token asked to draft in parallel: ConfigError (exit 2) when
    the mode asks it; the bandit's pard:K arms are dropped with a WARNING (as eagle:K arms
    without a head are: a base draft benched beside a trained one has none)."""
    if pair.models.drafter is None or pair.models.parallel_token is not None:
        return
    why = (f"the draft {pair.draft_ref} names no mask token: its config.json has neither "
           "pard_token nor ptd_token_id (train it with train.parallel=K)")  # fmt: skip
    if mode.strip().startswith("pard"):
        raise ConfigError(f"mode {mode} drafts in parallel, and {why}")
    dropped = [str(a) for a in arms if parse_arm(a).needs_parallel]
    if dropped:
        log.warning("bandit: %s dropped: %s", ", ".join(dropped), why)


def make_core(
    cfg: Config,
    pair: models.Pair,
    mode: str | None = None,
    draft_id: str | None = None,
    draft_info: dict | None = None,
    state_file: Path | None = None,
    max_batch: int | None = None,
    policy: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    prior: tuple[dict, str] | None = None,
    start: bool = True,
) -> ServingCore:
    """Build a core, its policy from `cfg.bandit`. Defaults: `mode` `server.mode`, `max_batch`
    `server.max_batch`, `policy` `bandit.policy`. `draft_id`: the draft's label; `draft_info`:
    `ServedDraft.describe()`; `prior`: `drafts.bench_prior`'s; `start`: as `ServingCore`'s."""
    has_draft = pair.draft_ref is not None
    m = pair.models
    has = (m.drafter is not None, m.head is not None, m.parallel_token is not None)
    _check_parallel(pair, mode or cfg.server.mode, cfg.bandit.arms)
    arms = [a for a in cfg.bandit.arms if usable(a, *has)] or ["0"]
    beside = (draft_info or {}).get("head")  # an EAGLE-3 head beside the draft model, if any
    draft, head = served_weights(pair, beside) if state_file is not None else (None, None)
    chooser = make_policy(cfg.bandit, arms, state_file, policy, clock, draft_weights=draft,
                          prior=prior, head_weights=head)  # fmt: skip
    return ServingCore(
        pair,
        chooser,
        model_id=cfg.models.served_name or cfg.models.target,
        draft_id=draft_id if has_draft else None,
        draft_info=draft_info if has_draft else None,
        target_spec=cfg.models.target,
        default_mode=mode or cfg.server.mode,
        max_rows=cfg.server.max_batch if max_batch is None else max_batch,
        limit=cfg.engine.max_context,
        start=start,
    )
