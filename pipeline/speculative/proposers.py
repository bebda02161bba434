"""Proposers: where a round's guesses come from. One small surface for every strategy.

A proposer serves one generation (the engine makes a fresh one per request):
  - `propose(seq, k) -> list[int]`: up to k guesses after `seq` (prompt + committed output);
    fewer, or none, is allowed (the round then verifies what there is: a plain step for none);
  - `rollback(length)`: the target kept the first `length` tokens of what was fed (seq plus the
    accepted guesses); a stateful proposer cuts its own state back to them.
Verification is the engine's, the same for every strategy, so every strategy is lossless.

Members (`PROPOSERS`, keyed by the arm's strategy, `arms.STRATEGIES`):
  - `DraftModelProposer` ("draft"): a same-tokenizer draft model guesses greedily, one pass per
    token, after catching up on what the target committed since its last turn; its KV cache is
    rolled back like the target's. Optionally over a pruned head (`Drafter`).
  - `NgramProposer` ("ngram"): prompt lookup, the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens (n = max_n..1); no model pass, no cache.
A new strategy is one class here, its entry in `PROPOSERS`, and its name in `arms.STRATEGIES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from .steps import ModelStep, crop_to


class Proposer(Protocol):
    needs_draft: bool  # constructed with the engine's Drafter (else with None)

    def propose(self, seq: list[int], k: int) -> list[int]: ...

    def rollback(self, length: int) -> None: ...


def draft_token(model, inp: torch.Tensor, cache, head, head_ids) -> torch.Tensor:
    """The draft's greedy next token after one fed row; with `head` (rows of the output
    embedding for `head_ids`) only those tokens are scored."""
    if head is None:
        return (
            model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=1)
            .logits[0, -1]
            .argmax()
        )
    hidden = model.base_model(input_ids=inp, cache=cache, use_cache=True).last_hidden_state
    # No .item() (a graph break), and not torch.take (inductor cannot lower it on a CPU).
    return head_ids.index_select(0, F.linear(hidden[0, -1], head).argmax().view(1))[0]


class Drafter:
    """A draft model as the loop runs it: its step (a feed -> its greedy next token) and,
    with `token_ids`, a pruned head: only those ids are scored (a slice of its output head,
    made here; the model itself is not changed, so it may be shared or be the target). A token
    outside the subset is simply never guessed; verification always uses the full vocabulary."""

    def __init__(
        self, model, static_len: int | None = None, token_ids: Sequence[int] | None = None
    ):
        self.model = model
        head = ids = None
        if token_ids is not None:
            ids = torch.tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
            vocab = model.config.vocab_size
            if len(ids) == 0 or int(ids.max()) >= vocab or int(ids.min()) < 0:
                raise ValueError(
                    f"draft head subset must be ids in [0, {vocab}), got {len(ids)} ids"
                )
            ids = ids.to(next(model.parameters()).device)
            head = model.get_output_embeddings().weight.detach()[ids].clone()
        self.head_ids = ids
        self.step = ModelStep(model, draft_token, static_len, args=(head, ids))

    @property
    def head_token_ids(self) -> list[int] | None:
        """The ids the head scores; None: the full vocabulary."""
        return None if self.head_ids is None else self.head_ids.tolist()

    def next_token(self, ids: list[int], cache) -> int:
        return int(self.step(ids, cache))


class DraftModelProposer:
    """k greedy guesses of the draft model, one pass each; its cache holds a prefix of seq."""

    needs_draft = True

    def __init__(self, draft: Drafter):
        self.draft = draft
        self.cache = draft.step.new_cache()

    def propose(self, seq: list[int], k: int) -> list[int]:
        feed = seq[int(self.cache.get_seq_length()) :]  # catch up on what was committed
        out: list[int] = []
        for _ in range(k):
            feed = [self.draft.next_token(feed, self.cache)]
            out.append(feed[0])
        return out

    def rollback(self, length: int) -> None:
        crop_to(self.cache, length)


class NgramProposer:
    """Prompt lookup over a growing sequence. For every n-gram (n = 1..max_n) that has a token
    after it, the position of that token in its latest occurrence; `propose` looks up the
    sequence's last n tokens, longest n first. Updated incrementally, so a round costs
    O(new tokens), not O(sequence)."""

    needs_draft = False

    def __init__(self, draft: Drafter | None = None, max_n: int = 3):
        self.max_n = max_n
        self.follower: dict[tuple[int, ...], int] = {}
        self.indexed = 1  # positions p < indexed have been registered as followers

    def _extend(self, seq: list[int]) -> None:
        for p in range(self.indexed, len(seq)):
            for n in range(1, min(self.max_n, p) + 1):
                self.follower[tuple(seq[p - n : p])] = p
        self.indexed = max(self.indexed, len(seq))

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of seq's last n tokens (n from
        max_n down to 1); [] when none of them occurred before."""
        self._extend(seq)
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            p = self.follower.get(tuple(seq[-n:]))
            if p is not None:
                return seq[p : p + k]
        return []

    def rollback(self, length: int) -> None:
        pass  # it indexes committed tokens only


PROPOSERS: dict[str, type] = {"draft": DraftModelProposer, "ngram": NgramProposer}
