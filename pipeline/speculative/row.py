"""One request in the step loop (`Row`) and its result. Pure data."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .arms import Arm
from .sampling import GREEDY, Sampling


@dataclass
class GenerationResult:
    token_ids: list[int]
    arm: str  # the arm's id: "0", "draft:K", "ngram:K", "eagle:K" (arms.Arm)
    finish_reason: str  # "stop" (end-of-turn token or caller's stop) | "length"
    latency_s: float
    draft_s: float
    verify_s: float
    prompt_tokens: int
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    # Per position: steps that could guess there, did, and had guesses up to it all accepted.
    eligible_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    guess_rounds: int | None = None  # steps it was let guess
    first_token_s: float | None = None  # from the start to the first committed token
    cost_s: float | None = None  # its prefill plus its shares of the steps
    queued_s: float = 0.0  # from submission to joining
    batch_rows: float = 1.0  # the mean number of rows in its steps
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


@dataclass(eq=False)
class Row:
    """One request in the batch. `seq` = prompt + output; target cache row `tslot` holds
    `seq[:-1]` between steps. `dslot`, `ngram`, `hcache`, `aux_new` (target states the head has
    not read) belong to the row's proposer."""

    key: object  # the caller's handle, returned with the row
    prompt: list[int]
    max_tokens: int
    arm: Arm
    epoch: int  # the batch's draft epoch when it joined
    start: float
    tslot: int
    proposer: object = None  # what guesses for it (`propose.Proposer`); None: it never guesses
    dslot: int | None = None
    ngram: object = None
    hcache: object = None
    aux_new: list = field(default_factory=list)
    sampling: Sampling = GREEDY
    gen: object = None  # the row's torch.Generator (sampled rows)
    q: list = field(default_factory=list)  # the draft's distribution for each guess (sampled)
    logprobs: list | None = None  # per token: (logprob, [(token, logprob), ...])
    seq: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    k_eff: int = 0  # the most it may guess this step
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    guess_rounds: int = 0  # steps it was let guess (k_eff > 0)
    adaptive: bool = False  # its guesses are gated per step by the batch (`step`'s gate)
    eligible_pos: list[int] = field(default_factory=list)
    proposed_pos: list[int] = field(default_factory=list)
    accepted_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    cost_s: float = 0.0
    first_s: float | None = None
    rows_seen: int = 0  # the sum, over its steps, of the rows in the step (its mean batch size)

    def charge(self, seconds: float, drafting: bool = False) -> None:
        """Add `seconds` to its cost, as drafting or as verifying."""
        if drafting:
            self.draft_s += seconds
        else:
            self.verify_s += seconds
        self.cost_s += seconds

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
