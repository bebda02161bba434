"""Proposers, one file each, behind one batched surface the step loop calls per proposer:
  - `join(rows, states)`: rows prefilled in the target; `states[i]`: target states at row i's
    prompt positions if the proposer reads layers `taps`, else None; returns seconds to charge;
  - `propose(rows) -> Drafts`: up to `row.k_eff` guesses after each row's `seq` (fewer is fine);
  - `accepted(row, length, states)`: the target kept `length` tokens of the row's fed sequence;
    cut own state back; `states`: target states at the positions just committed;
  - `leave(row)`.
Verification is the same for every proposer, so all are lossless; a sampled row's guesses come
with their distributions (`Drafts.q`). A new proposer: one file here plus its entry in
`arms.STRATEGIES` and `batch.RowBatch._proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Drafts:
    """What `propose` returns for its rows, in order."""

    tokens: list[list[int]]  # per row: at most k_eff guesses
    q: list[list[torch.Tensor]]  # per row, per guess: distribution [target vocab]; greedy: []
    seconds: list[float] | None  # per row: its drafting share; None: part of the step's time


class Proposer(Protocol):
    taps: tuple[int, ...]  # target layers whose inputs it reads (an EAGLE-3 head's), or ()

    def join(self, rows: list, states: list[torch.Tensor | None]) -> float: ...

    def propose(self, rows: list) -> Drafts: ...

    def accepted(self, row, length: int, states: torch.Tensor | None) -> None: ...

    def leave(self, row) -> None: ...


def full_distribution(q: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """`q` over the target's `vocab`, zero-filled (a pruned head's over `ids`, or a smaller vocab)."""
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
    """Whether a row's catch-up read is at most one step's commit (`arm.k` + 1): only such
    passes feed a proposer's cost curve (a first turn or a held-back row's catch-up does not)."""
    return fresh <= row.arm.k + 1
