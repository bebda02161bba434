"""A request's mode, the `Request` handed to the core, and the `CoreResult` every consumer reads
(`record()`). Pure."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..speculative.arms import PLAIN, Arm, canonical, parse_arm, usable
from ..speculative.bandit import Decision
from ..speculative.row import GenerationResult
from ..speculative.sampling import GREEDY, Sampling


class ModeError(ValueError):
    """A mode string that is malformed or names an arm this core cannot run."""


class Cancelled(Exception):
    """The caller cancelled (client gone, shutdown) before its generation could start."""


class Refused(ValueError):
    """A request that cannot join (empty prompt, context full, an arm it cannot run)."""


@dataclass(frozen=True)
class Mode:
    kind: str  # "target" | "arm" (one arm for every request) | "bandit"
    arm: Arm = PLAIN

    @property
    def k(self) -> int:
        return self.arm.k

    @property
    def name(self) -> str:
        """The transaction and bench row name: target, fixed_K, eagle_K, ngram_K, bandit."""
        return self.arm.name if self.kind == "arm" else self.kind

    @property
    def spec(self) -> str:
        """As a request writes it: target, fixed:K, eagle:K, ngram:K, bandit."""
        if self.kind != "arm":
            return self.kind
        return f"fixed:{self.k}" if self.arm.strategy == "draft" else str(self.arm)


def fixed(arm) -> Mode:
    """The mode that runs one arm (`0` is target)."""
    a = parse_arm(arm)
    return Mode("target") if a == PLAIN else Mode("arm", a)


def parse_mode(text: str, arms: list[str], has_draft: bool, has_head: bool = False,
               has_parallel: bool = False) -> Mode:  # fmt: skip
    """target, bandit (needs a runnable speculative arm), or one of `arms` as fixed:K / draft:K,
    eagle:K, ngram:K (also fixed_K, ...); ModeError naming the valid modes."""
    text = text.strip()
    arms = canonical(arms)
    runnable = [a for a in arms if usable(a, has_draft, has_head, has_parallel)]
    valid = ", ".join(["target", "bandit", *(fixed(a).spec for a in runnable if a != "0")])
    if text == "target":
        return Mode("target")
    if text == "bandit":
        if not any(a != "0" for a in runnable):
            raise ModeError(
                "mode 'bandit' needs a speculative arm it can run (draft:K with a draft model, "
                "pard:K with a parallel draft, eagle:K with an EAGLE-3 head, or ngram:K), and "
                "has none"
            )
        return Mode("bandit")
    try:
        arm = parse_arm(text.replace("_", ":", 1))
    except ValueError:
        raise ModeError(f"unknown mode {text!r}: the valid modes are {valid}") from None
    if arm.needs_draft and not has_draft:
        raise ModeError(
            f"mode {text!r} needs a draft model, and none is loaded; valid here: {valid}"
        )
    if arm.needs_head and not has_head:
        raise ModeError(
            f"mode {text!r} needs an EAGLE-3 head, and none is loaded; valid here: {valid}"
        )
    if arm.needs_parallel and not has_parallel:
        raise ModeError(
            f"mode {text!r} needs a draft trained for parallel drafting (its config names a "
            f"pard_token), and the loaded one is not; valid here: {valid}"
        )
    if str(arm) not in arms and arm != PLAIN:
        raise ModeError(f"bad mode {text!r}: not one of the configured arms; valid: {valid}")
    return fixed(arm)


@dataclass
class CoreResult:
    text: str
    finish_reason: str  # "stop" | "length" | "abort" (the client left)
    mode: Mode
    result: GenerationResult
    decision: Decision | None
    stopped_by_string: bool = False
    guard_event: dict | None = None  # the drift guard fell back or recovered after this request
    draft: str | None = None  # the draft version it joined on
    rows: int = 1  # rows in the batch when it joined, itself included (the policy's load)
    temperature: float = 0.0  # what it sampled at (0: greedy)
    # Asked for: per token of `text`, (token id, logprob, [(token id, logprob), ...top n]).
    logprobs: list | None = None

    @property
    def goodput(self) -> float:
        """Tokens over the request's cost to the batch (the policy's reward; alone: tokens/s)."""
        r = self.result
        cost = r.cost_s if r.cost_s else r.latency_s
        return r.output_tokens / cost if cost > 0 else 0.0

    def record(self) -> dict:
        """The request's figures, flat; decision fields None if the bandit did not choose."""
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
            "guess_rounds": r.rounds if r.guess_rounds is None else r.guess_rounds,
            "acceptance": r.acceptance,
            "eligible_per_position": r.eligible_per_position,
            "proposed_per_position": r.proposed_per_position,
            "accepted_per_position": r.accepted_per_position,
            "latency_s": r.latency_s,
            "queued_s": r.queued_s,
            "first_token_s": r.first_token_s,
            "draft_s": r.draft_s,
            "verify_s": r.verify_s,
            "cost_s": r.cost_s,
            "tokens_per_second": r.tokens_per_second,
            "goodput": self.goodput,
            "batch_rows": r.batch_rows,
            "temperature": self.temperature,
            "rows": self.rows,
            "explored": d.explored if d else None,
            "warmup": d.warmup if d else None,
            "fallback": d.fallback if d else None,  # held to plain generation by the drift guard
            "probe": d.probe if d else None,  # the drift guard's probe of the best speculative arm
            "deferred": d.deferred if d else None,  # plain won at its load: the gate decides
            "epsilon": d.epsilon if d else None,
            "guard_event": self.guard_event["event"] if self.guard_event else None,
        }


@dataclass(eq=False)
class Request:
    """One request, handed to the core once. `future` gets a `CoreResult`, `Cancelled` (cancelled
    before joining) or the error. `on_text(delta, logprobs)` gets final text as it grows, with
    the entries of the tokens spelling it, on the scheduler's thread: it must not block. Set
    `cancel` to leave after the current step with the text so far."""

    prompt_ids: list[int]
    max_tokens: int
    mode: Mode
    stop: list[str] = field(default_factory=list)
    on_text: Callable[[str, list], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    sampling: Sampling = GREEDY  # temperature, top_p, top_k, seed, logprobs

    def result(self, timeout: float | None = None) -> CoreResult:
        return self.future.result(timeout)
