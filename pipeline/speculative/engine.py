"""Greedy speculative decoding: a proposer guesses k tokens, the target checks them in one pass.

The engine knows models and token ids; it knows nothing of HTTP, Sentry or files. Timing and
counts come back in the result, and callers record them.

Invariant kept by the loop (`seq` = prompt + committed output):
  - the target's KV cache holds seq[:-1]; the last committed token is still to be fed;
  - a stateful proposer (the draft model) holds some prefix of seq (it catches up next turn).
One round with arm k: the proposer (`proposers.py`: the draft model, or prompt lookup) offers
up to k guesses d1..dk; the target feeds [seq[-1], d1..dk] once and yields its own greedy
choice p1..p(k+1) at every position. The longest prefix with d_i == p_i is accepted, and p(m+1)
(the target's correction, or a bonus token when all k matched) is committed too. The target's
cache and the proposer are then cut back to what is valid. Every committed token is the
target's own greedy choice, so the output equals target-only greedy decoding for every arm
(arm 0 runs the same loop with no proposer; a round with no guesses is a plain step).

Two cost cutters, neither of which changes a committed token: static caches and compiled
steps (`steps.py`), and a pruned draft head (`proposers.Drafter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StaticCache

from .proposers import PROPOSERS, Drafter, Proposer
from .sampling import greedy_ids
from .steps import ModelStep, context_limit, crop_to, warm_up


@dataclass
class GenerationResult:
    token_ids: list[int]
    arm: str  # the arm's id: "0", "draft:K", "ngram:K" (arms.Arm)
    finish_reason: str  # "stop" (end-of-turn token or caller's stop) | "length"
    latency_s: float
    draft_s: float
    verify_s: float
    prompt_tokens: int
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    # Per position: the rounds that could guess there (None, the one-request engine: taken as
    # every round, to its k, its budget's last rounds included), those that did, and those
    # whose guesses up to it were all accepted.
    eligible_per_position: list[int] | None = None
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    guess_rounds: int | None = None  # the step loop: rounds it was let guess (None: all)
    first_token_s: float | None = None  # from the start to the first committed token
    cost_s: float | None = None  # the step loop: its prefill plus its shares of the steps
    queued_s: float = 0.0  # the step loop: from submission to joining
    batch_rows: float = 1.0  # the step loop: the mean number of rows in its steps
    # Asked for (`Sampling.logprobs`): per token (logprob, [(token id, logprob), ...top n]).
    logprobs: list | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


@dataclass
class _State:
    """One generation's running state: `seq` = prompt + committed output, the target's cache,
    the proposer, and the counts the result reports."""

    seq: list[int]
    t_cache: DynamicCache | StaticCache
    proposer: Proposer | None
    proposed_pos: list[int]
    accepted_pos: list[int]
    out: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0


def target_logits(model, inp: torch.Tensor, cache, keep: int) -> torch.Tensor:
    """The target's scores for the last `keep` positions of one fed row."""
    return model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=keep).logits[0]


