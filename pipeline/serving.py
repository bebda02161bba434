"""The serving core: engine + tokenizer + bandit, one request at a time.

Shared by the HTTP server (which includes the local teacher) and the benchmark, so a number the
benchmark measures is a number the server delivers: `make_core` builds every core, with the
config's bandit settings. Knows modes, text and stop strings; knows nothing of HTTP. A finished
request is a `CoreResult`; `CoreResult.record()` is its one flat record, which responses,
metrics, Sentry, traffic capture and the bench all read.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import models
from .config import BanditConfig, Config
from .speculative.arms import PLAIN, Arm, canonical, parse_arm
from .speculative.bandit import (
    Context,
    ContextualBandit,
    Decision,
    DriftGuard,
    EpsilonGreedy,
    load_bandit,
    save_bandit,
)
from .speculative.batch import TargetBatch
from .speculative.engine import GenerationResult, SpeculativeEngine
from .speculative.scheduler import Cancelled  # one class for every path that can be cancelled

log = logging.getLogger(__name__)


class ModeError(ValueError):
    """A mode string that is malformed or names an arm this core cannot run."""


class Heartbeat:
    """Whether generation is making progress: `working` brackets each generation, `beat` marks
    a round (or a batch step). `stalled_s` is how long work has been running without a beat,
    0.0 when idle; the server's /health turns 503 past a bound."""

    def __init__(self):
        self._lock = threading.Lock()
        self.active = 0
        self.last = time.monotonic()

    def beat(self) -> None:
        self.last = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        with self._lock:
            if self.active == 0:
                self.last = time.monotonic()
            self.active += 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1
                self.last = time.monotonic()

    def stalled_s(self) -> float:
        return time.monotonic() - self.last if self.active else 0.0


@dataclass(frozen=True)
class Mode:
    kind: str  # "target" | "arm" (one arm for every request) | "bandit"
    arm: Arm = PLAIN

    @property
    def k(self) -> int:
        return self.arm.k

    @property
    def name(self) -> str:
        """The transaction and bench row name: target, fixed_K, ngram_K, bandit."""
        return self.arm.name if self.kind == "arm" else self.kind

    @property
    def spec(self) -> str:
        """As a request writes it: target, fixed:K, ngram:K, bandit."""
        if self.kind != "arm":
            return self.kind
        return f"fixed:{self.k}" if self.arm.strategy == "draft" else str(self.arm)


def fixed(arm) -> Mode:
    """The mode that runs one arm (`0` is target)."""
    a = parse_arm(arm)
    return Mode("target") if a == PLAIN else Mode("arm", a)


def parse_mode(text: str, arms: list[str], has_draft: bool) -> Mode:
    """A request's (or the config's) mode: target, bandit, or one of `arms` as fixed:K / draft:K
    (the draft model) or ngram:K (also written fixed_K, ngram_K)."""
    text = text.strip()
    arms = canonical(arms)
    usable = [a for a in arms if has_draft or not parse_arm(a).needs_draft]
    valid = ", ".join(["target", "bandit", *(fixed(a).spec for a in usable if a != "0")])
    if text == "target":
        return Mode("target")
    if text == "bandit":
        if not any(a != "0" for a in usable):
            raise ModeError("mode 'bandit' needs a draft model or an ngram arm, and has neither")
        return Mode("bandit")
    try:
        arm = parse_arm(text.replace("_", ":", 1))
    except ValueError:
        raise ModeError(f"unknown mode {text!r}: the valid modes are {valid}") from None
    if arm.needs_draft and not has_draft:
        raise ModeError(
            f"mode {text!r} needs a draft model, and none is loaded; valid here: {valid}"
        )
    if str(arm) not in arms and arm != PLAIN:
        raise ModeError(f"bad mode {text!r}: not one of the configured arms; valid: {valid}")
    return fixed(arm)


