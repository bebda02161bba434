"""Proposers: where a step's guesses come from, one file each, behind one batched surface.

The step loop (`batch.RowBatch`) gives each row the proposer of its arm's strategy
(`arms.STRATEGIES`) and calls, for the rows of one proposer:
  - `join(rows, states)`: the rows joined (their prompts prefilled in the target's cache);
    `states[i]`: the target's states at row i's prompt positions, if the proposer reads
    target layers (`taps`), else None;
  - `propose(rows) -> Drafts`: up to `row.k_eff` guesses after each row's `seq` (prompt +
    committed output); fewer, or none, is allowed (the row then verifies what there is);
  - `accepted(row, length, states)`: the target kept the first `length` tokens of the row's
    fed sequence (its seq plus the accepted guesses); a stateful proposer cuts its own state
    back to them; `states`: the target's states at the positions just committed (`taps`);
  - `leave(row)`: the row is gone.
Verification (`sampling.verify`, and the greedy rule in `batch.RowBatch`) is the same for every
proposer, so every proposer is lossless. A sampled row's guesses are drawn from the proposer's
own distribution, returned with them (`Drafts.q`) for the rejection rule.

Members: `ngram.NgramProposer` (prompt lookup, no model), `draft_model.DraftModelProposer` (a
same-tokenizer draft model, one batched pass per position), `eagle.EagleProposer` (an EAGLE-3
head over the target's hidden states). A new proposer is one file here and its strategy's
entry in `arms.STRATEGIES` and `batch.RowBatch._proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Drafts:
    """What `propose` returns for its rows, in order."""

    tokens: list[list[int]]  # per row: its guesses, at most its k_eff
    q: list[list[torch.Tensor]]  # per row, per guess: the draft's distribution [target vocab]
    # (sampled rows; [] for greedy ones)
    seconds: list[float] | None  # per row: its share of the drafting time; None: not priced
    # apart (the time is part of the step's, as prompt lookup's is)


class Proposer(Protocol):
    taps: tuple[int, ...]  # target layers whose inputs it reads (an EAGLE-3 head's), or ()

    def join(self, rows: list, states: list[torch.Tensor | None]) -> None: ...

    def propose(self, rows: list) -> Drafts: ...

    def accepted(self, row, length: int, states: torch.Tensor | None) -> None: ...

    def leave(self, row) -> None: ...


def full_distribution(q: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """A draft distribution over the target's `vocab` tokens: a pruned head's `q` (over `ids`)
    zero elsewhere; a draft with a smaller vocabulary, zero-padded."""
    if ids is None and q.shape[-1] == vocab:
        return q
    full = q.new_zeros(vocab)
    if ids is None:
        n = min(q.shape[-1], vocab)
        full[:n] = q[:n]
    else:
        full[ids] = q
    return full


def steady(row, fresh: int) -> bool:
    """Whether a row's proposer reads no more than one step commits (`arm.k` + 1 tokens) before
    it guesses. A first turn reads the whole prompt, and a row the gate held back catches up on
    every step it sat out: those reads are the row's (charged to it), but not the price of a
    guess, which is what a proposer's cost curve is for (docs/serving.md)."""
    return fresh <= row.arm.k + 1