class SpeculativeEngine:
    """A target and an optional same-tokenizer draft, both on one device, greedy decoding."""

    def __init__(
        self,
        target,
        draft=None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        static_len: int | None = None,
        draft_token_ids: Sequence[int] | None = None,
        share_target: SpeculativeEngine | None = None,
        head=None,
    ):
        """`static_len`: preallocated caches of that many positions (needed to compile);
        `draft_token_ids`: prune the draft's head to these ids; `share_target`: an engine over
        the same target whose target step (static cache, compiled graph) this one uses
        (engines that share must not generate at the same time); `head`: an EAGLE-3 head
        (`eagle3.Eagle3Head`) over this target, for eagle:K arms in the step loop."""
        self.target = target
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = (
            pad_token_id if pad_token_id is not None else min(self.eos_token_ids, default=0)
        )
        self.device = next(target.parameters()).device
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocab ({draft.config.vocab_size}) differs from target's "
                f"({target.config.vocab_size}): they must share a tokenizer"
            )
        self._model_context = context_limit(target, draft)
        if static_len is not None:
            static_len = min(static_len, self._model_context or static_len)
        if share_target is not None:
            if share_target.target is not target or share_target.static_len != static_len:
                raise ValueError("share_target: another target, or another static cache length")
            self.target_step = share_target.target_step
        else:
            self.target_step = ModelStep(target, target_logits, static_len)
        if draft_token_ids is not None and draft is None:
            raise ValueError("a pruned draft head needs a draft")
        if head is not None and head.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the eagle3 head's vocabulary ({head.config.vocab_size}) is not the target's "
                f"({target.config.vocab_size})"
            )
        self.head = head
        self.draft = draft
        self.drafter = Drafter(draft, static_len, draft_token_ids) if draft is not None else None

    @property
    def static_len(self) -> int | None:
        return self.target_step.static_len

    @property
    def max_context(self) -> int | None:
        """The longest prompt + output: the static caches' length, else the models' limit."""
        return self.static_len if self.static_len is not None else self._model_context

    @property
    def compiled(self) -> bool:
        return self.target_step.compiled

    @property
    def draft_head_ids(self) -> list[int] | None:
        """The ids the draft's head scores; None: the full vocabulary (or no draft)."""
        return None if self.drafter is None else self.drafter.head_token_ids

    def _steps(self, with_draft: bool = True) -> list[ModelStep]:
        return [self.target_step, *([self.drafter.step] if self.drafter and with_draft else [])]

    def compile_steps(
        self, arms: Sequence[int], mode: str | None = None, backend: str = "inductor", draft=True
    ) -> None:
        """Run the short feeds of these arms (k values: one-token decode, each verify of k+1,
        the draft's catch-up) through `torch.compile`d steps; prefill stays eager. Needs static
        caches. Each shape compiles on first use (`warm_up` triggers them all). `draft=False`
        leaves the draft's step eager."""
        for step in self._steps(with_draft=draft):
            step.compile(max(arms, default=0) + 1, mode, backend)

    def uncompile(self) -> None:
        """Back to eager steps and growing caches (`ModelStep.uncompile`)."""
        for step in self._steps():
            step.uncompile()

    def warm_up(
        self,
        arms: Sequence[int],
        on_shape: Callable[[str, int, int, int, float], None] | None = None,
    ) -> None:
        """Run every shape these arms use once (`steps.warm_up`), so a compiled engine has
        compiled everything before it serves."""
        warm_up(self.target_step, self.drafter.step if self.drafter else None, arms,
                self.pad_token_id, on_shape)  # fmt: skip

    def proposer(self, strategy: str, k: int) -> Proposer | None:
        """A fresh proposer for one generation with arm `strategy:k` (None for k = 0)."""
        cls = PROPOSERS.get(strategy)
        if strategy == "eagle" and k:
            raise ValueError(
                "eagle:K runs in the step loop (`batch.RowBatch`), which reads the target's "
                "hidden states from each verify pass; engine.generate has no such pass"
            )
        if cls is None:
            raise ValueError(f"unknown draft strategy {strategy!r}: one of {sorted(PROPOSERS)}")
        if k == 0:
            return None
        if cls.needs_draft and self.drafter is None:
            raise ValueError(f"arm {strategy}:{k} needs a draft model; this engine has none")
        return cls(self.drafter)

    def generate(
        self,
        prompt_ids: Sequence[int],
        k: int,
        max_new_tokens: int,
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[list[int]], bool] | None = None,
        strategy: str = "draft",
    ) -> GenerationResult:
        """Generate greedily with k guesses per round (0 = target only) from `strategy` ("draft":
        the draft model; "ngram": prompt lookup). `on_tokens` sees each round's new tokens;
        `should_stop(output_so_far)` ends generation early (stop strings, disconnects)."""
        if k < 0:
            raise ValueError("k must be >= 0")
        proposer = self.proposer(strategy, k)
        if not prompt_ids:
            raise ValueError("empty prompt")
        start = time.perf_counter()
        st = _State(
            seq=list(prompt_ids),
            t_cache=self.target_step.new_cache(),
            proposer=proposer,
            proposed_pos=[0] * k,
            accepted_pos=[0] * k,
        )
        n_prompt = len(st.seq)
        t0 = time.perf_counter()
        if n_prompt > 1:  # prefill: the target's cache holds seq[:-1]
            self.target_step(st.seq[:-1], st.t_cache, 1)
        st.verify_s += time.perf_counter() - t0

        finish = "length"
        first_token_s = None
        while len(st.out) < max_new_tokens:
            k_eff = min(k, max_new_tokens - len(st.out) - 1)
            if self.max_context is not None:
                if len(st.seq) >= self.max_context:
                    break
                k_eff = max(0, min(k_eff, self.max_context - len(st.seq) - 1))
            new, eos = self.speculative_round(st, k_eff)
            if first_token_s is None:
                first_token_s = time.perf_counter() - start
            if new and on_tokens is not None:
                on_tokens(new)
            if eos or (should_stop is not None and should_stop(st.out)):
                finish = "stop"
                break

        return GenerationResult(
            token_ids=st.out,
            arm="0" if k == 0 else f"{strategy}:{k}",
            finish_reason=finish,
            latency_s=time.perf_counter() - start,
            draft_s=st.draft_s,
            verify_s=st.verify_s,
            prompt_tokens=n_prompt,
            proposed=st.proposed,
            accepted=st.accepted,
            rounds=st.rounds,
            proposed_per_position=st.proposed_pos,
            accepted_per_position=st.accepted_pos,
            first_token_s=first_token_s,
        )

    def speculative_round(self, st: _State, k: int) -> tuple[list[int], bool]:
        """One round: the proposer offers up to k tokens, the target scores [last, d1..dk] in
        one pass, the longest agreeing prefix plus the target's own next token is committed,
        and the target's cache and the proposer are cut back to what is valid. Returns
        (committed tokens, hit end-of-turn)."""
        drafts: list[int] = []
        if k > 0 and st.proposer is not None:
            t0 = time.perf_counter()
            drafts = st.proposer.propose(st.seq, k)[:k]
            st.draft_s += time.perf_counter() - t0
        k = len(drafts)  # fewer guesses than asked (no n-gram match: none) is a shorter round

        t0 = time.perf_counter()
        logits = self.target_step([st.seq[-1], *drafts], st.t_cache, k + 1)
        preds = greedy_ids(logits).tolist()
        st.verify_s += time.perf_counter() - t0

        m = 0
        while m < k and drafts[m] == preds[m]:
            m += 1
        new = drafts[:m] + [preds[m]]
        st.rounds += 1
        st.proposed += k
        st.accepted += m
        for i in range(k):
            st.proposed_pos[i] += 1
            st.accepted_pos[i] += i < m
        # Keep only what is valid: seq + accepted drafts (the new last token is pending).
        crop_to(st.t_cache, len(st.seq) + m)
        if st.proposer is not None:
            st.proposer.rollback(len(st.seq) + m)

        eos = False
        for i, tok in enumerate(new):
            if tok in self.eos_token_ids:
                new, eos = new[:i], True
                break
        st.seq.extend(new)
        st.out.extend(new)
        return new, eos