class TextTracker:
    """Incremental detokenisation with stop strings: emits only text that is final."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int]) -> str:
        """Feed the full output so far; returns the new final text (may be empty)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stops:
            pos = text.find(s)
            if pos != -1:
                text = text[:pos]
                self.stopped = True
        self.text = text
        safe = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens
                safe = len(text.rstrip("\ufffd"))
            for s in self.stops:  # hold back a suffix that may grow into a stop string
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:n]):
                        safe -= n
                        break
        delta = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def rest(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


@dataclass
class CoreResult:
    text: str
    finish_reason: str
    mode: Mode
    result: GenerationResult
    decision: Decision | None
    stopped_by_string: bool = False
    guard_event: dict | None = None  # the drift guard fell back or recovered after this request
    draft: str | None = None  # the draft version that served it (draft_id at generation time)

    def record(self) -> dict:
        """The request's figures, flat: what every consumer reads. Decision fields are None
        for a request the bandit did not choose."""
        r, d = self.result, self.decision
        return {
            "mode": self.mode.spec,
            "arm": r.arm,
            "draft": self.draft,
            "finish_reason": self.finish_reason,
            "stopped_by_string": self.stopped_by_string,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "proposed": r.proposed,
            "accepted": r.accepted,
            "rounds": r.rounds,
            "acceptance": r.acceptance,
            "proposed_per_position": r.proposed_per_position,
            "accepted_per_position": r.accepted_per_position,
            "latency_s": r.latency_s,
            "first_token_s": r.first_token_s,
            "draft_s": r.draft_s,
            "verify_s": r.verify_s,
            "tokens_per_second": r.tokens_per_second,
            "explored": d.explored if d else None,
            "warmup": d.warmup if d else None,
            "fallback": d.fallback if d else None,  # held to plain generation by the drift guard
            "epsilon": d.epsilon if d else None,
            "guard_event": self.guard_event["event"] if self.guard_event else None,
        }


@dataclass(eq=False)
class BatchSlot:
    """One target-only request waiting in, or running in, the batcher."""

    prompt: list[int]
    max_tokens: int
    cancel: threading.Event | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def finish(self, result: GenerationResult | None = None, error: BaseException | None = None):
        self.result, self.error = result, error
        self.done.set()


def _live(slots: list[BatchSlot]) -> list[BatchSlot]:
    """The slots whose caller is still there; the others hear that they never joined."""
    live = []
    for slot in slots:  # one look at each flag: it may flip meanwhile
        if slot.cancelled:
            slot.finish(error=Cancelled("cancelled while waiting for the batch"))
        else:
            live.append(slot)
    return live


class TargetBatcher:
    """Gathers concurrent target-only requests and generates them as one padded batch that new
    requests join as they arrive (continuous batching, `engine.TargetBatch`).

    Callers block in `submit`. One worker thread takes the first waiting request, waits up to
    `gather_s` for more (at most `max_batch`), and steps the batch one token at a time; before
    each step it lets waiting requests join (up to `max_batch` rows) and drops the rows whose
    caller cancelled, and each caller is released as soon as its own row finishes. Each step
    (and each join's prefill) runs under the core's lock, so it never overlaps a speculative
    request."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        lock: threading.Lock,
        max_batch: int,
        gather_s: float = 0.02,
        heartbeat: Heartbeat | None = None,
    ):
        self.engine = engine
        self.lock = lock
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.heartbeat = heartbeat or Heartbeat()
        self.queue: queue.Queue[BatchSlot] = queue.Queue()
        self.yield_to: threading.Event | None = None  # set: step after it clears
        self.max_rows = 0  # the most rows one step carried
        self._active = 0  # rows generating now
        threading.Thread(target=self._work, name="phoenix-batcher", daemon=True).start()

    def submit(
        self, prompt_ids: list[int], max_tokens: int, cancel: threading.Event | None = None
    ) -> GenerationResult:
        TargetBatch.check_row(prompt_ids, max_tokens)  # refused alone, never failing a batch
        slot = BatchSlot(prompt_ids, max_tokens, cancel)
        self.queue.put(slot)
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _take(self, room: int, block: bool) -> list[BatchSlot]:
        slots: list[BatchSlot] = []
        if block:
            slots.append(self.queue.get())
            deadline = time.monotonic() + self.gather_s
            while len(slots) < room:
                try:
                    slots.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
        while len(slots) < room:
            try:
                slots.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return _live(slots)

    def _fail_cancelled_waiting(self) -> None:
        """While the batch is full, callers that left stop waiting for room (order kept)."""
        waiting: list[BatchSlot] = []
        while True:
            try:
                waiting.append(self.queue.get_nowait())
            except queue.Empty:
                break
        for slot in _live(waiting):
            self.queue.put(slot)

    @property
    def active_rows(self) -> int:
        return self._active

    def _work(self) -> None:
        batch = TargetBatch(self.engine)
        while True:
            new = (
                self._take(self.max_batch - batch.active, block=not batch.active)
                if batch.joinable
                else []
            )
            if batch.active >= self.max_batch:
                self._fail_cancelled_waiting()
            while self.yield_to is not None and self.yield_to.is_set():
                time.sleep(0.005)  # a draft swap waits for the lock: let it go first
            try:
                with self.lock:
                    for slot in batch.drop(lambda s: s.cancelled):
                        slot.finish(error=Cancelled("cancelled mid-generation"))
                    batch.add([(slot, (slot.prompt, slot.max_tokens)) for slot in new])
                    self.max_rows = max(self.max_rows, batch.active)
                    self._active = batch.active
                    finished = batch.step()
                    self._active = batch.active
                self.heartbeat.beat()
            except Exception as exc:  # every caller in the batch hears of it
                for slot in {*batch.keys(), *new}:
                    slot.finish(error=exc)
                batch = TargetBatch(self.engine)
                continue
            for slot, result in finished:
                slot.finish(result=result)


class ServingCore:
    """Target (+ optional draft) engine, tokenizer, bandit. `generate` is serialised."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        tokenizer,
        bandit: EpsilonGreedy,
        model_id: str,
        draft_id: str | None,
        default_mode: str = "bandit",
        state_file: Path | None = None,
        max_batch: int = 1,
        guard: DriftGuard | None = None,
        draft_info: dict | None = None,
        target_spec: str | None = None,
    ):
        """`guard`: fall back to plain generation when speculation stops paying (bandit
        requests only; needs arm 0 among the bandit's arms). `draft_info`: what /v1/models says
        of the draft (drafts.ServedDraft.describe())."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.bandit = bandit
        self.model_id = model_id
        self.draft_id = draft_id
        self.draft_info = draft_info
        self.draft_epoch = 0  # bumped by each swap_draft
        self.pair: models.Pair | None = None  # what build_core loaded (a swap shares its target)
        self.target_spec = target_spec or model_id
        self.has_draft = engine.draft is not None
        if not self.has_draft and any(parse_arm(a).needs_draft for a in bandit.arms):
            raise ValueError(f"bandit arms {bandit.arms} include draft arms, and there is no draft")
        self.default_mode = parse_mode(default_mode, bandit.arms, self.has_draft)
        self.state_file = state_file
        self.plain_arm = next((a for a in bandit.arms if parse_arm(a) == PLAIN), None)
        self.guard = guard if self.plain_arm is not None else None
        self._inflight = 0  # requests inside generate (the policy's load context)
        self._count_lock = threading.Lock()
        self.lock = threading.Lock()
        self._swap_waiting = threading.Event()  # a draft swap waits for the lock: it goes next
        self._in_engine = False  # a speculative generation holds the lock
        self.heartbeat = Heartbeat()
        self.batcher = (
            TargetBatcher(engine, self.lock, max_batch, heartbeat=self.heartbeat)
            if max_batch > 1
            else None
        )
        if self.batcher is not None:
            self.batcher.yield_to = self._swap_waiting
        if state_file is not None:
            outcome = load_bandit(bandit, state_file)
            log.info("bandit state %s: %s", state_file, outcome)

    @property
    def generating(self) -> int:
        """Requests generating now (not those waiting for the lock or the batch)."""
        return int(self._in_engine) + (self.batcher.active_rows if self.batcher else 0)

    @property
    def max_context(self) -> int | None:
        return self.engine.max_context

    @property
    def static_context(self) -> bool:
        """Whether max_context is the static caches' length (engine.max_context)."""
        return self.engine.static_len is not None and self.engine.static_len == self.max_context

    def mode(self, text: str | None) -> Mode:
        return (
            self.default_mode
            if text is None
            else parse_mode(text, self.bandit.arms, self.has_draft)
        )

    def chat_prompt_ids(
        self, messages: list[dict], template_kwargs: dict | None = None
    ) -> list[int]:
        return models.chat_prompt_ids(self.tokenizer, messages, template_kwargs)

    def text_prompt_ids(self, text: str) -> list[int]:
        return models.text_prompt_ids(self.tokenizer, text)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        mode: Mode,
        stop: list[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> CoreResult:
        """Generate one request. `cancel` (a client gone, a shutdown) ends generation after the
        engine's current round, with the text so far; set before generation starts (while the
        request waits for the lock or the batch), it raises `Cancelled` instead."""
        with self._count_lock:
            self._inflight += 1
        try:
            with self.heartbeat.working():
                return self._generate(prompt_ids, max_tokens, mode, stop, on_text, cancel)
        finally:
            with self._count_lock:
                self._inflight -= 1

    def choose(self, context: Context) -> Decision:
        """The bandit's arm for a request, unless the drift guard holds it to plain generation."""
        if self.guard is not None and self.guard.hold():
            return Decision(self.plain_arm, False, False, 0.0, {}, {}, fallback=True)
        if self.guard is not None and self.guard.probe():
            means = dict(self.bandit.means)
            spec = [a for a in self.bandit.arms if a != self.plain_arm]
            arm = max(spec, key=lambda a: (means[a], -self.bandit.arms.index(a)))
            return Decision(arm, False, False, 0.0, means, dict(self.bandit.counts), probe=True)
        return self.bandit.choose(context)

    def _generate(self, prompt_ids, max_tokens, mode, stop, on_text, cancel) -> CoreResult:
        context = Context(len(prompt_ids), max(0, self._inflight - 1))
        decision = self.choose(context) if mode.kind == "bandit" else None
        arm = parse_arm(decision.arm) if decision else mode.arm
        tracker = TextTracker(self.tokenizer, stop or [])

        def should_stop(out: list[int]) -> bool:
            self.heartbeat.beat()
            delta = tracker.update(out)
            if delta and on_text is not None:
                on_text(delta)
            return tracker.stopped or (cancel is not None and cancel.is_set())

        draft_id, epoch = self.draft_id, self.draft_epoch
        if self.batcher is not None and arm.k == 0 and not tracker.stops and on_text is None:
            result = self.batcher.submit(prompt_ids, max_tokens, cancel)
        else:
            self._acquire(cancel)
            self._in_engine = True
            draft_id, epoch = self.draft_id, self.draft_epoch  # what this generation runs
            try:
                result = self.engine.generate(
                    prompt_ids,
                    arm.k,
                    max_tokens,
                    should_stop=should_stop,
                    strategy="draft" if arm.k == 0 else arm.strategy,
                )
            finally:
                self._in_engine = False
                self.lock.release()
        if not tracker.stopped:
            tracker.update(result.token_ids)
        tail = tracker.rest()
        if tail and on_text is not None:
            on_text(tail)
        cancelled = cancel is not None and cancel.is_set()
        # vLLM's name for a request whose client left: not a success, not a stop string.
        finish = "abort" if cancelled else ("stop" if tracker.stopped else result.finish_reason)
        event = None
        # A reward earned by a draft swapped out since is not the new draft's: dropped.
        stale = arm.needs_draft and epoch != self.draft_epoch
        if decision is not None and not cancelled and not stale:
            tps = result.tokens_per_second
            # Weighted by latency: an arm's mean is its tokens over its time, as the bench counts.
            weight = max(result.latency_s, 1e-6)
            self.bandit.update(decision.arm, tps, context, result.acceptance, weight)
            if self.state_file is not None:
                save_bandit(self.bandit, self.state_file)
            if self.guard is not None:
                exploited = not (decision.explored or decision.warmup or decision.fallback)
                event = self.guard.observe(arm.k == 0, exploited, tps)
            if event is not None:
                log.warning(
                    "speculation %s: exploited speculative arms %.2f tokens/s vs plain %.2f "
                    "(margin %.0f%%)%s",
                    event["event"],
                    event["speculative_tps"],
                    event["plain_tps"],
                    100 * event["margin"],
                    f"; plain generation for the next {event['cooldown_requests']} bandit "
                    "requests, then a probe"
                    if event["event"] == "fallback"
                    else "; the bandit drafts again",
                )
        return CoreResult(
            tracker.text, finish, mode, result, decision, tracker.stopped, event, draft_id
        )

    def swap_draft(self, pair: models.Pair, draft_id: str, draft_info: dict, prepare=None) -> float:
        """Serve `engine` (same target, a new draft) from the next request on: taken between
        requests (the generation lock), so a running generation finishes on the old draft.
        `prepare(engine)` runs under the lock first (compiling and warming the new draft's
        steps share the target's static cache). The draft arms' statistics start over; the
        drift guard forgets its speculative window. Returns the seconds generation waited."""
        self._swap_waiting.set()  # requests not yet generating wait: the swap goes next
        try:
            self._acquire(None, swap=True)
        finally:
            self._swap_waiting.clear()
        t0 = time.perf_counter()
        try:
            engine = pair.engine
            if prepare is not None:
                prepare(engine)
            self.engine, self.pair = engine, pair
            if self.batcher is not None:
                self.batcher.engine = engine  # same target; a running batch finishes as it is
            self.draft_id, self.draft_info = draft_id, draft_info
            self.draft_epoch += 1
            self.bandit.forget([a for a in self.bandit.arms if parse_arm(a).needs_draft])
            if self.guard is not None:
                self.guard.reset_speculative()
        finally:
            self.lock.release()
        if self.state_file is not None:
            try:  # the swap has happened; a state file that cannot be written does not undo it
                save_bandit(self.bandit, self.state_file)
            except OSError as exc:
                log.warning("bandit state %s not saved after the swap: %s", self.state_file, exc)
        return time.perf_counter() - t0

    def _acquire(
        self, cancel: threading.Event | None, poll_s: float = 0.05, swap: bool = False
    ) -> None:
        """Take the generation lock; give up with `Cancelled` if the caller cancels meanwhile.
        While a draft swap waits for the lock, requests let it go first (else a busy server
        would make it wait behind every queued request)."""
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled while waiting for the generation lock")
            if not swap and self._swap_waiting.is_set():
                time.sleep(poll_s)
                continue
            if self.lock.acquire(timeout=poll_s):
                return


def build_core(
    cfg: Config, ws, served=None, mode: str | None = None, full_head: bool = False
) -> ServingCore:
    """Load the models per config and build the server's core (the local teacher's too: mode
    target). `served`: the draft, already chosen (`drafts.resolve_served`); None: target only.
    `full_head`: the draft proposes over its whole vocabulary whatever `engine.draft_vocab`."""
    mode = mode or cfg.server.mode
    pair = models.load_pair(cfg, ws, served.spec if served else None, full_head=full_head)
    # A target-only server (the local teacher) compiles the one-token step alone; an ngram:K
    # request there verifies eagerly.
    arms = ["0"] if mode == "target" else cfg.bandit.arms
    models.compile_engine(cfg, ws, pair.engine, arms)
    return make_core(
        cfg,
        pair,
        mode,
        draft_id=served.label if served else None,
        draft_info=served.describe() if served else None,
        state_file=ws.state / "bandit.json",
    )


def make_core(
    cfg: Config,
    pair: models.Pair,
    mode: str | None = None,
    draft_id: str | None = None,
    draft_info: dict | None = None,
    state_file: Path | None = None,
    max_batch: int | None = None,
    policy: str | None = None,
) -> ServingCore:
    """Every serving core (server, local teacher, bench, tests) is built here, its bandit and
    drift guard from the config's `bandit` section. `mode`: the default mode (default
    `server.mode`); `draft_id`, `draft_info`: the draft's label (tags, metrics) and what
    /v1/models says of it; `max_batch`: plain requests batched together (default
    `server.max_batch`; the bench runs one at a time); `policy`: another `bandit.policy`."""
    has_draft = pair.draft_ref is not None
    arms = [a for a in cfg.bandit.arms if has_draft or not parse_arm(a).needs_draft] or ["0"]
    core = ServingCore(
        pair.engine,
        pair.tokenizer,
        make_bandit(cfg.bandit, arms, policy),
        model_id=cfg.models.served_name or cfg.models.target,
        draft_id=draft_id if has_draft else None,
        draft_info=draft_info if has_draft else None,
        target_spec=cfg.models.target,
        default_mode=mode or cfg.server.mode,
        state_file=state_file,
        max_batch=cfg.server.max_batch if max_batch is None else max_batch,
        guard=make_guard(cfg.bandit),
    )
    core.pair = pair
    return core


def make_bandit(
    b: BanditConfig, arms: list | None = None, policy: str | None = None, seed: int | None = None
) -> EpsilonGreedy:
    """A fresh bandit per the `bandit` section (over `arms`, default `bandit.arms`; `policy`
    and `seed` may replace the section's), seeded."""
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
